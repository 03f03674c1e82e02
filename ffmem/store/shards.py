"""A run's shards in the database (no torch here): n of them mine its sentences, each under a lease
(docs/queue.md), checkpointing its mined layers into `mined_layers` and, when done, merging them into
the run's snapshot. Called by the worker's mining stage; the explorer reads a run's progress and the
parts of a layer being mined.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, insert, or_, select, update
from sqlalchemy.orm import Session

from ffmem.store.jobs import give_up
from ffmem.store.models import Job, JobKind, JobStatus, MinedLayerRow, Run, Shard, ShardStatus, now


@dataclass(frozen=True)
class MiningProgress:
    """How far a run's mining has come, over all its shards."""

    mining_since: datetime | None  # when its first shard was taken up
    sentences_done: int
    tokens_done: int
    shards: int
    shards_done: int
    fraction: float  # of the run's sentences


def create_shards(*, session: Session, run_id: int, n_sentences: int, shard_sentences: int) -> None:
    """The run's shards, all pending: n = ⌈n_sentences / shard_sentences⌉ of them, shard k mining every
    n-th of the run's mined sentences from the k-th (ffmem.engine.mining.corpus.shard_members); [start, stop)
    is its span when the shards' sentences are listed one shard after another."""
    moment = now()
    n_shards = -(-n_sentences // shard_sentences)
    start = 0
    for index in range(n_shards):
        stop = start + len(range(index, n_sentences, n_shards))
        session.add(
            Shard(
                run_id=run_id,
                index=index,
                start=start,
                stop=stop,
                status=ShardStatus.pending,
                attempts=0,
                batches_done=0,
                sentences_done=0,
                tokens_done=0,
                updated_at=moment,
            )
        )
        start = stop
    session.flush()


def claim_shard(
    *, session: Session, run_id: int, worker: str, lease: timedelta, max_attempts: int
) -> Shard | None:
    """A pending shard of the run, or one whose lease ran out, leased to `worker`. A shard taken up
    `max_attempts` times, its worker dying each time, fails its job with the reason instead (None)."""
    moment = now()
    expired = (Shard.status == ShardStatus.running) & (Shard.lease_until < moment)
    claimable = or_(Shard.status == ShardStatus.pending, expired)
    query = (
        select(Shard)
        .where(Shard.run_id == run_id, claimable)
        .order_by(Shard.index)
        .limit(1)
        .with_for_update(skip_locked=True)
    )
    shard = session.scalars(query).first()
    if shard is None:
        return None
    if shard.status == ShardStatus.running and shard.attempts >= max_attempts:
        its_job = (Job.kind == JobKind.index) & (Job.run_id == run_id) & (Job.status == JobStatus.running)
        job = session.scalars(select(Job).where(its_job)).first()
        if job is not None:
            step = f"mining shard {shard.index}"
            give_up(session, job, step, attempts=shard.attempts, holder=shard.worker, lease=lease)
        return None
    shard.status, shard.worker, shard.lease_until = ShardStatus.running, worker, moment + lease
    shard.updated_at = moment
    shard.started_at = shard.started_at or moment
    shard.attempts += 1
    session.flush()
    return shard


def hold_shard(*, session: Session, run_id: int, index: int, worker: str, lease: timedelta) -> bool:
    """Renew `worker`'s lease on a shard it mines; False if it lost it (or the shard is done)."""
    held = (
        (Shard.run_id == run_id)
        & (Shard.index == index)
        & (Shard.worker == worker)
        & (Shard.status == ShardStatus.running)
    )
    return session.execute(update(Shard).where(held).values(lease_until=now() + lease)).rowcount == 1


def checkpoint_shard(
    *,
    session: Session,
    shard: Shard,
    worker: str,
    lease: timedelta,
    batches_done: int,
    sentences_done: int,
    tokens_done: int,
    layers: list[bytes] | None,
) -> bool:
    """Record progress and renew the lease; with `layers`, also checkpoint them as the state after
    `batches_done` batches (what a resume starts from). False if the lease was lost."""
    values = dict(
        sentences_done=sentences_done, tokens_done=tokens_done, lease_until=now() + lease, updated_at=now()
    )
    if layers is not None:
        values["batches_done"] = batches_done
    held = (Shard.run_id == shard.run_id) & (Shard.index == shard.index) & (Shard.worker == worker)
    if session.execute(update(Shard).where(held).values(**values)).rowcount != 1:
        return False
    if layers is not None:
        save_layers(session=session, run_id=shard.run_id, shard=shard.index, layers=layers)
    return True


def load_checkpoint(*, session: Session, run_id: int, index: int) -> tuple[list[bytes] | None, int]:
    """(mined layers, the number of batches they hold) of a shard; (None, 0) before its first checkpoint."""
    layers = load_layers(session=session, run_id=run_id, shard=index)
    if layers is None:
        return None, 0
    return layers, session.scalar(
        select(Shard.batches_done).where(Shard.run_id == run_id, Shard.index == index)
    )


def save_layers(*, session: Session, run_id: int, shard: int, layers: list[bytes]) -> None:
    """Replace the mined layers stored under (run, shard)."""
    session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id, MinedLayerRow.shard == shard))
    rows = [
        {"run_id": run_id, "shard": shard, "layer": layer, "data": data} for layer, data in enumerate(layers)
    ]
    session.execute(insert(MinedLayerRow), rows)


