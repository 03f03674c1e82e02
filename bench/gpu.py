"""The mining fold on a GPU: parity with the CPU, then its speed over the bare forward at real size.

    PYTHONPATH=.gpu/wheels/pysbd-0.3.4-py3-none-any.whl:. python3 -m bench.gpu --out /tmp/gpu.json

On a CPU `MiningState.update` runs the compiled fold (ffmem.engine.mining.fold_cpu); on any other device the
torch fold (`MiningState.fold_tensors`), which this script checks and times on a CUDA device. Needs
torch, transformers, numpy and numba, no network and no ffmem.config (pydantic): the model is a
random-weight one, the corpus the bundled one, both read from the assets folder `--assets` (default
.gpu/ in the repository root: SmolLM2-135M's config.json and tokenizer files, summaries_en-us.json and
a pysbd wheel, ffmem's sentence splitter, imported straight from the wheel on PYTHONPATH).
The assets folder is git-ignored and under 10 MB: copy it along with the working tree.

1. Parity, float32 (TF32 off): tiny random models (a SwiGLU Llama and a GELU GPT-2, saved as Hugging Face
   folders and read by `load_model`) mine the same random-token sentences in the same batches on the
   device (torch fold) and on the CPU (compiled fold); every layer's MinedLayer is compared (top-T
   sentences and positions, coefficients, histogram, sum, band samples), and so are the captured
   coefficients of one batch. Then the same at real size: a random SmolLM2-135M on the corpus's first
   `--parity-sentences` sentences. A PASS or FAIL line per model: FAIL where over 0.5% of the top-T slots
   (or band samples, or histogram counts) differ, or the coefficients by more than 1e-4 relative.
2. Speed: the random SmolLM2-135M in bfloat16 and float32, over the corpus's sentences (`--sentences`,
   0: all, ~1.04M tokens) in the index's batches (`--batch-tokens` and 4× that): after one warm-up, the
   bare backbone forward and mining (`mine_batches` into a fresh MiningState) interleaved, `--rounds`
   rounds; tokens/s of each, mining over the bare forward (bare seconds / mining seconds, the figure of
   bench.mining_ratio) and the peak GPU memory. Stops starting passes after `--budget-s` seconds.

Prints a table at the end; `--out` writes every figure as JSON (after each part, so a run cut short
keeps what it measured). A dry run on the CPU (both sides CPU, the parity's device side forced onto
the torch fold): `python -m bench.gpu --device cpu --sentences 300`.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from bench.harness import ROOT, START, log
from bench.tiny_tokenizer import tiny_tokenizer
from ffmem.engine.mining import corpus
from ffmem.engine.mining.batches import corpus_batches, mine_batches
from ffmem.engine.mining.corpus import Batch, tokenize
from ffmem.engine.mining.mined_layer import EMPTY_SAMPLE, SIGNS
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.model.loading import load_model

# ffmem.config's defaults (importing it needs pydantic-settings, absent on the device machine).
BATCH_TOKENS = 4096
TOP_K = 50
MAX_SENTENCE_TOKENS = 128
FORBIDDEN = ("pydantic", "pydantic_settings", "sqlalchemy", "fastapi")  # must not be imported
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CORPUS_FILE = "summaries_en-us.json"
# .gpu/ where it was made; else the wheelhouse's tokenizer (`make wheelhouse`), the rest from bench.shapes
ASSETS = ROOT / ".gpu" if (ROOT / ".gpu").is_dir() else ROOT / ".whl" / "tokenizer"
MISMATCH_SHARE = 0.005  # FAIL above this share of differing top-T slots, band samples or histogram counts
COEFFICIENT_REL = 1e-4  # FAIL above this |Δ coefficient| / the largest |coefficient|
WARM_BATCHES = 16  # batches of the mining warm-up (the bare warm-up runs them all)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchFoldedState(MiningState):
    """A MiningState that folds with the torch code on every device (layers gathered into groups, as
    `update` does on every device but the CPU): on a CUDA device what `update` does anyway; on a CPU it
    makes the dry run's parity compare the torch fold with the compiled one."""

    def update(self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs=None) -> None:
        self._gather(layer, coefficients, batch, inputs)  # [batch, pos, keys] each


