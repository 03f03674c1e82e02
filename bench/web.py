"""Explorer speed on the default index (a benchmark, not a test): `make bench` runs it after bench.py.

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
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results import record  # noqa: E402

from ffmem.config import get_settings  # noqa: E402
from ffmem.store import runs  # noqa: E402
from ffmem.store.db import make_engine, make_sessionmaker, upgrade  # noqa: E402

SAMPLES = 300
CLIENTS, SECONDS = 32, 20.0
FFMEM = [sys.executable, "-c", "from ffmem.cli import main; main()"]


def default_run(url: str) -> tuple[str, int, int]:
    """(slug, layers, keys) of the default index, built first when missing."""
    settings = get_settings()
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        run = runs.find_finished_run(
            session=session, model_slug=settings.model, n_sentences=settings.sentences
        )
    if run is None:
        print("building the default index first (ffmem demo --no-serve)", flush=True)
        subprocess.run([*FFMEM, "demo", "--no-serve", "--db", url], check=True, cwd=ROOT)
    with sessions() as session:
        model = runs.get_model(session=session, slug=settings.model)
        return model.slug, model.n_layers, model.n_keys


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(url: str, worker: bool = False) -> tuple[subprocess.Popen, str]:
    """`ffmem serve` on a free port: (its process, its base URL). Without `worker` it starts no live worker
    (the browse pages need none; a worker loading the model would share the CPU with what is measured)."""
    port = free_port()
    command = [*FFMEM, "serve", "--db", url, "--port", str(port)]
    if not worker:
        command += ["--worker-url", f"http://127.0.0.1:{free_port()}"]  # one that nobody serves
    process = subprocess.Popen(command, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/.json", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the explorer did not start")


def percentiles(samples: list[float]) -> dict:
    cuts = statistics.quantiles(samples, n=20, method="inclusive")
    return {"p50_ms": round(cuts[9], 2), "p95_ms": round(cuts[18], 2), "n": len(samples)}


def server_ms(response: httpx.Response) -> float:
    return float(re.search(r"dur=([\d.]+)", response.headers["server-timing"]).group(1))


def sequential(client: httpx.Client, paths: list[str]) -> dict:
    server, wall = [], []
    for path in paths:
        start = time.perf_counter()
        response = client.get(path)
        wall.append(1000 * (time.perf_counter() - start))
        response.raise_for_status()
        server.append(server_ms(response))
    return {"server": percentiles(server), "wall": percentiles(wall)}


async def concurrent(base: str, paths: list[str]) -> dict:
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + SECONDS

    async def client_loop(client: httpx.AsyncClient, seed: int) -> None:
        nonlocal errors
        pick = random.Random(seed)
        while time.monotonic() < stop:
            start = time.perf_counter()
            try:
                response = await client.get(pick.choice(paths))
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(1000 * (time.perf_counter() - start))
            errors += not ok

    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, seed) for seed in range(CLIENTS)))
    return {
        "clients": CLIENTS,
        "seconds": SECONDS,
        "requests": len(latencies),
        "errors": errors,
        "requests_per_s": round(len(latencies) / SECONDS, 1),
        "latency": percentiles(latencies),
    }


def main() -> None:
    url = get_settings().database_url
    slug, n_layers, n_keys = default_run(url)
    pick = random.Random(0)
    key_paths = [
        f"/m/{slug}/layers/{pick.randrange(n_layers)}/keys/{pick.randrange(n_keys)}" for _ in range(SAMPLES)
    ]
    layer_paths = [f"/m/{slug}/layers/{pick.randrange(n_layers)}" for _ in range(SAMPLES // 3)]
    sorted_paths = [f"{p}?sort=max_prob&order=desc&page={pick.randint(1, 30)}" for p in layer_paths]
    search_paths = [f"/m/{slug}/search?q={q}" for q in (" Paris", " the", "capital of", " than", "L12 K345")]
    process, base = serve(url)
    try:
        with httpx.Client(base_url=base, timeout=30, follow_redirects=True) as client:
            for path in key_paths[:20] + layer_paths[:5]:  # warm the database pages
                client.get(path)
            results = {
                "database": url.split(":", 1)[0],
                "key_page": sequential(client, key_paths),
                "key_page_json": sequential(client, [f"{p}.json" for p in key_paths]),
                # the sections the key page loads when scrolled to (their pages: the fragment and more)
                "key_samples": sequential(client, [f"{p}/samples" for p in key_paths]),
                "key_related": sequential(client, [f"{p}/related" for p in key_paths]),
                "layer_page": sequential(client, layer_paths),
                "layer_page_sorted": sequential(client, sorted_paths),
                "search": sequential(client, search_paths * 4),
                "target": {"key_page_p50_ms": 20},
            }
        sections = [f"{p}/{section}" for p in key_paths[::3] for section in ("samples", "related")]
        mix = key_paths + sections + layer_paths + sorted_paths + search_paths
        results["concurrent"] = asyncio.run(concurrent(base, mix))
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(json.dumps(results, indent=2))
    record("web", results)


if __name__ == "__main__":
    main()
