"""Finding memories on the default index (a benchmark, not a test): `make bench` runs it.

- full-vocabulary token search: server time (the Server-Timing header) of `/m/…/search.json?q=<token>`
  over random vocabulary words, p50 / p95 (target p50 ≤ 100 ms; the page also runs the text search
  and the label and explanation searches of q); the first search of a run; in this process, the token
  part of the page (web/token_search: the token's rows of the token → memories table, the merge, the
  shown memories' ranks) p50;
- the key page's related section (neighbours, weight graph): server time p50 / p95 over random keys;
- the neighbours of every memory on the real default model (ffmem.engine.relations.neighbours, as the worker
  runs them) over the mining pass of the default index (measured on the run when it is the default one, and
  estimated from the mining speed measured back to back with the neighbours);
- storage added per key: the run's token → memories table and neighbour rows (bytes stored, and pages on
  disk for SQLite), and the whole database over its keys.

    .venv/bin/python -m bench.search [--db sqlite:////tmp/ffmem-search/ffmem.db]

Builds the default index first (`ffmem index`) when the database has none. The explorer runs as
`ffmem serve` in its own process (no live worker). Figures go into bench-results.json under "search".
"""

from __future__ import annotations

import os
import random
import time

import httpx
from sqlalchemy import func, select, text

from bench import harness
from bench.bench import batches_of
from ffmem.config import get_settings
from ffmem.store import runs
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import LanguageModel, Neighbours, Shard, Token, TokenMemoryList
from ffmem.web import token_search

QUERIES, KEYS = 60, 200


def words(sessions, model_id: int, n: int, rng: random.Random) -> list[str]:
    """`n` random vocabulary entries that are a space and a word (how a search for a word reads)."""
    with sessions() as session:
        texts = session.scalars(select(Token.text).where(Token.model_id == model_id)).all()
    spaced = sorted(t for t in texts if t.startswith(" ") and t[1:].isalpha() and len(t) > 3)
    return rng.sample(spaced, n)


def web_figures(url: str, sessions, run_id: int, slug: str, model_id: int, layers: int, keys: int) -> dict:
    rng = random.Random(0)
    tokens = words(sessions, model_id, QUERIES, rng)
    with harness.served(url) as explorer, httpx.Client(base_url=explorer.base, timeout=60) as client:
        search = f"/m/{slug}/search.json"
        first = harness.server_ms(client.get(search, params={"q": tokens[0], "run": run_id}))
        found = client.get(search, params={"q": tokens[0], "run": run_id}).json()
        assert found["token_coverage"] == "full" and found["memories"] == layers * keys, found
        token_ms = [
            harness.server_ms(client.get(search, params={"q": t, "run": run_id, "by": by}))
            for t in tokens
            for by in ("prob", "logit")
        ]
        picks = [(rng.randrange(layers), rng.randrange(keys)) for _ in range(KEYS)]
        related_ms, twin_ms = [], []
        for layer, key in picks:
            related = f"/m/{slug}/layers/{layer}/keys/{key}/related"
            page = client.get(related, params={"run": run_id})
            assert 'id="neighbours-key"' in page.text, "the related section shows its neighbours"
            related_ms.append(harness.server_ms(page))
            twin_ms.append(harness.server_ms(client.get(f"{related}.json", params={"run": run_id})))
    return {
        "token_search": harness.percentiles(token_ms) | {"target_p50_ms": 100},
        "first_token_search_ms": round(first, 1),
        "key_related": harness.percentiles(related_ms),  # the key page itself: bench.web
        "key_related_json": harness.percentiles(twin_ms),
        "queries": "random ' word' vocabulary entries, by prob and logit, limit 50 (and its text search)",
    }


def token_part(sessions, run_id: int, model_id: int) -> dict:
    """In this process: the token part of a search page (the token's table rows, the merge, the shown
    memories' value lists for their ranks and log Z)."""
    rng = random.Random(1)
    ranked = []
    with sessions() as session:
        ids = session.scalars(select(Token.token_id).where(Token.model_id == model_id)).all()
        run, model = runs.get_run(session=session, run_id=run_id), session.get(LanguageModel, model_id)
        for t in rng.sample(list(ids), QUERIES):
            t0 = time.perf_counter()
            token_search.rank_memories(session, model, run, [t], readout="raw", by="prob", limit=50)
            ranked.append(1000 * (time.perf_counter() - t0))
    return {"token_part_of_the_page": harness.percentiles(ranked)}