# -- models ---------------------------------------------------------------------------------------------
def tiny_models(folder: Path) -> dict[str, Path]:
    """A 3-layer SwiGLU Llama and a 3-layer GELU GPT-2 with 128 memories a layer, saved with a tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    configs = {
        "tiny-llama (SwiGLU)": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                bos_token_id=None,
                tie_word_embeddings=False,
                **special,
            ),
        ),
        "tiny-gpt2 (GELU)": (
            GPT2LMHeadModel,
            GPT2Config(
                vocab_size=len(tokenizer),
                n_embd=64,
                n_inner=128,
                n_layer=3,
                n_head=4,
                n_positions=128,
                bos_token_id=tokenizer.eos_token_id,
                **special,
            ),
        ),
    }
    folders = {}
    for index, (name, (architecture, config)) in enumerate(configs.items()):
        torch.manual_seed(index)
        model = architecture(config)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))  # default init hides norm/bias mistakes
        folders[name] = folder / f"tiny-{index}"
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def real_size_model(assets: Path, folder: Path) -> Path:
    """SmolLM2-135M's architecture with random weights (seed 0) and its tokenizer: the assets' config.json,
    or, where the assets are the wheelhouse's tokenizer folder (`.whl/tokenizer`), bench.shapes's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (assets / "config.json").is_file():
        from bench.shapes import write_shape

        return write_shape("smollm2-135m", folder, "float32", tokenizer=assets)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(assets)).to(torch.float32)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (assets / name).is_file():
            shutil.copy(assets / name, folder / name)
    return folder


# -- sentences and batches --------------------------------------------------------------------------------
def random_sentences(vocab: int, n: int = 200) -> tuple[list[list[int]], list[int]]:
    """`n` sentences of random token ids, 1 to 60 tokens; every 5th (of 2 tokens or more) mined from 1."""
    rng = random.Random(1)
    ids = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    first = [1 if i % 5 == 2 and len(s) > 1 else 0 for i, s in enumerate(ids)]
    return ids, first


def corpus_sentences(assets: Path, limit: int) -> list[str]:
    """The bundled corpus's sentences as ffmem reads them (read_corpus on the assets' copy of the file, or
    on the installed corpus package's where the assets hold none)."""
    path = assets / CORPUS_FILE
    if not path.is_file():
        return corpus.read_corpus("wiki-vital", limit or None).sentences
    with mock.patch.object(corpus, "package_file", lambda *_: path):
        return corpus.read_corpus("wiki-vital", limit or None).sentences


# -- parity -----------------------------------------------------------------------------------------------
def captured_difference(reference: LoadedModel, other: LoadedModel, batch: Batch) -> tuple[float, float]:
    """Max |Δ| of every layer's captured coefficients over one batch's real tokens, and that over max |m|."""
    per_model = []
    for loaded in (reference, other):
        on_device = batch.to(loaded.device)
        with torch.inference_mode(), capture(loaded.model, loaded.adapter, fields=("coefficients",)) as got:
            loaded.model.base_model(
                input_ids=on_device.input_ids, attention_mask=on_device.attention_mask, use_cache=False
            )
            per_model.append({layer: c.float().cpu() for layer, c in got.coefficients.items()})
    real = batch.attention_mask.bool()  # [batch, pos]
    difference = scale = 0.0
    for layer, want in per_model[0].items():
        got = per_model[1][layer]  # [batch, pos, keys]
        difference = max(difference, float((got - want)[real].abs().max()))
        scale = max(scale, float(want[real].abs().max()))
    return difference, difference / max(scale, 1e-30)


