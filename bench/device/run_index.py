"""`ffmem index` on random-weight models of real shapes, stage by stage: the GPU machine's check.

    bash bench/device/index.sh --out $OUT/index.json                      # on the GPU machine
    bash bench/device/index.sh --shapes llama-3.1-8b:300000               # one shape, 300K corpus tokens
    PYTHON=.venv/bin/python bash bench/device/index.sh --device cpu --shapes tiny:2000   # a dry run on a CPU

For each shape (`--shapes name[:tokens],…`, smallest first, default DEFAULT_SHAPES): bench.shapes
writes its random-weight model (bf16 by default; the random numbers drawn on the GPU), loads it as the
worker does, then builds the index `ffmem index` builds (ffmem.worker.loop.build_index, in this process,
with the options that command gives for the model folder, `--sentences`, `--device`, `--dtype` and
`--db sqlite:///…`, default settings otherwise) over the first sentences of the bundled corpus, as many
as hold about `tokens` tokens (TOKENS_PER_SENTENCE). Then the stored run is checked (finished, every
layer's keys stored, the vocabulary as large as the model's unembedding, the ids past the tokenizer's
stored as `⟨unused N⟩`: a shape larger than SmolLM2's 49,152 tokens has a padded vocabulary) and a table
printed: each stage's seconds, its peak GPU memory, the host's resident set when it began and its peak
host memory.

The stages are the loading, measured here, and the worker's own timed steps (projection, which fills the
token → memories table too, storing, mining, shading, layers, composition, neighbours, closing), whose
start, end and seconds the pipeline tells its observer (`IndexOptions.observer`); the rest of preparing a
run (reading and tokenizing the corpus, storing the vocabulary) is "other". The worker records no memory
at all: the peaks are read here, at each stage's start and end (torch.cuda.max_memory_allocated, reset
then; the host's peak resident set from /proc/self/status VmHWM, reset through /proc/self/clear_refs).
Projection and storing run both in preparing and inside the "layers" step, so the "layers" row includes
its share of them; shares are of the whole build.

`--out` writes every figure as JSON after each shape, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TQDM_MININTERVAL", "30")  # the worker's progress bars: a line every 30 s, not 10 a s

import torch  # noqa: E402

from bench.harness import ROOT, log  # noqa: E402
from bench.shapes import SHAPES, random_model, write_shape  # noqa: E402

DEFAULT_SHAPES = "smollm2-135m:100000,llama-3.2-1b:100000,llama-3.1-8b:1000000"
# The bundled corpus (wiki-vital) under the default model's tokenizer, which every shape shares: 1,050,056
# tokens in 36,518 sentences (read_corpus + tokenize, max 128 tokens a sentence; bench.gpu agrees).
CORPUS_SENTENCES = 36_518
TRACE_TOKENS = 32  # the live trace's prompt (issue 44: ≤ 100 ms p50 at the 8B shape)
TOKENS_PER_SENTENCE = 1_050_056 / CORPUS_SENTENCES


def host_memory(field: str = "VmHWM") -> int | None:
    """The process's peak resident set since the last reset (VmHWM), or its resident set now (VmRSS), in
    bytes; None where unknown."""
    try:
        with open("/proc/self/status") as status:
            return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def reset_host_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current resident set
    except OSError:
        pass


@dataclass
class Stage:
    by: str  # "worker": its own timed step (seen through its observer); "bench": measured here
    seconds: float = 0.0
    top_seconds: float = 0.0  # entered outside every other stage (what "other" is the rest of)
    peak_gpu: int = 0
    peak_host: int | None = None
    start_host: int | None = None  # the resident set when the stage was first entered


@dataclass
class Stages:
    """Each stage's seconds and peaks. Peaks are read at every stage's start and end and folded into
    every stage open at that moment, then reset: a nested stage's peak never hides its outer one's."""

    device: torch.device
    stages: dict[str, Stage] = field(default_factory=dict)
    open: list[tuple[str, float]] = field(default_factory=list)

    def _fold(self) -> None:
        gpu = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        host = host_memory()
        for name, _ in self.open:
            stage = self.stages[name]
            stage.peak_gpu = max(stage.peak_gpu, gpu)
            if host is not None:
                stage.peak_host = max(stage.peak_host or 0, host)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        reset_host_peak()

    def begin(self, name: str, by: str) -> None:
        if name not in self.stages:
            self.stages[name] = Stage(by, start_host=host_memory("VmRSS"))
        self._fold()
        self.open.append((name, time.perf_counter()))

    def end(self, seconds: float | None = None) -> None:
        """Close the innermost stage: `seconds` where its timer says (the worker's), else measured here."""
        self._fold()
        name, start = self.open.pop()
        seconds = time.perf_counter() - start if seconds is None else seconds
        self.stages[name].seconds += seconds
        if not self.open:
            self.stages[name].top_seconds += seconds

    def observe(self, name: str, seconds: float | None) -> None:
        """The index pipeline's observer: a timed step starts (`seconds` None) or ends."""
        if seconds is None:
            self.begin(name, "worker")
        else:
            self.end(seconds)

    @contextmanager
    def stage(self, name: str, by: str = "bench"):
        self.begin(name, by)
        try:
            yield
        finally:
            self.end()


def parse_shapes(text: str) -> list[tuple[str, int]]:
    """`name[:tokens],…` → [(name, tokens)]; a shape without tokens gets the default's or 100,000."""
    defaults = dict(item.split(":") for item in DEFAULT_SHAPES.split(","))
    out = []
    for item in text.split(","):
        name, _, tokens = item.strip().partition(":")
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; shapes: {', '.join(SHAPES)}")
        out.append((name, int(tokens or defaults.get(name, 100_000))))
    return out


def stored(url: str, tokenizer_ids: int) -> dict:
    """What the run in the database at `url` holds: its state, and the model's layers and vocabulary
    (`padding_rows`: the rows past the tokenizer's `tokenizer_ids` ids stored as `⟨unused N⟩`)."""
    from sqlalchemy import func, select

    from ffmem.store.db import make_engine, make_sessionmaker
    from ffmem.store.models import KeyStats, LanguageModel, Run, Token

    with make_sessionmaker(make_engine(url))() as session:
        run = session.scalars(select(Run).order_by(Run.id.desc())).first()
        model = session.get(LanguageModel, run.model_id)
        past = session.execute(
            select(Token.token_id, Token.text).where(
                Token.model_id == model.id, Token.token_id >= tokenizer_ids
            )
        ).all()
        per_layer = session.execute(
            select(KeyStats.layer, func.count()).where(KeyStats.run_id == run.id).group_by(KeyStats.layer)
        ).all()
        return {
            "run_id": run.id,
            "status": str(run.status),
            "tokens_mined": run.n_tokens,
            "sentences_mined": run.n_sentences,
            "model_layers": model.n_layers,
            "model_keys": model.n_keys,
            "vocab_size": model.vocab_size,
            "vocabulary_rows": session.scalar(select(func.count()).where(Token.model_id == model.id)),
            "tokenizer_ids": tokenizer_ids,
            "padding_rows": sum(1 for token_id, text in past if text == f"⟨unused {token_id}⟩"),
            "layers_stored": sum(1 for _, keys in per_layer if keys == model.n_keys),
            "dtype": run.dtype,
            "device": run.device,
        }


def index_shape(name: str, tokens: int, args, work: Path) -> dict:
    """Write the shape, index it with `ffmem index`, check and measure it."""
    from transformers import AutoTokenizer

    shape = SHAPES[name]
    device = torch.device(args.device)
    folder, database = work / name, work / f"{name}.db"
    shutil.rmtree(folder, ignore_errors=True)
    database.unlink(missing_ok=True)
    result: dict = {"shape": name, "memories": shape.memories, "vocab": shape.vocab}
    tokenizer = args.tokenizer if args.tokenizer and args.tokenizer.is_dir() else None
    what = f"{shape.parameters():,} random {args.dtype} weights"
    if args.ratio_only and args.in_memory:  # built on the device, never written: mining alone
        log(f"{name}: building {what} on {args.device}")
        start = time.perf_counter()
        loaded = random_model(name, args.dtype, tokenizer=tokenizer, device=args.device)
        result["build_seconds"] = time.perf_counter() - start
        measure_mining(loaded, name, args, result)
        measure_trace(loaded, args, result)
        return result
    log(f"{name}: writing {what} (tokenizer {tokenizer or 'the GGUF file'})")
    start = time.perf_counter()
    write_shape(name, folder, args.dtype, tokenizer=tokenizer, device=args.device)
    result["write_seconds"] = time.perf_counter() - start
    result["folder_bytes"] = sum(f.stat().st_size for f in folder.iterdir())
    if args.ratio_only:  # no index: load the model as the worker does, then measure mining alone
        from ffmem.engine.model.loading import load_model

        start = time.perf_counter()
        loaded = load_model(str(folder), device=args.device, dtype=args.dtype)
        result["load_seconds"] = time.perf_counter() - start
        log(f"{name}: loaded in {result['load_seconds']:.1f} s")
        measure_mining(loaded, name, args, result)
        measure_trace(loaded, args, result)
        del loaded
        shutil.rmtree(folder, ignore_errors=True)
        return result
    tokenizer_ids = len(AutoTokenizer.from_pretrained(folder))  # the ids past it are padding
    sentences = min(CORPUS_SENTENCES, max(1, math.ceil(tokens / TOKENS_PER_SENTENCE)))
    url = f"sqlite:///{database}"
    arguments = ["index", "--model", str(folder), "--sentences", str(sentences), "--db", url]
    arguments += ["--device", args.device, "--dtype", args.dtype]
    log(f"{name}: wrote {result['folder_bytes'] / 1e9:.2f} GB in {result['write_seconds']:.1f} s")
    log(f"{name}: ffmem {' '.join(arguments)}")
    result.update(sentences=sentences, command="ffmem " + " ".join(arguments))
    stages = Stages(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loaded = build(folder, sentences, url, args, stages, result)
    result["index_seconds"] = time.perf_counter() - start
    result["stages"] = {
        stage_name: {
            "by": stage.by,
            "seconds": stage.seconds,
            "top_seconds": stage.top_seconds,
            "peak_gpu_bytes": stage.peak_gpu if device.type == "cuda" else None,
            "peak_host_bytes": stage.peak_host,
            "start_host_bytes": stage.start_host,
        }
        for stage_name, stage in stages.stages.items()
    }
    result["other_seconds"] = result["index_seconds"] - sum(s.top_seconds for s in stages.stages.values())
    result["database_bytes"] = database.stat().st_size if database.exists() else 0
    if result["exit_code"] == 0:
        result["stored"] = stored(url, tokenizer_ids)
    if args.ratio_sentences and loaded is not None:
        measure_mining(loaded, name, args, result)
    if loaded is not None:
        measure_trace(loaded, args, result)
    del loaded
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def build(folder: Path, sentences: int, url: str, args, stages: Stages, result: dict):
    """Load the model and build its index as `ffmem index` does, each stage measured into `stages`; the
    loaded model (None where loading failed). `result["exit_code"]`: 0, or 1 where it raised."""
    from ffmem.config import get_settings
    from ffmem.engine.model.loading import shared_model
    from ffmem.store.db import make_engine, make_sessionmaker, upgrade
    from ffmem.worker.index import IndexOptions
    from ffmem.worker.loop import build_index

    settings = get_settings()
    options = IndexOptions.from_settings(
        settings, device=args.device, model=str(folder), sentences=sentences, dtype=args.dtype
    )
    options = dataclasses.replace(options, observer=stages.observe, compiled_fold=args.compiled_fold)
    loaded = None
    try:
        with stages.stage("loading"):
            loaded = shared_model(
                str(folder), device=args.device, dtype=args.dtype, cache_dir=options.cache_dir
            )
        upgrade(url)
        engine = make_engine(url)
        build_index(options, make_sessionmaker(engine), loaded=loaded)
        engine.dispose()
        result["exit_code"] = 0
    except Exception:
        traceback.print_exc()
        result["exit_code"] = 1
        while stages.open:  # a step that raised: its end comes from its timer, which told nobody
            stages.end()
    return loaded


def measure_mining(loaded, name: str, args, result: dict) -> None:
    """Mining over the bare forward, then (`--profile`) a profile of mining, into `result`."""
    try:
        batches = ratio_batches(loaded, args.ratio_sentences)
        fold = {"compiled_fold": args.compiled_fold, "bar_fold": args.fold == "bar"}  # the torch fold's form
        result["mining_ratio"] = mining_ratio(loaded, batches, args.ratio_rounds, args.ratio_budget_s, **fold)
        result["mining_ratio"]["fold"] = args.fold
        if args.profile:
            path = (args.out.parent if args.out else args.work) / f"profile-{name}.txt"
            result["profile"] = profile_mining(loaded, batches, path, **fold)
    except Exception:
        traceback.print_exc()
        result.setdefault("mining_ratio", {})["error"] = traceback.format_exc().strip().splitlines()[-1]


def measure_trace(loaded, args, result: dict) -> None:
    """`--trace-repeats` live traces of a TRACE_TOKENS-token prompt (ffmem.engine.live.trace.trace, what the
    live view runs) interleaved with bare forwards of it (`model(ids)`), after two of each: p50 and p95
    milliseconds of each, into `result["trace"]`."""
    if not args.trace_repeats:
        return
    from bench.gpu import sync
    from ffmem.engine.live.trace import trace

    try:
        ids = torch.randint(
            0, len(loaded.tokenizer), (TRACE_TOKENS,), generator=torch.Generator().manual_seed(0)
        )
        token_ids = ids.tolist()
        on_device = ids[None].to(loaded.device)  # [1, tokens]

        def bare() -> None:
            with torch.inference_mode():
                loaded.model(on_device)

        runs = {"bare": bare, "trace": lambda: trace(loaded, token_ids)}
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.trace_repeats + 2):
            for name, run in runs.items():
                sync(loaded.device)
                start = time.perf_counter()
                run()
                sync(loaded.device)
                if round_ >= 2:  # two warm-up rounds
                    seconds[name].append(time.perf_counter() - start)
        found = {"tokens": TRACE_TOKENS, "repeats": args.trace_repeats}
        for name, times in seconds.items():
            times.sort()
            found[f"{name}_p50_ms"] = 1000 * times[len(times) // 2]
            found[f"{name}_p95_ms"] = 1000 * times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
        result["trace"] = found
        log(
            f"  live trace of {TRACE_TOKENS} tokens: p50 {found['trace_p50_ms']:.1f} ms, p95 "
            f"{found['trace_p95_ms']:.1f} ms (bare forward p50 {found['bare_p50_ms']:.1f} ms)"
        )
    except Exception:
        traceback.print_exc()
        result["trace"] = {"error": traceback.format_exc().strip().splitlines()[-1]}


def ratio_batches(loaded, sentences: int) -> list:
    """The index's own batches (default settings) of the corpus's first `sentences` sentences, on the
    model's device."""
    from bench.bench import batches_of
    from ffmem.config import get_settings
    from ffmem.engine.mining.corpus import read_corpus

    batches = batches_of(loaded, read_corpus("wiki-vital", sentences).sentences, get_settings())
    return [b.to(loaded.device) for b in batches]


def mining_ratio(
    loaded, batches: list, rounds: int, budget_s: float, compiled_fold: bool = False, bar_fold: bool = False
) -> dict:
    """Mining over the bare backbone forward on the model the index loaded (bench.gpu's `time_config`:
    interleaved, after a warm-up), over the index's own batches: issue 28's figure, on the same card as
    the index's stage times."""
    from bench.gpu import time_config

    tokens = sum(b.real_tokens for b in batches)
    log(f"  mining ratio: {len(batches)} batches, {tokens:,} tokens, {rounds} rounds")
    return time_config(loaded, batches, rounds, time.monotonic() + budget_s, compiled_fold, bar_fold)


def profile_mining(loaded, batches: list, path: Path, n: int = 8, **fold: bool) -> dict:
    """torch.profiler over mining `n` batches after two: the kernels by device time and by host time, and
    the host's waits on the device (what keeps mining from the forward pass's speed), into `path`."""
    from torch.profiler import ProfilerActivity, profile

    from ffmem.engine.mining.batches import mine_batches
    from ffmem.engine.mining.state import MiningState

    gated = loaded.adapter.gates is not None  # with the sign quadrants, as `ffmem index` mines
    state = MiningState(loaded.n_layers, loaded.n_keys, 50, loaded.device, gated, **fold)
    mine_batches(loaded, batches[:2], state)
    part = batches[2 : 2 + n]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if loaded.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        mine_batches(loaded, part, state)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize(loaded.device)
    averages = prof.key_averages()
    tables = []
    for key in ("device_time_total", "cpu_time_total"):
        try:
            tables.append(f"-- by {key}\n" + averages.table(sort_by=key, row_limit=30))
        except Exception as error:  # an older torch names it cuda_time_total
            tables.append(f"-- by {key}: {error}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{len(part)} batches, {sum(b.real_tokens for b in part):,} tokens\n" + "\n".join(tables))
    waits = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item", "aten::nonzero",
             "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaLaunchKernel")  # fmt: skip
    counts = {e.key: e.count for e in averages if e.key in waits}
    log(f"  profile of {len(part)} batches: {counts} (tables in {path})")
    return {"batches": len(part), "calls": counts}


def verdict(result: dict) -> str:
    """OK when the run finished with every layer stored and the model's whole vocabulary, its padding
    past the tokenizer named `⟨unused N⟩`."""
    found = result.get("stored")
    if not found:
        return f"FAILED (exit code {result.get('exit_code')})"
    shape = SHAPES[result["shape"]]
    problems = []
    if found["status"] != "done":
        problems.append(f"run {found['status']}")
    if found["layers_stored"] != shape.layers:
        problems.append(f"{found['layers_stored']} of {shape.layers} layers stored")
    if found["vocab_size"] != shape.vocab or found["vocabulary_rows"] != shape.vocab:
        problems.append(
            f"vocabulary {found['vocab_size']:,} ({found['vocabulary_rows']:,} rows) of {shape.vocab:,}"
        )
    padding = shape.vocab - found["tokenizer_ids"]
    if found["padding_rows"] != padding:
        problems.append(
            f"{found['padding_rows']:,} of {padding:,} ids past the tokenizer stored as ⟨unused N⟩"
        )
    return "OK" if not problems else "WRONG: " + "; ".join(problems)


def print_table(result: dict) -> None:
    def size(value) -> str:
        return "-" if value is None else f"{value / 2**30:.2f} GiB"

    found = result.get("stored") or {}
    print(
        f"\n{result['shape']}: {result['memories']:,} memories, vocabulary {result['vocab']:,} "
        f"({found.get('padding_rows', 0):,} padding): "
        f"{verdict(result)}\n"
        f"  run {found.get('run_id', '-')}: {found.get('tokens_mined', 0):,} tokens mined of "
        f"{found.get('sentences_mined', 0):,} sentences ({result['sentences']:,} read), "
        f"{found.get('dtype', '-')} on {found.get('device', '-')}; weights written in "
        f"{result['write_seconds']:.1f} s ({result['folder_bytes'] / 1e9:.2f} GB); database "
        f"{result['database_bytes'] / 1e6:,.1f} MB "
        f"({result['database_bytes'] / result['memories']:,.0f} B a memory)",
        flush=True,
    )
    total = result["index_seconds"]
    print(
        f"  {'stage':<20} {'timed by':<8} {'seconds':>9} {'share':>6} {'peak GPU':>10} {'host before':>11} "
        f"{'peak host':>10}"
    )
    rows = [
        (name, s["by"], s["seconds"], s["peak_gpu_bytes"], s.get("start_host_bytes"), s["peak_host_bytes"])
        for name, s in result["stages"].items()
    ]
    rows.append(("other", "", result["other_seconds"], None, None, None))
    for name, by, seconds, gpu, before, host in rows:
        print(
            f"  {name:<20} {by:<8} {seconds:>9.1f} {seconds / total:>6.1%} {size(gpu):>10} "
            f"{size(before):>11} {size(host):>10}"
        )
    print(f"  {'ffmem index':<20} {'':<8} {total:>9.1f} {1:>6.1%}", flush=True)
    print_ratio(result)


def print_ratio(result: dict) -> None:
    """The mining ratio's line (or why there is none)."""
    ratio = result.get("mining_ratio") or {}
    if ratio.get("mining_over_bare"):
        print(
            f"  mining over the bare forward: {ratio['mining_over_bare']:.3f} (median "
            f"{ratio['median_mining_over_bare']:.3f}); bare {ratio['bare_tokens_per_s']:,.0f} tok/s, mining "
            f"{ratio['mining_tokens_per_s']:,.0f} tok/s over {ratio['tokens']:,} tokens; checks "
            f"{ratio['checks']}",
            flush=True,
        )
    elif ratio:
        print(f"  mining ratio: {ratio.get('error') or ratio.get('stopped')}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="name[:corpus tokens],… (bench.shapes)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".whl" / "tokenizer", help="saved tokenizer")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ffmem-device"), help="models and databases")
    parser.add_argument("--keep", action="store_true", help="keep each model folder after its run")
    parser.add_argument("--out", type=Path, help="write every figure here as JSON")
    parser.add_argument("--ratio-sentences", type=int, default=4000, help="mining ratio's sentences; 0: none")
    parser.add_argument("--ratio-rounds", type=int, default=3, help="interleaved rounds of the ratio")
    parser.add_argument("--ratio-budget-s", type=float, default=60.0, help="no ratio pass starts after it")
    parser.add_argument("--ratio-only", action="store_true", help="no index: the mining ratio alone")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of mining, after the ratio")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="with --ratio-only: each model built on the device",
    )
    parser.add_argument("--trace-repeats", type=int, default=0, help="live traces timed per shape; 0: none")
    parser.add_argument(
        "--compiled-fold", action="store_true", help="the torch fold's passes compiled (needs triton)"
    )
    parser.add_argument(
        "--fold", choices=("merge", "bar"), default="merge", help="the torch fold's lists (the ratio's)"
    )
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    shapes = parse_shapes(args.shapes)
    args.work.mkdir(parents=True, exist_ok=True)
    import transformers

    import ffmem

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results = {"device": device_name, "torch": torch.__version__, "transformers": transformers.__version__,
               "ffmem": str(Path(ffmem.__file__).parent), "shapes": []}  # fmt: skip
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    log(f"{device_name}: {versions}, ffmem from {results['ffmem']}")
    for name, tokens in shapes:
        try:
            result = index_shape(name, tokens, args, args.work)
        except Exception:
            traceback.print_exc()
            result = {"shape": name, "error": traceback.format_exc().strip().splitlines()[-1]}
        results["shapes"].append(result)
        if "stages" in result:
            print_table(result)
        elif args.ratio_only and "error" not in result:
            print_ratio(result)
        else:
            print(f"\n{name}: FAILED ({result['error']})", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    passed = [r for r in results["shapes"] if ("stages" in r and verdict(r) == "OK") or
              (args.ratio_only and (r.get("mining_ratio") or {}).get("mining_over_bare"))]  # fmt: skip
    log(f"{len(passed)}/{len(shapes)} shapes indexed and checked")
    sys.exit(0 if len(passed) == len(shapes) else 1)


if __name__ == "__main__":
    main()
