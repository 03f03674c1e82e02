"""Index jobs (a benchmark, not a test): `make bench` runs it after bench.bench and bench.web.

- Checkpoint overhead: the mining loop of a shard (worker/index.IndexPipeline.mine_shard) with its database
  checkpoints when `Checkpoints` says (the run's first shard's early one, then by time) over the same loop
  with progress updates only, on the same batches of the default model (interleaved, best of 3).
  Target ≥ 0.95.
- Two workers over one: one prepared run on Postgres, its shards mined by one `ffmem worker`, then
  (shards reset) by two, on this machine, each worker's torch given cores / workers threads; mining
  wall time from the first shard claimed to the last one merged.

Figures go into bench-results.json under "jobs".
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from sqlalchemy import delete, select, text, update

from bench import harness
from ffmem.config import get_settings
from ffmem.engine.mining.batches import mine_batches, shard_batches
from ffmem.engine.mining.state import MiningState
from ffmem.store import jobs, shards
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Job, MinedLayerRow, Run, Shard
from ffmem.worker.index import Checkpoints, IndexOptions, _layers, _pad_id
from ffmem.worker.loop import Worker

SENTENCES, SHARD_SENTENCES = 480, 120


def prepared_run(url: str) -> tuple[Worker, int, int]:
    """A prepared run of the default model over SENTENCES sentences: (worker, job id, run id)."""
    options = IndexOptions.from_settings(
        get_settings(), progress=False, sentences=SENTENCES, shard_sentences=SHARD_SENTENCES
    )
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        job, _ = jobs.enqueue(session=session, spec=options.spec, again=True)
        session.commit()
    worker = Worker(sessions, options)
    worker.step()  # prepare: corpus, run, shards, values
    with sessions() as session:
        run_id = session.get(Job, job.id).run_id
    return worker, job.id, run_id


def checkpoint_overhead(worker: Worker, run_id: int) -> dict:
    """Mining one shard's batches with and without its database checkpoints, as mine_shard does."""
    loaded = worker.loaded
    with worker.sessions() as session:
        corpus_id = session.get(Run, run_id).corpus_id
    ids, first, _ = worker.index.corpus(corpus_id)
    batches = shard_batches(
        ids,
        first,
        shard=0,
        shard_sentences=len(ids),
        batch_tokens=worker.options.spec.batch_tokens,
        pad_id=_pad_id(loaded),
    )
    count = [0]  # checkpoints taken in the last pass
    with worker.sessions() as session:
        shard = session.scalars(select(Shard).where(Shard.run_id == run_id, Shard.index == 0)).one()
        session.execute(update(Shard).where(Shard.run_id == run_id).values(worker=worker.name))
        session.commit()

    def mine(checkpointed: bool) -> float:
        state = MiningState(loaded.n_layers, loaded.n_keys, worker.options.spec.top_k)
        count[0] = 0
        start = time.perf_counter()
        checkpoints = Checkpoints(worker.options.checkpoint_batches, worker.options.checkpoint_seconds, start)
        for number, batch in enumerate(batches, start=1):
            mine_batches(loaded, [batch], state)
            due = checkpointed and number < len(batches) and checkpoints.due(number, first=True)
            begun = time.perf_counter()
            layers = _layers(state) if due else None
            with worker.sessions() as session:
                shards.checkpoint_shard(
                    session=session,
                    shard=shard,
                    worker=worker.name,
                    lease=worker.options.lease,
                    batches_done=number,
                    sentences_done=0,
                    tokens_done=0,
                    layers=layers,
                )
                session.commit()
            if due:
                checkpoints.taken(begun)
                count[0] += 1
        return time.perf_counter() - start

    plain, checkpointed = [], []
    for _ in range(3):
        plain.append(mine(False))
        checkpointed.append(mine(True))
    tokens = sum(b.real_tokens for b in batches)
    with worker.sessions() as session:
        session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id, MinedLayerRow.shard >= 0))
        session.execute(update(Shard).where(Shard.run_id == run_id).values(worker=None, batches_done=0))
        session.commit()
    return {
        "sentences": len(ids),
        "tokens": tokens,
        "batches": len(batches),
        "checkpoint_batches": worker.options.checkpoint_batches,
        "checkpoint_seconds": worker.options.checkpoint_seconds,
        "checkpoints": count[0],
        "without_tokens_per_s": tokens / min(plain),
        "with_tokens_per_s": tokens / min(checkpointed),
        "ratio": min(plain) / min(checkpointed),
        "target": 0.95,
    }


def mining_wall(url: str, run_id: int, workers: int) -> float:
    """Seconds from the first shard claimed to the last one merged, with `workers` worker processes."""
    sessions = make_sessionmaker(make_engine(url))
    # The machine's cores shared out: each worker's torch gets cores / workers threads.
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // workers)))
    processes = [
        subprocess.Popen(
            [*harness.FFMEM, "worker", "--once", "--db", url, "--poll", "0.2"], cwd=harness.ROOT, env=env
        )
        for _ in range(workers)
    ]
    started = None
    try:
        while True:
            time.sleep(0.1)
            with sessions() as session:
                counts = shards.shard_counts(session=session, run_id=run_id)
            if started is None and (counts["running"] or counts["done"]):
                started = time.perf_counter()
            if counts["done"] == sum(counts.values()):
                return time.perf_counter() - started
    finally:
        for process in processes:
            process.wait(timeout=600)


def reset(url: str, job_id: int, run_id: int) -> None:
    """The run's shards back to pending (values stay): mine it again."""
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as session:
        session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id))
        session.execute(
            update(Shard)
            .where(Shard.run_id == run_id)
            .values(
                status="pending",
                worker=None,
                lease_until=None,
                batches_done=0,
                sentences_done=0,
                tokens_done=0,
            )
        )
        session.execute(
            update(Job).where(Job.id == job_id).values(status="running", worker=None, lease_until=None)
        )
        for table in ("triggers", "key_stats"):
            session.execute(text(f"DELETE FROM {table} WHERE run_id = :run"), {"run": run_id})
        session.execute(text("UPDATE runs SET status = 'running' WHERE id = :run"), {"run": run_id})
        session.commit()


def main() -> None:
    args = harness.parser(__doc__).parse_args()
    url = harness.postgres_schema("ffmem_bench_jobs")
    upgrade(url)
    worker, job_id, run_id = prepared_run(url)
    results = {"checkpoint": checkpoint_overhead(worker, run_id)}
    one = mining_wall(url, run_id, 1)
    reset(url, job_id, run_id)
    two = mining_wall(url, run_id, 2)
    results["workers"] = {
        "sentences": SENTENCES,
        "shards": -(-SENTENCES // SHARD_SENTENCES),
        "one_worker_s": one,
        "two_workers_s": two,
        "speedup": one / two,
        "cores": os.cpu_count(),
    }
    print(json.dumps(results, indent=2))
    harness.record(args, "jobs", results)


if __name__ == "__main__":
    main()
