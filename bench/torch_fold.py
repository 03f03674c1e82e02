"""The torch fold (ffmem.engine.mining.fold_torch) against an older revision's: passes and seconds a batch.

    OMP_NUM_THREADS=1 python -m bench.torch_fold --against 5a96198 --repeats 3 --compiled --bar

At a model's shape (default SmolLM2-135M's: 30 layers of 1536 keys, gated, a batch of 32 sentences of 64
positions, T = 50), one random batch folded by both folds, a whole group of layers at once as a GPU folds
it (`MiningState.fold_tensors`), into a state already holding one batch:
- passes: the aten operators each fold dispatches on the meta device (shapes, no data; on a GPU's code
  path) that read or write a tensor as large as the group's coefficients, by name, and the bytes they
  move a coefficient (what a GPU's memory pays; a compiled fold's kernels are not aten operators);
- seconds: each fold's processor time a batch on the CPU (time.process_time: what it computed, not what
  it waited for on a loaded machine; with more threads, all of theirs) with `--threads` torch threads
  (default 1), the folds interleaved over `--repeats` rounds after one uncounted, and the older over the
  newer, one ratio a round. On a shared machine only that ratio means anything. With `--compiled`, the
  working tree's fold with its passes compiled too (fold_passes.compiled; compiled once, in the uncounted
  round). With `--bar`, the working tree's fold with its lists merged in the bar form (fold_torch), eager
  and (with `--compiled`) compiled, timed in the same rounds: the merge form over the bar form, one ratio
  a round; and the lists' merge alone in both forms (`merge_seconds`; `--lists-only`: that alone, into
  "torch_fold_lists"). With `--reads`, the passes alone, compiled by inductor as before
  fold_passes.fused_reductions and now (bench.compiled_reads): the loop nests of the generated code that
  read the coefficients c whole, the bytes they move a coefficient, and each form's processor seconds for
  one group of `--layers` (the fold's group: every layer of a batch), into "torch_fold_reads":

    OMP_NUM_THREADS=1 python -m bench.torch_fold --reads --repeats 5
Figures go into bench-results.json under "torch_fold".
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import compiled_reads, harness
from ffmem.engine.mining import fold_torch
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.mined_layer import QUADRANT_EXAMPLES
from ffmem.engine.mining.state import MiningState

# Operators that move no data (views, allocations) or read only what they write (a gather of a few
# positions): no pass over a tensor, however large.
NO_PASS = {"alias", "as_strided", "detach", "empty", "expand", "gather", "permute", "select", "slice", "view"}


class Passes(TorchDispatchMode):
    """Counts the aten operators dispatched while active that read or write `size` elements or more (a
    pass over them), but NO_PASS's, and the bytes they move a coefficient: each such tensor read (an
    argument) or written (the result, or an `out=`) once, an in-place operator's both."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.names, self.bytes = size, Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func).removeprefix("aten.")
        if name.split(".")[0] in NO_PASS:
            return out
        read = [x for x in (*args, *(kwargs or {}).values()) if isinstance(x, torch.Tensor)]
        written = [x for x in (out if isinstance(out, tuple) else (out,)) if isinstance(x, torch.Tensor)]
        large = [x for x in (*read, *written) if x.numel() >= self.size]
        if large:
            self.names[name] += 1
            self.bytes += sum(x.element_size() for x in large)  # an out= and a result are the same tensor
            if "out" in (kwargs or {}):
                self.bytes -= kwargs["out"].element_size() if kwargs["out"].numel() >= self.size else 0
        return out


