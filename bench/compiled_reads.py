"""What inductor generates on the CPU for the torch fold's passes (ffmem.engine.mining.fold_passes.compiled),
for `python -m bench.torch_fold --reads`: its loop nests that read the group's coefficients.

On the CPU inductor writes a compiled graph's kernels into one C++ function, each kernel a loop nest at the
top of its body. A nest reads a [layers, batch, pos, keys] tensor whole where it loads it at an index of
its loop variables alone (a gather, an index holding a loaded value, reads a few positions: not a pass);
the tensors of that shape are the coefficients c, the inputs u and the buffers the code allocates so.
"""

from __future__ import annotations

import re
import time

import torch

# The coefficients' and inputs' names in the generated code: the compiled function's 5th and 6th
# arguments (after the four sizes of a dynamic shape).
INPUTS = {"arg4_1": "c", "arg5_1": "u"}
ELEMENT_BYTES = {"torch.float32": 4, "torch.int32": 4, "torch.int64": 8, "torch.bool": 1, "torch.uint8": 1}


def loop_nests(code: str) -> list[dict[str, list[str]]]:
    """Each top-level loop nest of the generated module `code`'s C++ kernel: the [layers, batch, pos, keys]
    tensors it reads whole ("reads") and writes ("writes"), by name ("c", "u" or a buffer's)."""
    signature = re.search(r'extern "C"\s+void\s+kernel\((.*?)\)\s*\{', code, re.S)
    parameters = [p.strip().split()[-1] for p in signature.group(1).split(",")]
    call = re.search(r"\n\s+cpp_fused\w+\((.*?)\)\n", code[code.index("def call") :])
    name_of = dict(zip(parameters, (a.strip() for a in call.group(1).split(",")), strict=False))
    for alias, name in re.findall(r"auto (\w+) = (\w+);", code):  # an output written in place of an input
        if name in name_of:
            name_of[alias] = name_of[name]
    full = dict(INPUTS)
    for buffer in re.findall(r"(buf\d+) = empty_strided_cpu\(\(s\d+, s\d+, s\d+, s\d+\)", code):
        full[buffer] = buffer
    nests, depth, lines = [], 1, None
    for line in code[signature.end() :].split("\n"):
        if depth == 1 and line.strip() == "{":
            lines = []
        if lines is not None:
            lines.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 1 and lines is not None:
            nests.append(_accesses("\n".join(lines), name_of, full))
            lines = None
        if depth == 0:
            break
    return nests


def _accesses(nest: str, name_of: dict[str, str], full: dict[str, str]) -> dict[str, list[str]]:
    reads, writes = set(), set()
    access = r"\b((?:in_|out_|in_out_)ptr\d+)(\s*\+\s*|\[)static_cast<int64_t>\((.*?)\)(,|\]|\))"
    for found in re.finditer(access, nest):
        name = full.get(name_of.get(found.group(1), ""))
        if name is None:
            continue
        if ".store(" in nest[max(0, found.start() - 8) : found.start()] or re.match(
            r"\s*=(?!=)", nest[found.end() :]
        ):
            writes.add(name)
        elif "tmp" not in found.group(3):  # not a gather
            reads.add(name)
    return {"reads": sorted(reads), "writes": sorted(writes)}


def element_bytes(code: str, name: str) -> int:
    """The bytes of one element of `name` ("c", "u": float32; a buffer: as the code allocates it)."""
    if name in INPUTS.values():
        return 4
    dtype = re.search(rf"{name} = empty_strided_cpu\(.*?(torch\.\w+)\)", code).group(1)
    return ELEMENT_BYTES[dtype]


def reads(code: str) -> dict:
    """The generated `code`'s figures: its loop nests that read c whole, those that read or write any tensor
    of c's shape, and the bytes such reads and writes move a coefficient."""
    nests = loop_nests(code)
    moved = sum(element_bytes(code, name) for nest in nests for name in nest["reads"] + nest["writes"])
    return {
        "nests_reading_c": sum("c" in nest["reads"] for nest in nests),
        "nests_over_the_group": sum(bool(nest["reads"] or nest["writes"]) for nest in nests),
        "bytes_a_coefficient": moved,
        "nests": [nest for nest in nests if nest["reads"] or nest["writes"]],
    }


def compare(arguments: tuple, repeats: int) -> dict:
    """Both compiled forms of the passes (fold_passes.compiled: `reductions` as before, `fused_reductions`
    now) on `arguments` (c, u, mined, anchor, key offsets, code bins) with inductor: each one's generated
    code's figures (`reads`), their outputs' agreement (where a quadrant's extreme is not `present`, and a
    row with nothing mined, they differ by design: fused_reductions), and their processor seconds over
    `repeats` rounds after the runs that compile them, interleaved; the earlier over the fused, a round's
    ratio each."""
    from torch._inductor.utils import run_and_get_code

    from ffmem.engine.mining import fold_passes

    forms = {"then": fold_passes.compiled(fused=False), "now": fold_passes.compiled(fused=True)}
    figures, outputs = {}, {}
    for name, passes in forms.items():
        outputs[name], codes = run_and_get_code(passes, *arguments)
        figures[name] = reads("\n".join(codes))
    then, now = outputs["then"], outputs["now"]
    has_mined = arguments[2].any(dim=1)  # [batch]: a row with nothing mined has no extreme to compare
    present = now.quadrant_present  # [4, layers, batch, keys]: where a quadrant's extreme counts

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN equal to NaN
        return bool(((a == b) | (a.isnan() & b.isnan())).all())

    same = [
        same(then.extreme[..., has_mined, :], now.extreme[..., has_mined, :]),
        torch.equal(then.at, now.at),
        torch.equal(then.histogram, now.histogram),
        torch.equal(then.quadrant_count, now.quadrant_count),
        torch.equal(then.quadrant_present, present),
        same(then.quadrant_extreme[present], now.quadrant_extreme[present]),
        torch.equal(then.quadrant_at[present], now.quadrant_at[present]),
        torch.allclose(then.total, now.total, rtol=1e-12, atol=1e-6),
    ]
    figures["same_reductions"] = all(same)
    for passes in forms.values():  # run_and_get_code compiled under its own settings: once more outside them
        passes(*arguments)
    seconds: dict[str, list[float]] = {name: [] for name in forms}
    for round_ in range(repeats):
        for name in list(forms) if round_ % 2 == 0 else list(forms)[::-1]:
            start = time.process_time()
            forms[name](*arguments)
            seconds[name].append(time.process_time() - start)
    figures["seconds"] = {name: [round(t, 4) for t in times] for name, times in seconds.items()}
    figures["then_over_now"] = [round(a / b, 2) for a, b in zip(seconds["then"], seconds["now"], strict=True)]
    return figures