def load_layers(*, session: Session, run_id: int, shard: int) -> list[bytes] | None:
    """The mined layers stored under (run, shard), in layer order, or None."""
    query = (
        select(MinedLayerRow.data)
        .where(MinedLayerRow.run_id == run_id, MinedLayerRow.shard == shard)
        .order_by(MinedLayerRow.layer)
    )
    layers = list(session.scalars(query))
    return layers or None


def load_snapshot(*, session: Session, run_id: int) -> list[bytes] | None:
    """The run's snapshot (the merge of its finished shards), in layer order, or None before the first."""
    return load_layers(session=session, run_id=run_id, shard=MinedLayerRow.SNAPSHOT)


def save_snapshot(*, session: Session, run_id: int, layers: list[bytes]) -> None:
    """Replace the run's snapshot."""
    save_layers(session=session, run_id=run_id, shard=MinedLayerRow.SNAPSHOT, layers=layers)


def has_layers(*, session: Session, run_id: int) -> bool:
    """Whether anything of the run is mined and stored (a checkpoint or its snapshot)."""
    return session.scalar(select(exists().where(MinedLayerRow.run_id == run_id)))


def layer_parts(*, session: Session, run_id: int, layer: int) -> list[bytes]:
    """Every stored part of one layer of a run: its snapshot and the running shards' checkpoints."""
    query = select(MinedLayerRow.data).where(MinedLayerRow.run_id == run_id, MinedLayerRow.layer == layer)
    return list(session.scalars(query.order_by(MinedLayerRow.shard)))


def lock_run(*, session: Session, run_id: int) -> Run:
    """The run row, locked until the transaction ends: merges into its snapshot happen one at a time."""
    return session.scalars(select(Run).where(Run.id == run_id).with_for_update()).one()


def complete_shard(*, session: Session, shard: Shard, tokens_done: int) -> None:
    """The shard is merged into the snapshot: mark it done and drop its checkpoint."""
    session.execute(
        update(Shard)
        .where(Shard.run_id == shard.run_id, Shard.index == shard.index)
        .values(
            status=ShardStatus.done,
            lease_until=None,
            sentences_done=shard.stop - shard.start,
            tokens_done=tokens_done,
            updated_at=now(),
        )
    )
    session.execute(
        delete(MinedLayerRow).where(MinedLayerRow.run_id == shard.run_id, MinedLayerRow.shard == shard.index)
    )


def drop_layers(*, session: Session, run_id: int) -> None:
    """The run is stored: its mined layers are no longer needed."""
    session.execute(delete(MinedLayerRow).where(MinedLayerRow.run_id == run_id))


def shard_counts(*, session: Session, run_id: int) -> dict[str, int]:
    """How many of the run's shards are pending, running and done."""
    rows = session.execute(select(Shard.status).where(Shard.run_id == run_id)).scalars()
    counts = {status.value: 0 for status in ShardStatus}
    for status in rows:
        counts[status] += 1
    return counts


def progress(*, session: Session, run: Run) -> MiningProgress:
    """Sentences and tokens mined so far, over all shards, the share of the corpus, and since when."""
    query = select(Shard.sentences_done, Shard.tokens_done, Shard.status, Shard.started_at)
    rows = session.execute(query.where(Shard.run_id == run.id)).all()
    sentences = sum(r.sentences_done for r in rows)
    started = [r.started_at for r in rows if r.started_at is not None]
    return MiningProgress(
        mining_since=min(started) if started else None,
        sentences_done=sentences,
        tokens_done=sum(r.tokens_done for r in rows),
        shards=len(rows),
        shards_done=sum(r.status == ShardStatus.done for r in rows),
        fraction=sentences / run.n_sentences if run.n_sentences else 0.0,
    )