def storage(url: str, sessions, run_id: int, memories: int) -> dict:
    with sessions() as session:
        table = TokenMemoryList
        tokens = session.scalar(select(func.sum(func.length(table.data))).where(table.run_id == run_id))
        neighbour_rows = session.scalar(
            select(func.count()).select_from(Neighbours).where(Neighbours.run_id == run_id)
        )
        neighbour_bytes = session.scalar(
            select(func.sum(func.length(Neighbours.data))).where(Neighbours.run_id == run_id)
        )
        runs = session.scalar(text("SELECT count(*) FROM runs"))
        figures = {
            "token_table_bytes_per_key": round(tokens / memories),
            "token_table_mb": round(tokens / 2**20, 1),
            "neighbour_rows": neighbour_rows,
            "neighbours_bytes_per_key": round(neighbour_bytes / memories),
        }
        if session.get_bind().dialect.name == "sqlite":
            pages = dict(session.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all())
            ours = {
                "token_memories",
                "neighbours",
                "sqlite_autoindex_token_memories_1",
                "sqlite_autoindex_neighbours_1",
            }
            figures["added_on_disk_bytes_per_key"] = round(sum(pages.get(n, 0) for n in ours) / memories)
            figures["neighbours_on_disk_bytes_per_key"] = round(
                (pages.get("neighbours", 0) + pages.get("sqlite_autoindex_neighbours_1", 0)) / memories
            )
            if runs == 1:
                path = url.removeprefix("sqlite:///")
                figures["database_bytes_per_key"] = round(os.path.getsize(path) / memories)
                figures["database_bytes_per_key_without_ours"] = round(
                    (os.path.getsize(path) - sum(pages.get(n, 0) for n in ours)) / memories
                )
    return figures


def neighbours_over_mining(sessions, run_id: int, settings, sample: int) -> dict:
    """Neighbours of every memory, timed as the worker runs them, over the mining pass of the default
    index: measured (its shards' first claim to last checkpoint) when this run is it, and, back to back
    with the neighbours in this process (the same load on the machine), estimated from the mining speed
    over `sample` sentences times the default corpus's tokens."""
    import torch

    from ffmem.engine.mining.batches import mine_batches
    from ffmem.engine.mining.corpus import read_corpus
    from ffmem.engine.mining.state import MiningState
    from ffmem.engine.model.loading import load_model
    from ffmem.engine.relations.neighbours import memory_neighbours

    def batches_for(n_sentences: int) -> list:
        return batches_of(loaded, read_corpus("wiki-vital", n_sentences).sentences, settings)

    with sessions() as session:
        shards = session.scalars(select(Shard).where(Shard.run_id == run_id)).all()
        measured = sum((s.updated_at - s.started_at).total_seconds() for s in shards if s.started_at)
        run_sentences = runs.get_run(session=session, run_id=run_id).n_sentences
    loaded = load_model(
        settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir
    )
    default_tokens = sum(b.real_tokens for b in batches_for(settings.sentences))
    batches = batches_for(sample)
    t0 = time.perf_counter()
    mine_batches(
        loaded, batches, MiningState(loaded.n_layers, loaded.n_keys, settings.top_k, device=loaded.device)
    )
    rate = sum(b.real_tokens for b in batches) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    memory_neighbours(loaded)
    seconds = time.perf_counter() - t0
    estimated = default_tokens / rate
    return {
        "neighbours_s": round(seconds, 1),
        "mining_tokens_per_s": round(rate, 1),
        "default_index_tokens": default_tokens,
        "default_mining_pass_estimated_s": round(estimated, 1),
        "ratio_to_estimated_mining_pass": round(seconds / estimated, 3),
        "this_run_mining_pass_s": round(measured, 1),
        "this_run_sentences": run_sentences,
        "ratio_to_this_run_mining_pass": round(seconds / measured, 3) if measured else None,
        "device": str(loaded.device),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    settings = get_settings()
    parser = harness.parser(__doc__, db=True)
    parser.add_argument("--sentences", type=int, default=settings.sentences, help="the index's sentences")
    parser.add_argument("--mining-sample", type=int, default=300, help="sentences mined to time mining")
    args = parser.parse_args()
    url = harness.database_url(args)
    run = harness.default_run(url, args.sentences)
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        model_id = runs.get_run(session=session, run_id=run.id).model_id
    run_id, slug, layers, keys = run.id, run.slug, run.n_layers, run.n_keys
    memories = layers * keys
    results = {"run": run_id, "memories": memories, "storage": storage(url, sessions, run_id, memories)}
    print(results, flush=True)
    results["in_process"] = token_part(sessions, run_id, model_id)
    print(results["in_process"], flush=True)
    results["web"] = web_figures(url, sessions, run_id, slug, model_id, layers, keys)
    print(results["web"], flush=True)
    results["neighbours"] = neighbours_over_mining(sessions, run_id, settings, args.mining_sample)
    print(results["neighbours"], flush=True)
    harness.record(args, "search", results)


if __name__ == "__main__":
    main()