def compare(reference: MiningState, other: MiningState) -> dict:
    """Every layer's MinedLayer of `other` against `reference`'s: counts of what differs (of the top-T slots
    and band samples filled on either side, of the histogram counts) and the largest differences
    (coefficients compared slot by slot: a near-tie that swaps two sentences moves no value)."""
    out = dict.fromkeys(
        (
            "slots",
            "slots_differ",
            "slots_unexplained",
            "histogram",
            "histogram_differ",
            "samples",
            "samples_differ",
            "quadrant_positions",
            "quadrant_positions_differ",
            "quadrant_examples",
            "quadrant_examples_differ",
            "quadrant_examples_unexplained",
        ),
        0,
    )
    out.update(
        coefficient_max_abs=0.0, coefficient_scale=0.0, total_max_rel=0.0, sample_coefficient_max_abs=0.0
    )
    out["counts_equal"] = (reference.positions, reference.sentences) == (other.positions, other.sentences)
    for layer in range(reference.n_layers):
        want, got = reference.layer(layer), other.layer(layer)
        for sign in SIGNS:
            sentence, position = want.sentence[sign], want.position[sign]  # [keys, T] each
            differ = (got.sentence[sign] != sentence) | ((sentence >= 0) & (got.position[sign] != position))
            out["slots"] += int(((sentence >= 0) | (got.sentence[sign] >= 0)).sum())  # filled on either side
            out["slots_differ"] += int(differ.sum())
            a, b = want.coefficient[sign], got.coefficient[sign]  # [keys, T] each; ±inf where empty
            out["slots_unexplained"] += _unexplained(
                a, sentence, position, b, got.sentence[sign], got.position[sign]
            )
            both = np.isfinite(a) & np.isfinite(b)  # [keys, T]
            if both.any():
                delta = np.abs(a[both] - b[both])  # [finite]
                out["coefficient_max_abs"] = max(out["coefficient_max_abs"], float(delta.max()))
                out["coefficient_scale"] = max(out["coefficient_scale"], float(np.abs(a[both]).max()))
        out["histogram"] += int(want.histogram.sum())
        out["histogram_differ"] += int(np.abs(want.histogram - got.histogram).sum())
        scale = max(float(np.abs(want.total).max()), 1e-30)
        relative = np.abs(got.total - want.total) / np.maximum(np.abs(want.total), 1e-6 * scale)  # [keys]
        out["total_max_rel"] = max(out["total_max_rel"], float(relative.max()))
        order = want.sample_order  # [keys, bins, S]
        used = (order != EMPTY_SAMPLE) | (got.sample_order != EMPTY_SAMPLE)  # [keys, bins, S]
        same = order == got.sample_order  # [keys, bins, S]
        differ = used & (~same | (want.sample_position != got.sample_position))
        out["samples"] += int(used.sum())
        out["samples_differ"] += int(differ.sum())
        kept = used & same  # [keys, bins, S]
        if kept.any():
            delta = np.abs(want.sample_coefficient - got.sample_coefficient)[kept]  # [kept]
            out["sample_coefficient_max_abs"] = max(out["sample_coefficient_max_abs"], float(delta.max()))
        if want.gated:  # sign quadrants: positions counted, top examples (a near-tie may swap two)
            out["quadrant_positions"] += int(want.quadrant_count.sum())
            out["quadrant_positions_differ"] += int(np.abs(want.quadrant_count - got.quadrant_count).sum())
            sentence = want.quadrant_sentence  # [keys, 4, E]
            filled = (sentence >= 0) | (got.quadrant_sentence >= 0)  # [keys, 4, E]
            differ = (got.quadrant_sentence != sentence) | (got.quadrant_position != want.quadrant_position)
            out["quadrant_examples"] += int(filled.sum())
            out["quadrant_examples_differ"] += int((filled & differ).sum())
            out["quadrant_examples_unexplained"] += _unexplained(*quadrant_lists(want), *quadrant_lists(got))
    out["coefficient_rel"] = out["coefficient_max_abs"] / max(out["coefficient_scale"], 1e-30)
    return out


