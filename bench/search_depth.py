"""Token search past the stored depth (a benchmark, not a test): the live worker's POST /token-memories.

On the default model (SmolLM2-135M unless FFMEM_MODEL names another), its HTTP app in this process as
`ffmem worker` serves it (ffmem/worker/live_app.py, the executor's one thread):

- the first search by probability of each readout, which computes every value's log Z (the projection's
  pass over the whole vocabulary) and keeps it;
- then searches for 200 memories each way over random ' word' vocabulary entries, each with the word as
  typed when that is a token too (how the search page asks), by prob and by logit, under both readouts:
  wall time p50 / p95 of the request, and how many pairs came back each way (target: 200).

    .venv/bin/python -m bench.search_depth [--device cpu] [--queries 30]

Figures go into bench-results.json under "search_depth".
"""

from __future__ import annotations

import random
import time

import torch
from fastapi.testclient import TestClient

from bench import harness
from ffmem.config import get_settings
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

LIMIT = 200


def queries(loaded, n: int, rng: random.Random) -> list[list[int]]:
    """`n` random vocabulary entries that are a space and a word, with the word alone where it is a token."""
    vocab = loaded.tokenizer.get_vocab()
    texts = {loaded.tokenizer.decode([i]): i for i in vocab.values()}
    spaced = sorted(t for t in texts if t.startswith(" ") and t[1:].isalpha() and len(t) > 3)
    return [sorted({texts[t]} | ({texts[t[1:]]} if t[1:] in texts else set())) for t in rng.sample(spaced, n)]


def main() -> None:
    settings = get_settings()
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default=settings.device, help="the worker's device (default: settings')")
    parser.add_argument("--queries", type=int, default=30, help="random words searched per ranking")
    args = parser.parse_args()
    live = Live(device=args.device, cache_dir=settings.cache_dir)
    t0 = time.perf_counter()
    loaded = live.model(settings.model)
    harness.log(f"loaded {settings.model} in {time.perf_counter() - t0:.1f} s on {loaded.device}")
    asked = queries(loaded, args.queries, random.Random(0))
    results = {
        "model": settings.model,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype),
        "threads": torch.get_num_threads(),
        "memories": loaded.n_layers * loaded.n_keys,
        "limit": LIMIT,
        "queries": f"{args.queries} random ' word' entries (with 'word' where it is a token)",
    }
    with TestClient(create_live_app(live), base_url="http://worker") as worker:

        def search(tokens: list[int], readout: str, by: str) -> tuple[float, dict]:
            body = {"model": settings.model, "token_ids": tokens, "readout": readout, "by": by}
            body["limit"] = LIMIT
            t0 = time.perf_counter()
            response = worker.post("/token-memories", json=body)
            ms = 1000 * (time.perf_counter() - t0)
            assert response.status_code == 200, response.text
            return ms, response.json()

        for readout in ("raw", "norm"):
            first, _ = search(asked[0], readout, "prob")
            results[f"first_prob_search_{readout}_ms"] = round(first, 1)  # with every value's log Z
            harness.log(f"first search by prob, {readout}: {first:.0f} ms")
            for by in ("prob", "logit"):
                times, counts = [], set()
                for tokens in asked:
                    ms, answer = search(tokens, readout, by)
                    times.append(ms)
                    counts |= {len(answer["promote"]), len(answer["suppress"])}
                results[f"{readout}_{by}"] = harness.percentiles(times) | {"pairs_each_way": sorted(counts)}
                harness.log(f"{readout} by {by}: {results[f'{readout}_{by}']}")
    harness.record(args, "search_depth", results)


if __name__ == "__main__":
    main()
