"""Mixed load on the explorer (a benchmark, not a test): `make bench` runs it after bench.attribution.

`--clients` (32) concurrent clients (httpx, asyncio) for `--seconds` (60), each sending its next
request as soon as the last is answered, picked in fixed proportions (MIX): browse (home, model,
layer and key pages and their JSON twins, random layers and keys, some layer pages sorted), search
(tokens, text, `L12 K345` references) and live traces (prefixes of the index's own Wikipedia
sentences, 4–12 words, with varied positions, edits and continuations; JSON twin or page).

`ffmem serve` runs in its own process with its live worker (on a free port), on the default index
(built first when missing) or on `--db`'s newest finished run. All clients come from 127.0.0.1, so
the server runs with FFMEM_TRACE_RATE_LIMIT raised to RATE_LIMIT; 429s are counted anyway.

Per kind: requests, statuses, 503 "busy" refusals (the worker's full queue: expected under overload,
not errors), 429s, errors (anything else but a 200, failed connections included), p50/p95/p99
latency of the 200 answers, throughput (answers within the load's seconds). Into bench-results.json
under "load" with the settings used.

    python -m bench.load [--seconds 60] [--clients 32] [--db URL] [--no-record]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import quote

import httpx
from sqlalchemy import select

from bench import harness
from ffmem.config import get_settings
from ffmem.store import runs
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Run, Sentence

MIX = {"browse": 0.6, "search": 0.2, "trace": 0.2}
RATE_LIMIT = "1000000/minute"  # one address for every client: the limit must not be what is measured
PROMPTS = 300
WORDS = [" Paris", " the", " water", " war", " music", " king", " river", " language", " science", " of"]


@dataclass(frozen=True)
class Index:
    slug: str
    n_layers: int
    n_keys: int
    sentences: int
    prompts: list[str]


@dataclass(frozen=True)
class Sample:
    kind: str
    status: str  # "200", "503", … or the exception's name ("ReadTimeout")
    ms: float
    busy: bool  # a 503 because the live worker's queue is full
    done: float  # seconds from the start of the load to the answer


def find_index(url: str, default: bool) -> Index:
    """The default run (built when missing) or, for `--db`, the newest finished run there."""
    settings = get_settings()
    if default:
        harness.default_run(url)
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        if default:
            run = runs.find_finished_run(
                session=session, model_slug=settings.model, n_sentences=settings.sentences
            )
        else:
            query = select(Run).where(Run.status == "done").order_by(Run.id.desc()).limit(1)
            run = session.scalars(query).first()
        if run is None:
            raise SystemExit(f"no finished index run in {url}; build one with `ffmem index --db {url}`")
        texts = session.scalars(
            select(Sentence.text)
            .where(Sentence.corpus_id == run.corpus_id)
            .order_by(Sentence.index)
            .limit(PROMPTS)
        ).all()
        model = run.model
        pick = random.Random(1)
        prompts = [" ".join(text.split()[: pick.randint(4, 12)]) for text in texts]
        return Index(model.slug, model.n_layers, model.n_keys, run.n_sentences, [p for p in prompts if p])


def browse(index: Index, pick: random.Random) -> str:
    """Home, model, layer (some sorted) or key page, 1:1:2:3, half of them as their JSON twin."""
    m = f"/m/{index.slug}"
    layer, key = pick.randrange(index.n_layers), pick.randrange(index.n_keys)
    pages = ["/", m, f"{m}/layers/{layer}", f"{m}/layers/{layer}/keys/{key}"]
    page = pick.choices(pages, weights=[1, 1, 2, 3])[0]
    query = ""
    if page == pages[2] and pick.random() < 0.3:
        sort = pick.choice(["max_coefficient", "density", "agreement", "positive_share"])
        query = f"?sort={sort}&order=desc&page={pick.randint(1, max(1, index.n_keys // 50))}"
    if pick.random() < 0.5:
        page = "/.json" if page == "/" else f"{page}.json"
    return page + query


def search(index: Index, pick: random.Random) -> str:
    prompt = pick.choice(index.prompts).split()
    q = pick.choice(
        [
            pick.choice(WORDS),
            " " + pick.choice(prompt),
            " ".join(prompt[:2]),
            f"L{pick.randrange(index.n_layers)} K{pick.randrange(index.n_keys)}",
        ]
    )
    json_twin = ".json" if pick.random() < 0.5 else ""
    return f"/m/{index.slug}/search{json_twin}?q={quote(q)}"


def trace(index: Index, pick: random.Random) -> str:
    text = pick.choice(index.prompts)
    query = f"text={quote(text)}"
    roll = pick.random()
    if roll < 0.2:  # a word is at least a token: the position is in the prompt
        query += f"&position={pick.randrange(len(text.split()))}"
    elif roll < 0.35:
        layer, key = pick.randrange(index.n_layers), pick.randrange(index.n_keys)
        query += f"&intervene={quote(f'L{layer}K{key}')}&generate={pick.randint(1, 4)}"
    json_twin = ".json" if pick.random() < 0.75 else ""
    return f"/m/{index.slug}/trace{json_twin}?{query}"


PATHS = {"browse": browse, "search": search, "trace": trace}


async def load(base: str, index: Index, clients: int, seconds: float, timeout: float) -> tuple[list, float]:
    samples: list[Sample] = []
    start = time.monotonic()
    stop = start + seconds
    kinds, weights = list(MIX), list(MIX.values())

    async def client_loop(client: httpx.AsyncClient, seed: int) -> None:
        pick = random.Random(seed)
        while time.monotonic() < stop:
            kind = pick.choices(kinds, weights)[0]
            path = PATHS[kind](index, pick)
            began = time.perf_counter()
            try:
                response = await client.get(path)
                status, busy = str(response.status_code), False
                if response.status_code == 503:
                    busy = "worker is busy" in response.text  # not loading, down, or the database
            except httpx.HTTPError as error:
                status, busy = type(error).__name__, False
            done = time.monotonic() - start
            samples.append(Sample(kind, status, 1000 * (time.perf_counter() - began), busy, done))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(
        base_url=base,
        timeout=timeout,
        limits=limits,
        follow_redirects=True,  # `L12 K345` → the key page
    ) as client:
        await asyncio.gather(*(client_loop(client, seed) for seed in range(clients)))
    return samples, time.monotonic() - start


def summary(samples: list[Sample], seconds: float) -> dict:
    """Counts and latencies of every request; throughput of those answered within the `seconds`."""
    statuses = Counter(s.status for s in samples)
    ok = [s.ms for s in samples if s.status == "200"]
    busy = sum(s.busy for s in samples)
    in_time = [s for s in samples if s.done <= seconds]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "statuses": dict(sorted(statuses.items())),
        "busy_503": busy,
        "rate_limited_429": statuses.get("429", 0),
        "errors": len(samples) - len(ok) - busy,
        "requests_per_s": round(len(in_time) / seconds, 1),
        "ok_per_s": round(sum(s.status == "200" for s in in_time) / seconds, 1),
        "latency_ok": harness.percentiles(ok),
    }


def main() -> None:
    parser = harness.parser(__doc__, db=True)  # no --db: the default index, built when missing
    parser.add_argument("--seconds", type=float, default=60.0, help="Length of the load (default 60).")
    parser.add_argument("--clients", type=int, default=32, help="Concurrent clients (default 32).")
    args = parser.parse_args()
    settings = get_settings()
    url = args.db or settings.database_url
    index = find_index(url, default=args.db is None)
    print(
        f"{index.slug}: {index.sentences} sentences; {args.clients} clients for {args.seconds:g} s",
        flush=True,
    )
    # The server (and its worker, on a port of its own) read these from the environment.
    os.environ["FFMEM_TRACE_RATE_LIMIT"] = RATE_LIMIT
    os.environ["FFMEM_WORKER_URL"] = f"http://127.0.0.1:{harness.free_port()}"
    with harness.served(url, worker=True) as explorer:
        harness.wait_for_trace(explorer.base, index.slug, index.prompts[0])
        timeout = settings.worker_timeout + 10
        samples, total = asyncio.run(load(explorer.base, index, args.clients, args.seconds, timeout))
    kinds = {kind: summary([s for s in samples if s.kind == kind], args.seconds) for kind in MIX}
    overall = summary(samples, args.seconds)
    results = {
        "settings": {
            "clients": args.clients,
            "seconds": args.seconds,
            "mix": MIX,
            "cores": os.cpu_count(),
            "database": url.split(":", 1)[0],
            "model": index.slug,
            "sentences": index.sentences,
            "trace_rate_limit": RATE_LIMIT,
            "trace_queue": settings.trace_queue,
        },
        "drain_seconds": round(total - args.seconds, 2),  # from the end of the load to the last answer
        "kinds": kinds,
        "overall": {key: value for key, value in overall.items() if key != "latency_ok"},
    }
    print(json.dumps(results, indent=2))
    harness.record(args, "load", results)


if __name__ == "__main__":
    main()