def quadrant_lists(layer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A gated layer's quadrant examples as _unexplained's lists, one per key and quadrant: (|m|, −inf
    where empty; sentence; position), each [keys · 4, E]. |m| ranks a quadrant's examples as s·m ranks a
    top-T list."""
    sentence = layer.quadrant_sentence.reshape(-1, layer.quadrant_sentence.shape[-1])  # [keys · 4, E]
    magnitude = np.abs(layer.quadrant_coefficient).reshape(sentence.shape)  # [keys · 4, E]
    magnitude = np.where(sentence >= 0, magnitude, -np.inf)
    return magnitude, sentence, layer.quadrant_position.reshape(sentence.shape)


def _unexplained(a, sentence, position, b, other_sentence, other_position) -> int:
    """Differing top-T slots that no tie explains: `other`'s entry (sentence, position) at a slot must be
    in the reference's list of that key with a coefficient within the tolerance, or tie (within it) with
    the reference's last entry (a tie at the cut-off). A wrong sentence index next to a right value, or a
    wrong position, counts here; two sentences of equal coefficient (identical prefixes, whose float32
    values differ in the last bits between batch shapes and devices) swapped do not. Arguments: [keys, T]."""
    tolerance = COEFFICIENT_REL * max(float(np.abs(a[np.isfinite(a)]).max(initial=0.0)), 1e-30)
    count = 0
    keys, ranks = np.nonzero((other_sentence != sentence) | (other_position != position))  # [differ] each
    for key, rank in zip(keys.tolist(), ranks.tolist(), strict=True):
        s, p, value = other_sentence[key, rank], other_position[key, rank], b[key, rank]
        if s < 0:
            count += 1  # an empty slot where the reference has an entry
            continue
        same = (sentence[key] == s) & (position[key] == p)  # [T]
        listed = same.any() and abs(float(a[key][same][0]) - float(value)) <= tolerance
        filled = a[key][sentence[key] >= 0]  # [filled]
        at_cut = len(filled) == len(sentence[key]) and abs(float(filled[-1]) - float(value)) <= tolerance
        count += not (listed or at_cut)
    return count


def verdict(name: str, figures: dict) -> bool:
    """Print the PASS or FAIL line of one model's parity; True on PASS."""
    kinds = ("slots", "samples", "histogram", "quadrant_positions", "quadrant_examples")
    share = {kind: figures[f"{kind}_differ"] / max(figures[kind], 1) for kind in kinds}
    share["slots"] = figures["slots_unexplained"] / max(figures["slots"], 1)  # ties between equal values pass
    unexplained = figures["quadrant_examples_unexplained"]  # the same for the quadrant examples
    share["quadrant_examples"] = unexplained / max(figures["quadrant_examples"], 1)
    passed = (
        figures["counts_equal"]
        and all(s <= MISMATCH_SHARE for s in share.values())
        and figures["coefficient_rel"] <= COEFFICIENT_REL
        and figures["capture_rel"] <= COEFFICIENT_REL
    )
    print(
        f"{'PASS' if passed else 'FAIL'} {name}: top-T {figures['slots_differ']}/{figures['slots']} slots "
        f"differ, {figures['slots_unexplained']} by more than a tie ({100 * share['slots']:.3f}%), "
        f"max |Δcoefficient| {figures['coefficient_max_abs']:.2e} "
        f"(rel {figures['coefficient_rel']:.1e}); histogram Σ|Δ| {figures['histogram_differ']} of "
        f"{figures['histogram']}; total max rel {figures['total_max_rel']:.1e}; band samples "
        f"{figures['samples_differ']}/{figures['samples']} differ (max |Δcoefficient| "
        f"{figures['sample_coefficient_max_abs']:.1e}); captured max |Δm| {figures['capture_max_abs']:.2e} "
        f"(rel {figures['capture_rel']:.1e}); quadrant positions {figures['quadrant_positions_differ']}/"
        f"{figures['quadrant_positions']} and examples {figures['quadrant_examples_differ']}/"
        f"{figures['quadrant_examples']} differ, {unexplained} by more than a tie "
        f"({100 * share['quadrant_examples']:.3f}%); "
        f"counts {'equal' if figures['counts_equal'] else 'DIFFER'}",
        flush=True,
    )
    figures["passed"] = passed
    return passed


def parity(
    folder: Path,
    device: torch.device,
    ids: list[list[int]],
    first: list[int],
    batch_tokens: int,
    top_k: int,
    bar_fold: bool = False,
) -> dict:
    """Mine the same batches with the model on the CPU (compiled fold) and on `device` (torch fold; its
    lists merged in the bar form where `bar_fold`)."""
    reference = load_model(str(folder), device="cpu", dtype="float32")
    other = load_model(str(folder), device=str(device), dtype="float32")  # a copy of its own on a CPU too
    pad_id, memories = reference.tokenizer.eos_token_id or 0, reference.n_layers * reference.n_keys
    batches = corpus_batches(
        ids, first, shard_sentences=0, memories=memories, batch_tokens=batch_tokens, pad_id=pad_id
    )
    states = []
    for loaded, fold in ((reference, MiningState), (other, TorchFoldedState)):
        start = time.perf_counter()
        gated = loaded.adapter.gates is not None
        state = fold(loaded.n_layers, loaded.n_keys, top_k, loaded.device, gated, bar_fold=bar_fold)
        states.append(mine_batches(loaded, batches, state))
        sync(loaded.device)
        log(
            f"  mined {len(batches)} batches on {loaded.device} ({fold.__name__}) in "
            f"{time.perf_counter() - start:.2f} s"
        )
    figures = compare(*states)
    figures["capture_max_abs"], figures["capture_rel"] = captured_difference(
        reference, other, batches[len(batches) // 2]
    )
    figures.update(batches=len(batches), sentences=len(ids), top_k=top_k)
    return figures


# -- speed ------------------------------------------------------------------------------------------------
def check_state(state: MiningState, positions: int) -> dict:
    """What a correct whole pass must give: every position counted once per key, and the top-T filled."""
    histogram_ok = bool((state.histogram.sum(dim=-1) == positions).all())  # [layers, keys] summed over bins
    _, sentence, _ = state.triggers(0, 1)  # [keys, T] each
    filled = float((sentence >= 0).float().mean())
    return {
        "positions_ok": state.positions == positions,
        "histogram_ok": histogram_ok,
        "layer0_filled": filled,
    }


def time_config(
    loaded: LoadedModel,
    batches: list[Batch],
    rounds: int,
    deadline: float,
    compiled_fold: bool = False,
    bar_fold: bool = False,
) -> dict:
    """Bare backbone forward and mining over `batches` (already on the device), interleaved; mining with the
    torch fold's passes compiled (compiled once, in the warm-up) where `compiled_fold`, its lists merged in
    the bar form where `bar_fold`."""
    device = loaded.device
    backbone = loaded.model.base_model
    tokens = sum(b.real_tokens for b in batches)
    positions = sum(int(b.mined.sum()) for b in batches)

    def bare(part: list[Batch]) -> None:
        with torch.inference_mode():
            for b in part:
                backbone(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False)

    def mining(part: list[Batch]) -> MiningState:
        gated = loaded.adapter.gates is not None  # the sign quadrants too, as `ffmem index` mines them
        folds = {"compiled_fold": compiled_fold, "bar_fold": bar_fold}
        state = MiningState(loaded.n_layers, loaded.n_keys, TOP_K, device, gated, **folds)
        return mine_batches(loaded, part, state)

    runs = {"bare": bare, "mining": mining}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    peak = dict.fromkeys(runs, 0)
    start = time.perf_counter()
    bare(batches)
    mining(batches[:WARM_BATCHES])
    sync(device)
    log(f"    warm-up {time.perf_counter() - start:.1f} s")
    checks = None
    stopped = None
    for round_ in range(rounds):
        for name in list(runs) if round_ % 2 == 0 else list(runs)[::-1]:
            expected = seconds[name][-1] if seconds[name] else 0.0
            if seconds[name] and time.monotonic() + expected > deadline:
                stopped = f"budget: round {round_} {name} not run"
                break
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            begin = time.perf_counter()
            result = runs[name](batches)
            sync(device)
            seconds[name].append(time.perf_counter() - begin)
            if device.type == "cuda":
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated(device))
            if name == "mining" and checks is None:
                checks = check_state(result, positions)
            del result
        if stopped:
            log(f"    stopped early ({stopped})")
            break
        last = {name: times[-1] for name, times in seconds.items() if times}
        log(
            f"    round {round_}: "
            + ", ".join(f"{name} {t:.2f} s ({tokens / t:,.0f} tok/s)" for name, t in last.items())
            + (f"; mining over bare {last['bare'] / last['mining']:.3f}" if len(last) == 2 else "")
        )
    best = {name: min(times) for name, times in seconds.items() if times}
    return {
        "batches": len(batches),
        "tokens": tokens,
        "computed_tokens": sum(b.computed_tokens for b in batches),
        "seconds": {name: [round(t, 3) for t in times] for name, times in seconds.items()},
        "bare_tokens_per_s": tokens / best["bare"] if "bare" in best else None,
        "mining_tokens_per_s": tokens / best["mining"] if "mining" in best else None,
        "mining_over_bare": best["bare"] / best["mining"] if len(best) == 2 else None,
        "median_mining_over_bare": (
            statistics.median(seconds["bare"]) / statistics.median(seconds["mining"])
            if len(best) == 2
            else None
        ),
        "peak_gib": {name: round(bytes_ / 2**30, 3) for name, bytes_ in peak.items()}
        if device.type == "cuda"
        else None,
        "checks": checks,
        "stopped": stopped,
    }


# -- main -------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--assets", type=Path, default=ASSETS, help="config, tokenizer, corpus")
    parser.add_argument("--sentences", type=int, default=0, help="corpus sentences timed; 0: all")
    parser.add_argument(
        "--parity-sentences", type=int, help="of the real-size parity (default 256 on a GPU, 16 on a CPU)"
    )
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, help="timed with it and 4× it")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="of the speed part, in this order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--compiled-fold", action="store_true", help="the torch fold's passes compiled (needs triton)"
    )
    parser.add_argument(
        "--fold", choices=("merge", "bar"), default="merge", help="the torch fold's lists: merge or bar form"
    )
    parser.add_argument(
        "--budget-s", type=float, help="no timed pass starts after it (default 360 on a GPU, none on a CPU)"
    )
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's kill still removes the temp folder
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if args.parity_sentences is None:
        args.parity_sentences = 256 if on_gpu else 16
    if args.budget_s is None:
        args.budget_s = 360.0 if on_gpu else float("inf")
    torch.backends.cuda.matmul.allow_tf32 = False  # parity needs float32 matmuls; speed: float32 as on a CPU
    import numba
    import transformers

    bar = args.fold == "bar"  # the torch fold's lists merged in the bar form
    results: dict = {
        "device": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numba": numba.__version__,
        "args": {key: str(value) for key, value in vars(args).items()},
        "parity": {},
        "speed": [],
    }

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")

    log(
        f"{results['device']}: python {results['python']}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, numba {numba.__version__}, TF32 matmul "
        f"{torch.backends.cuda.matmul.allow_tf32}, {torch.get_num_threads()} CPU threads"
    )

    def checked(name: str, run) -> None:
        """Run one model's parity, print its verdict and keep its figures (or its traceback)."""
        results["parity"][name] = figures = {}
        try:
            figures.update(run())
            verdict(name, figures)
        except Exception:
            traceback.print_exc()
            figures.update(error=traceback.format_exc(), passed=False)
            print(f"FAIL {name}: raised (traceback above)", flush=True)
        save()

    with tempfile.TemporaryDirectory(prefix="ffmem-gpu-") as scratch:
        scratch = Path(scratch)
        log("1. parity, float32: tiny random models")
        for name, folder in tiny_models(scratch).items():
            ids, first = random_sentences(vocab_size(folder))
            checked(name, lambda f=folder, i=ids, p=first: parity(f, device, i, p, 256, 8, bar_fold=bar))
        if args.parity_sentences or args.dtypes:  # else the tiny models' parity alone (a dry run)
            try:
                corpus_file = args.assets / CORPUS_FILE
                log(f"random SmolLM2-135M from {args.assets / 'config.json'}, corpus {corpus_file}")
                folder = real_size_model(args.assets, scratch / "smollm2-random")
                ids, first, pad_id = corpus_ids(args.assets, folder, args.sentences)
                if args.parity_sentences:
                    n = min(args.parity_sentences, len(ids))
                    name = f"random SmolLM2-135M, {n} corpus sentences"
                    log(f"1b. parity, float32: {name}")
                    tokens = args.batch_tokens
                    checked(name, lambda: parity(folder, device, ids[:n], first[:n], tokens, TOP_K, bar))
                log("2. speed: bare backbone forward vs mining")
                speed(results, folder, device, ids, first, pad_id, args, save)
            except Exception:
                traceback.print_exc()
                results["error"] = traceback.format_exc()

    imported = [name for name in FORBIDDEN if name in sys.modules]
    results["forbidden_imports"] = imported
    passed = [figures.get("passed", False) for figures in results["parity"].values()]
    results["parity_passed"] = all(passed)
    save()
    print_table(results)
    if imported:
        print(f"WARNING: imported {', '.join(imported)}: the device machine does not have them", flush=True)
    if "error" in results:
        print("ERROR: the real-size part raised (traceback above)", flush=True)
    print(f"parity: {'PASS' if all(passed) else 'FAIL'} ({sum(passed)}/{len(passed)} models)", flush=True)
    if args.out:
        print(f"wrote {args.out}", flush=True)


