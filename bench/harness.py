"""What the benchmarks share, as tests share conftest: the common flags, timing and percentiles, the
explorer served over HTTP, the default index, a private Postgres schema, and bench-results.json.

Every script is run from the repository root as `python -m bench.NAME`. This module imports only the
standard library and httpx when imported: bench/gpu.py runs where pydantic, SQLAlchemy and FastAPI are
not installed, so what needs ffmem's settings or store imports it in the function that uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench-results.json"
FFMEM = [sys.executable, "-c", "from ffmem.cli import main; main()"]  # the `ffmem` command of this Python
POSTGRES_URL = os.environ.get("FFMEM_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
START = time.monotonic()


# -- the command line -----------------------------------------------------------------------------------
def parser(doc: str, *, db: bool = False, repeats: int | None = None, record: bool = True):
    """A script's parser, described by the first line of its docstring, with the common flags it takes:
    `--db` (a database URL; default FFMEM_DATABASE_URL, the settings'), `--repeats` (with this default),
    and `--out` / `--no-record` (where the figures go). The script adds its own flags to it."""
    found = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if db:
        found.add_argument("--db", help="database URL (default: the settings', FFMEM_DATABASE_URL)")
    if repeats is not None:
        found.add_argument(
            "--repeats", type=int, default=repeats, help=f"rounds measured (default {repeats})"
        )
    if record:
        found.add_argument("--out", type=Path, default=RESULTS, help="the results file (bench-results.json)")
        found.add_argument("--no-record", action="store_true", help="print the figures only")
    return found


def database_url(args: argparse.Namespace) -> str:
    """`--db`, else the settings' database."""
    from ffmem.config import get_settings

    return args.db or get_settings().database_url


def record(args: argparse.Namespace, section: str, results: dict) -> None:
    """Write `results` under `section` of the results file (`--out`), keeping the other sections; nothing
    with `--no-record`."""
    if args.no_record:
        return
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing[section] = results
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.out} ({section})")


def log(message: str) -> None:
    """A line with the seconds since the script started."""
    print(f"[{time.monotonic() - START:6.1f} s] {message}", flush=True)


# -- timing ---------------------------------------------------------------------------------------------
def percentiles(ms: list[float]) -> dict:
    """p50, p95 and p99 of some milliseconds, and how many (a single sample is its own p50)."""
    if len(ms) < 2:
        return {"p50_ms": round(ms[0], 2) if ms else None, "p95_ms": None, "p99_ms": None, "n": len(ms)}
    cuts = statistics.quantiles(ms, n=100, method="inclusive")
    return {
        "p50_ms": round(cuts[49], 2),
        "p95_ms": round(cuts[94], 2),
        "p99_ms": round(cuts[98], 2),
        "n": len(ms),
    }


