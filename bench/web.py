"""Explorer speed on the default index (a benchmark, not a test): `make bench` runs it after bench.bench.

- Server time (the Server-Timing header: routing, queries, rendering) and wall time per request for
  the key page, the sections it loads when scrolled to (examples across the range; related memories)
  and the layer page, over random keys / layers, sequentially: p50 and p95.
- 32 concurrent clients for 20 s over a mix of pages: requests, errors (non-200 or failed), p50/p95.

The explorer runs as `ffmem serve` in its own process, as in production. Builds the default index
first if the database has none. Figures go into bench-results.json under "web".
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from bench import harness

SAMPLES = 300


def main() -> None:
    args = harness.parser(__doc__, db=True).parse_args()
    url = harness.database_url(args)
    run = harness.default_run(url)
    slug, n_layers, n_keys = run.slug, run.n_layers, run.n_keys
    pick = random.Random(0)
    key_paths = [
        f"/m/{slug}/layers/{pick.randrange(n_layers)}/keys/{pick.randrange(n_keys)}" for _ in range(SAMPLES)
    ]
    layer_paths = [f"/m/{slug}/layers/{pick.randrange(n_layers)}" for _ in range(SAMPLES // 3)]
    sorted_paths = [f"{p}?sort=max_prob&order=desc&page={pick.randint(1, 30)}" for p in layer_paths]
    search_paths = [f"/m/{slug}/search?q={q}" for q in (" Paris", " the", "capital of", " than", "L12 K345")]
    with harness.served(url) as explorer:
        with httpx.Client(base_url=explorer.base, timeout=30, follow_redirects=True) as client:
            for path in key_paths[:20] + layer_paths[:5]:  # warm the database pages
                client.get(path)
            results = {
                "database": url.split(":", 1)[0],
                "key_page": harness.sequential(client, key_paths),
                "key_page_json": harness.sequential(client, [f"{p}.json" for p in key_paths]),
                # the sections the key page loads when scrolled to (their pages: the fragment and more)
                "key_samples": harness.sequential(client, [f"{p}/samples" for p in key_paths]),
                "key_related": harness.sequential(client, [f"{p}/related" for p in key_paths]),
                "layer_page": harness.sequential(client, layer_paths),
                "layer_page_sorted": harness.sequential(client, sorted_paths),
                "search": harness.sequential(client, search_paths * 4),
                "target": {"key_page_p50_ms": 20},
            }
        sections = [f"{p}/{section}" for p in key_paths[::3] for section in ("samples", "related")]
        mix = key_paths + sections + layer_paths + sorted_paths + search_paths
        results["concurrent"] = asyncio.run(harness.concurrent(explorer.base, mix))
    print(json.dumps(results, indent=2))
    harness.record(args, "web", results)


if __name__ == "__main__":
    main()