def corpus_ids(assets: Path, folder: Path, limit: int) -> tuple[list[list[int]], list[int], int]:
    """The corpus's token ids and first positions under the model's tokenizer, and its padding id."""
    from transformers import AutoTokenizer

    sentences = corpus_sentences(assets, max(limit, 0))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenized = tokenize(sentences, tokenizer, MAX_SENTENCE_TOKENS)
    ids, first = [s.token_ids for s in tokenized], [s.first_position for s in tokenized]
    log(f"corpus: {len(sentences)} sentences, {len(ids)} tokenized, {sum(map(len, ids)):,} tokens")
    return ids, first, tokenizer.eos_token_id or 0


def speed(results: dict, folder: Path, device: torch.device, ids, first, pad_id: int, args, save) -> None:
    """Part 2: each dtype, then each batch size, timed by time_config into results["speed"]."""
    deadline = START + args.budget_s
    sizes = (args.batch_tokens, 4 * args.batch_tokens)
    config = json.loads((folder / "config.json").read_text())
    memories = config["num_hidden_layers"] * config["intermediate_size"]
    batches = {
        size: corpus_batches(
            ids, first, shard_sentences=0, memories=memories, batch_tokens=size, pad_id=pad_id
        )
        for size in sizes
    }
    for dtype in filter(None, args.dtypes.split(",")):  # "": parity only
        loaded = None
        for size in sizes:
            row = {"dtype": dtype, "batch_tokens": size}
            results["speed"].append(row)
            if time.monotonic() > deadline:
                row["stopped"] = f"budget of {args.budget_s:.0f} s spent: not run"
                log(f"  {dtype}, batch_tokens {size}: skipped ({row['stopped']})")
                continue
            part = batches[size]
            computed = sum(b.computed_tokens for b in part)
            log(f"  {dtype}, batch_tokens {size}: {len(part)} batches, {computed:,} tokens computed")
            try:
                loaded = loaded or load_model(str(folder), device=str(device), dtype=dtype)
                on_device = [b.to(device) for b in part]
                bar = args.fold == "bar"
                row.update(time_config(loaded, on_device, args.rounds, deadline, args.compiled_fold, bar))
                del on_device
            except Exception:
                traceback.print_exc()
                row["error"] = traceback.format_exc()
            save()
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()