def wall_ms(run: Callable[[], object]) -> float:
    """Milliseconds `run()` takes."""
    start = time.perf_counter()
    run()
    return 1000 * (time.perf_counter() - start)


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, measure=wall_ms, warmup: int = 3
) -> dict[str, list[float]]:
    """Each variant once per round, in turn (so a drifting load hits all alike), after `warmup` rounds
    not kept; `measure(run)` gives a round's figure (default: its wall milliseconds)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds + warmup):
        for name, run in variants.items():
            sample = measure(run)
            if round_ >= warmup:
                times[name].append(sample)
    return times


def module_at(revision: str, paths: tuple[str, ...], name: str):
    """The first of `paths` (a module's file, under the names it had) as of git `revision`, imported as a
    module of its own called `name`: an older version timed beside the working tree's."""
    import importlib.util
    import tempfile

    for path in paths:
        shown = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no {paths[0]} at git revision {revision}: {shown.stderr.strip()}")
    source = Path(tempfile.mkdtemp()) / f"{name}.py"
    source.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_ms(response: httpx.Response) -> float:
    """The app's own time for a request (its Server-Timing header); the answer must be a 200."""
    assert response.status_code == 200, (response.status_code, response.text[:300])
    return float(re.search(r"dur=([\d.]+)", response.headers["server-timing"]).group(1))


def sequential(client: httpx.Client, paths: list[str]) -> dict:
    """GET each path in turn: server and wall milliseconds, p50 / p95 of each."""
    server, wall = [], []
    for path in paths:
        start = time.perf_counter()
        response = client.get(path)
        wall.append(1000 * (time.perf_counter() - start))
        server.append(server_ms(response))
    return {"server": percentiles(server), "wall": percentiles(wall)}


async def concurrent(base: str, paths: list[str], clients: int = 32, seconds: float = 20.0) -> dict:
    """`clients` clients for `seconds`, each sending a random path of `paths` as soon as its last was
    answered: requests, statuses, errors (anything but a 200, failed connections included), latency."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    stop = time.monotonic() + seconds

    async def client_loop(client: httpx.AsyncClient, seed: int) -> None:
        pick = random.Random(seed)
        while time.monotonic() < stop:
            start = time.perf_counter()
            try:
                status = str((await client.get(pick.choice(paths))).status_code)
            except httpx.HTTPError as error:
                status = type(error).__name__
            latencies.append(1000 * (time.perf_counter() - start))
            statuses[status] += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, seed) for seed in range(clients)))
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": len(latencies),
        "errors": len(latencies) - statuses["200"],
        "statuses": dict(sorted(statuses.items())),
        "requests_per_s": round(len(latencies) / seconds, 1),
        "latency": percentiles(latencies),
    }


# -- the explorer over HTTP -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen
    base: str  # its URL, http://127.0.0.1:PORT


@contextmanager
def served(url: str, worker: bool = False) -> Iterator[Served]:
    """`ffmem serve` of the database at `url` in its own process on a free port, as in production, until
    the block ends. Without `worker` it starts no live worker (the browse pages need none; a worker
    loading the model would share the CPU with what is measured)."""
    port = free_port()
    command = [*FFMEM, "serve", "--db", url, "--port", str(port)]
    if not worker:
        command += ["--worker-url", f"http://127.0.0.1:{free_port()}"]  # one that nobody serves
    process = subprocess.Popen(command, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/.json", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit("the explorer did not start")
            time.sleep(0.2)
        yield Served(process, base)
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_for_trace(base: str, slug: str, text: str, seconds: float = 300) -> None:
    """The live worker loads its model after the web process starts: wait for a first trace of `text`."""
    deadline = time.monotonic() + seconds
    while True:
        response = httpx.get(f"{base}/m/{slug}/trace.json", params={"text": text}, timeout=120)
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the live worker never answered: {response.status_code} {response.text[:200]}")
        time.sleep(1)


# -- databases ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexRun:
    """A finished index run and its model's shape."""

    id: int
    slug: str
    n_layers: int
    n_keys: int
    n_tokens: int
    n_sentences: int
    corpus_id: int


def default_run(url: str, sentences: int | None = None) -> IndexRun:
    """The finished run of the default model over `sentences` (default: the settings') in `url`, built
    first with `ffmem index` when there is none."""
    from ffmem.config import get_settings
    from ffmem.store import runs
    from ffmem.store.db import make_engine, make_sessionmaker, upgrade

    settings = get_settings()
    sentences = sentences or settings.sentences
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    try:
        for attempt in range(2):
            with sessions() as session:
                run = runs.find_finished_run(
                    session=session, model_slug=settings.model, n_sentences=sentences
                )
                if run is not None:
                    model = run.model
                    return IndexRun(
                        run.id, model.slug, model.n_layers, model.n_keys, run.n_tokens, run.n_sentences,
                        run.corpus_id,
                    )  # fmt: skip
            if attempt == 0:
                print(f"building the default index first (ffmem index --sentences {sentences})", flush=True)
                command = [*FFMEM, "index", "--sentences", str(sentences), "--db", url]
                subprocess.run(command, check=True, cwd=ROOT)
    finally:
        engine.dispose()
    raise SystemExit("the default index could not be built")


def postgres_schema(schema: str) -> str:
    """A fresh schema `schema` (dropped first) of the test Postgres (FFMEM_TEST_POSTGRES_URL or the local
    server's `test` database): the URL that works in it."""
    from sqlalchemy import create_engine, make_url, text

    admin = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    with admin.begin() as connection:
        connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False)