def random_batch(layers: int, rows: int, positions: int, keys: int, device: str = "cpu"):
    """(coefficients m = silu(x·g)·(x·u), inputs x·u [layers, rows, positions, keys], Batch): rows of 8 to
    `positions` tokens, the first (a BOS) not mined."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, positions + 1, (rows,), generator=generator)  # [rows]
    mined = torch.arange(positions)[None] < lengths[:, None]  # [rows, positions]
    mined[:, 0] = False
    shape = (layers, rows, positions, keys)
    inputs = torch.randn(shape, generator=generator)  # [layers, rows, positions, keys]
    coefficients = torch.nn.functional.silu(torch.randn(shape, generator=generator)).mul_(inputs)  # like it
    batch = Batch(torch.zeros(rows, positions, dtype=torch.long), mined.long(), mined, torch.arange(rows))
    return coefficients.to(device), inputs.to(device), batch.to(torch.device(device))


def folded_state(
    module, shape: tuple[int, int, int, int], top_k: int, device: str, **options: bool
) -> MiningState:
    """A gated MiningState on `device` whose torch fold is `module`'s TorchFold (`compiled=True`: its passes
    compiled; `bar=True`: its lists merged in the bar form)."""
    layers, _, _, keys = shape
    state = MiningState(layers, keys, top_k, device=device, gated=True)
    state._torch_fold = module.TorchFold(state, device, **options)
    return state


def passes(module, shape: tuple[int, int, int, int], top_k: int, **options: bool) -> tuple[Counter, int]:
    """The operators over whole groups in one fold of a batch by `module`'s TorchFold, on the meta device,
    and the bytes they move a coefficient."""
    coefficients, inputs, batch = random_batch(*shape, device="meta")
    state = folded_state(module, shape, top_k, "meta", **options)
    with Passes(coefficients.numel()) as counted:
        state.fold_tensors(slice(0, shape[0]), coefficients, batch, inputs)
    return counted.names, counted.bytes


def merge_seconds(shape: tuple[int, int, int, int], top_k: int, repeats: int) -> dict[str, dict[str, float]]:
    """The lists' merge alone (TorchFold._merge), in the merge form and the bar form, on random order keys of
    a group's shapes: the top-T of both signs ([2, layers, keys, T] kept and [2, layers, keys, rows] new,
    positions beside) and the quadrant examples ([layers, keys, 4, E] and [.., rows], positions and inputs
    beside). The processor seconds of each, the best of `repeats` rounds, the forms interleaved. Their work
    does not depend on the values (fixed shapes): random keys stand for any batch."""
    layers, rows, _, keys = shape
    generator = torch.Generator().manual_seed(1)

    def entries(kept_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:  # kept sorted, new, positions
        new_shape = (*kept_shape[:-1], rows)
        kept = (
            torch.randint(-(2**62), 2**62, kept_shape, generator=generator).sort(-1, descending=True).values
        )
        new = torch.randint(-(2**62), 2**62, new_shape, generator=generator)  # like new_shape
        positions = (torch.zeros(kept_shape, dtype=torch.long), torch.zeros(new_shape, dtype=torch.long))
        return kept, new, positions

    top = entries((2, layers, keys, top_k))  # [2, layers, keys, T] kept, [2, layers, keys, rows] new
    quadrants = entries((layers, keys, 4, QUADRANT_EXAMPLES))  # [layers, keys, 4, E], [.., rows]
    inputs = (torch.zeros(quadrants[0].shape), torch.zeros(quadrants[1].shape))  # float32, like them
    lists = {"top": (*top[:2], top[2]), "quadrants": (*quadrants[:2], quadrants[2], inputs)}
    state = MiningState(1, 1, top_k)  # _merge reads none of it
    forms = {form: fold_torch.TorchFold(state, "cpu", bar=form == "bar") for form in ("merge", "bar")}
    seconds = {name: {form: float("inf") for form in forms} for name in lists}
    for round_ in range(repeats):
        for form in list(forms) if round_ % 2 == 0 else list(forms)[::-1]:
            for name, arguments in lists.items():
                start = time.process_time()
                forms[form]._merge(*arguments)
                seconds[name][form] = min(seconds[name][form], time.process_time() - start)
    return seconds


def lists_alone(shape: tuple[int, int, int, int], top_k: int, repeats: int) -> dict:
    """merge_seconds's figures, printed: each list's seconds in both forms and the merge over the bar."""
    merges = merge_seconds(shape, top_k, max(repeats, 5))
    figures = {
        "merge_seconds": {name: {f: round(t, 4) for f, t in by.items()} for name, by in merges.items()}
    }
    for name, by in merges.items():
        ratio = by["merge"] / by["bar"]
        figures[f"{name}_merge_over_bar"] = round(ratio, 2)
        alone = f"merge {by['merge']:.3f} s, bar {by['bar']:.3f} s"
        print(f"{name} lists alone ({shape[1]} sentences a batch): {alone}; merge over bar {ratio:.2f}")
    return figures


def compiled_passes(shape: tuple[int, int, int, int], top_k: int, repeats: int, threads: int) -> dict:
    """The compiled passes (fold_passes.compiled) over one random group of `shape`, as inductor generates
    them before fused_reductions and now (bench.compiled_reads), printed."""
    coefficients, inputs, batch = random_batch(*shape)
    fold = fold_torch.TorchFold(MiningState(shape[0], shape[3], top_k, gated=True), "cpu")
    arguments = (coefficients, inputs, batch.mined, batch.anchor[0], fold._key_offsets, fold._code_bins)
    figures = {"shape": shape, "threads": threads, **compiled_reads.compare(arguments, repeats)}
    for form in ("then", "now"):
        found = figures[form]
        harness.log(f"{form}: loop nests over the group {found['nests']}")
        print(
            f"{form}: {found['nests_reading_c']} loop nests read c whole, "
            f"{found['nests_over_the_group']} read or write a tensor of its shape, "
            f"{found['bytes_a_coefficient']} bytes a coefficient; seconds {figures['seconds'][form]}"
        )
    ratios = figures["then_over_now"]
    figures["then_over_now_median"] = statistics.median(ratios)
    print(
        f"then over now: {statistics.median(ratios):.2f} (per round: {ratios}); the same reductions: "
        f"{figures['same_reductions']}"
    )
    return figures


def main() -> None:
    parser = harness.parser(__doc__, repeats=3)
    parser.add_argument("--against", default="5a96198", help="git revision of the older fold_torch.py")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--keys", type=int, default=1536)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compiled", action="store_true", help="time the compiled passes too")
    parser.add_argument("--bar", action="store_true", help="time the bar form of the lists' merge too")
    parser.add_argument("--lists-only", action="store_true", help="with --bar: the lists' merge alone")
    parser.add_argument("--reads", action="store_true", help="the compiled passes' reads of c, then and now")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (args.layers, args.rows, args.positions, args.keys)
    if args.bar and args.lists_only:  # no fold: the two forms of the lists' merge at this shape
        figures = {"shape": shape, "threads": args.threads, **lists_alone(shape, args.top_k, args.repeats)}
        harness.record(args, "torch_fold_lists", figures)
        return
    if args.reads:  # the compiled passes alone, before fused_reductions and now
        figures = compiled_passes(shape, args.top_k, args.repeats, args.threads)
        harness.record(args, "torch_fold_reads", figures)
        return
    folds = {
        "then": harness.module_at(args.against, ("ffmem/engine/mining/fold_torch.py",), "fold_torch_then"),
        "now": fold_torch,
    }
    figures = {"against": args.against, "shape": shape, "threads": args.threads, "passes": {}}
    options = {"then": {}, "now": {}}  # each fold's TorchFold options
    if args.bar:
        folds["bar"], options["bar"] = fold_torch, {"bar": True}
    for name, module in folds.items():
        counted, moved = passes(module, shape, args.top_k, **options[name])
        by_name = dict(sorted(counted.items()))
        figures["passes"][name] = {"total": sum(counted.values()), "bytes": moved, **by_name}
        harness.log(f"{name}: {sum(counted.values())} passes, {moved} bytes a coefficient: {by_name}")
    coefficients, inputs, batch = random_batch(*shape)
    states = {
        name: folded_state(module, shape, args.top_k, "cpu", **options[name])
        for name, module in folds.items()
    }
    if args.compiled:
        folds["compiled"] = fold_torch
        states["compiled"] = folded_state(fold_torch, shape, args.top_k, "cpu", compiled=True)
        if args.bar:
            folds["bar compiled"] = fold_torch
            states["bar compiled"] = folded_state(
                fold_torch, shape, args.top_k, "cpu", compiled=True, bar=True
            )
    work = torch.empty_like(coefficients)  # the fold overwrites its coefficients: a copy each time
    layers = slice(0, args.layers)
    seconds: dict[str, list[float]] = {name: [] for name in folds}
    for round_ in range(args.repeats + 1):
        batch.sentence_index += args.rows  # each round's sentences new
        for name in list(folds) if round_ % 2 == 0 else list(folds)[::-1]:
            state = states[name]
            work.copy_(coefficients)
            start = time.process_time()
            state.fold_tensors(layers, work, batch, inputs)
            if round_:  # the first round fills the states and workspaces: not counted
                seconds[name].append(time.process_time() - start)
        if round_:
            last = {name: times[-1] for name, times in seconds.items()}
            harness.log(f"round {round_}: " + ", ".join(f"{name} {t:.2f} s" for name, t in last.items()))
    for a, b in ((states["then"], other) for name, other in states.items() if name != "then"):
        for name in ("histogram", "quadrant_count", "quadrant_order", "sample_order"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name  # the same state
        assert torch.equal(a.top[1].order, b.top[1].order) and torch.equal(a.top[-1].order, b.top[-1].order)
    ratios = [then / now for then, now in zip(seconds["then"], seconds["now"], strict=True)]
    figures["seconds"] = {name: [round(t, 3) for t in times] for name, times in seconds.items()}
    figures["then_over_now"] = round(statistics.median(ratios), 2)
    if args.compiled:
        compiled = [then / now for then, now in zip(seconds["then"], seconds["compiled"], strict=True)]
        figures["then_over_compiled"] = round(statistics.median(compiled), 2)
        print(f"then over compiled: {figures['then_over_compiled']} (per round: {compiled})")
    if args.bar:  # the lists' merge alone, where the two forms differ
        figures.update(lists_alone(shape, args.top_k, args.repeats))
    for merge, bar in (("now", "bar"), ("compiled", "bar compiled")):
        if bar in seconds:  # the merge form over the bar form, eager and compiled
            over = [a / b for a, b in zip(seconds[merge], seconds[bar], strict=True)]
            figures[f"{merge}_over_{bar.replace(' ', '_')}"] = round(statistics.median(over), 2)
            rounds = ", ".join(f"{r:.2f}" for r in over)
            print(f"{merge} over {bar}: {statistics.median(over):.2f} (per round: {rounds})")
    print(
        f"passes over the group's coefficients: then {figures['passes']['then']['total']}, now "
        f"{figures['passes']['now']['total']} ({figures['passes']['then']['bytes']} and "
        f"{figures['passes']['now']['bytes']} bytes a coefficient); seconds a batch (median): then "
        f"{statistics.median(seconds['then']):.2f}, now {statistics.median(seconds['now']):.2f}; then over "
        f"now {figures['then_over_now']} (per round: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    harness.record(args, "torch_fold", figures)


if __name__ == "__main__":
    main()