def vocab_size(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def print_table(results: dict) -> None:
    """The parity verdicts and the speed figures, one line each."""
    print(f"\nparity on {results['device']} against the CPU (float32):", flush=True)
    for name, figures in results["parity"].items():
        if "error" in figures:
            print(f"  {name:<44} FAIL  raised {figures['error'].strip().splitlines()[-1]}", flush=True)
            continue
        print(
            f"  {name:<44} {'PASS' if figures['passed'] else 'FAIL'}  top-T slots differ "
            f"{figures['slots_differ']}/{figures['slots']} ({figures['slots_unexplained']} beyond ties), "
            f"coefficients rel "
            f"{figures['coefficient_rel']:.1e}, "
            f"histogram Σ|Δ| {figures['histogram_differ']}, band samples differ {figures['samples_differ']}",
            flush=True,
        )
    print(f"\nspeed on {results['device']} (mining/bare: bare seconds over mining seconds, best round):")
    print(
        f"  {'dtype':<9} {'batch':>6} {'batches':>7} {'tokens':>10} {'bare tok/s':>11} {'mining tok/s':>12} "
        f"{'mining/bare':>11} {'peak bare':>9} {'peak mining':>11}  checks",
        flush=True,
    )

    def number(value, spec: str, unit: str = "") -> str:
        return format(value, spec) + unit if value is not None else "-"

    for row in results["speed"]:
        head = f"  {row['dtype']:<9} {row['batch_tokens']:>6}"
        if "error" in row:
            print(f"{head}  ERROR {row['error'].strip().splitlines()[-1]}", flush=True)
            continue
        if "batches" not in row:
            print(f"{head}  {row.get('stopped', '')}", flush=True)
            continue
        peak, checks = row["peak_gib"] or {}, row["checks"]
        ok = checks is None or all(value for key, value in checks.items() if key.endswith("_ok"))
        print(
            f"{head} {row['batches']:>7} {row['tokens']:>10,} {number(row['bare_tokens_per_s'], ',.0f'):>11} "
            f"{number(row['mining_tokens_per_s'], ',.0f'):>12} {number(row['mining_over_bare'], '.3f'):>11} "
            f"{number(peak.get('bare'), '.2f', ' GiB'):>9} {number(peak.get('mining'), '.2f', ' GiB'):>11}  "
            + ("-" if checks is None else "ok" if ok else f"FAILED {checks}")
            + (f" ({row['stopped']})" if row["stopped"] else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
