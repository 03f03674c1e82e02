"""Live view speed (a benchmark, not a test): `make bench` runs it after bench.web.

1. Engine, in one process, interleaved: a trace of a 32-token prompt (`ffmem.engine.live.trace.trace`: the
   forward pass with every layer captured, the readouts of r, y and o at the position, memories,
   heatmaps) over a bare forward pass of the same prompt (`model(ids)`); p50 and p95 of each and
   the ratio of the p50s (target ≤ 1.3). The process keeps freed memory as `ffmem worker` does
   (ffmem/engine/allocator.py); without it each trace pays ~11K page faults for its logits.
2. Through the app: `ffmem serve` (which starts the live worker) on the default index;
   /m/{model}/trace.json for the same prompt, one at a time: wall and server time p50 / p95.
3. A burst of 20 concurrent traces, and an overload of 64: how many were answered (200), how many
   refused with the documented 503 + Retry-After, and any other 5xx (errors; target 0).
Figures go into bench-results.json under "trace".
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

import httpx
import torch

from bench import harness
from ffmem.config import get_settings
from ffmem.engine.allocator import keep_freed_memory
from ffmem.engine.live.trace import trace
from ffmem.engine.mining.corpus import read_corpus
from ffmem.engine.model.loading import load_model

PROMPT_TOKENS, ROUNDS, BURST, OVERLOAD = 32, 60, 20, 64


def prompt(loaded) -> tuple[str, list[int]]:
    """The first Wikipedia sentence of at least 32 tokens, cut to 32 tokens (text and ids agree)."""
    for sentence in read_corpus("wiki-vital", 500).sentences:
        ids = loaded.tokenizer(sentence).input_ids
        if len(ids) >= PROMPT_TOKENS + 4:
            text = loaded.tokenizer.decode(ids[:PROMPT_TOKENS], skip_special_tokens=True)
            ids = loaded.tokenizer(text).input_ids
            if len(ids) == PROMPT_TOKENS:
                return text, ids
    raise SystemExit("no sentence of 32 tokens in the corpus")


def engine_ratio(loaded, ids: list[int]) -> dict:
    tensor = torch.tensor([ids])

    def bare():
        with torch.inference_mode():
            loaded.model(tensor)

    times = harness.interleaved({"bare": bare, "trace": lambda: trace(loaded, ids)}, ROUNDS)
    bare_p, trace_p = harness.percentiles(times["bare"]), harness.percentiles(times["trace"])
    return {
        "prompt_tokens": len(ids),
        "bare_forward": bare_p,
        "trace": trace_p,
        "ratio_p50": round(trace_p["p50_ms"] / bare_p["p50_ms"], 3),
        "ratio_p95": round(trace_p["p95_ms"] / bare_p["p95_ms"], 3),
        "threads": torch.get_num_threads(),
    }


def sequential(base: str, slug: str, text: str) -> dict:
    with httpx.Client(base_url=base, timeout=60) as client:
        return harness.sequential(client, [f"/m/{slug}/trace.json?text={quote(text)}"] * 30)


async def burst(base: str, slug: str, text: str, concurrent: int) -> dict:
    limits = httpx.Limits(max_connections=concurrent)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(
            *(client.get(f"/m/{slug}/trace.json", params={"text": text}) for _ in range(concurrent)),
            return_exceptions=True,
        )
        seconds = time.perf_counter() - start
    statuses = [str(r.status_code) if isinstance(r, httpx.Response) else "failed" for r in responses]
    refused = [r for r in responses if isinstance(r, httpx.Response) and r.status_code == 503]
    return {
        "concurrent": concurrent,
        "seconds": round(seconds, 2),
        "answered_200": statuses.count("200"),
        "refused_503": len(refused),
        "refused_with_retry_after": sum("retry-after" in r.headers for r in refused),
        "other_errors": sum(1 for s in statuses if s not in ("200", "503")),
        "statuses": {s: statuses.count(s) for s in sorted(set(statuses))},
    }


def main() -> None:
    args = harness.parser(__doc__, db=True).parse_args()
    kept = keep_freed_memory()  # as `ffmem worker` does: both sides of the ratio run under it
    settings = get_settings()
    loaded = load_model(settings.model, device="cpu", cache_dir=settings.cache_dir)
    text, ids = prompt(loaded)
    print(f"prompt ({len(ids)} tokens): {text!r}", flush=True)
    results = {"engine": engine_ratio(loaded, ids) | {"freed_memory_kept": kept}}
    print(results["engine"], flush=True)
    del loaded  # the worker process holds its own copy

    url = harness.database_url(args)
    slug = harness.default_run(url).slug
    with harness.served(url, worker=True) as explorer:
        base = explorer.base
        harness.wait_for_trace(base, slug, text, seconds=180)
        results["app_sequential"] = sequential(base, slug, text)
        print(results["app_sequential"], flush=True)
        results["burst"] = asyncio.run(burst(base, slug, text, BURST))
        print(results["burst"], flush=True)
        results["overload"] = asyncio.run(burst(base, slug, text, OVERLOAD))  # past the worker's queue
        print(results["overload"], flush=True)
    results["device"] = "cpu"
    harness.record(args, "trace", results)


if __name__ == "__main__":
    main()
