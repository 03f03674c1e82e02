"""Models and runs in the database: the worker creates, finishes, fails and clears them; the CLI and the
explorer find and list them; deleting a run takes its jobs and (by cascade) its results.
"""

from __future__ import annotations

import traceback
from datetime import datetime

from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session, joinedload

from ffmem.store import memory_lists
from ffmem.store.memory_lists import TRIGGERS
from ffmem.store.models import (
    Corpus,
    Explanation,
    Job,
    JobKind,
    KeyExamples,
    KeyOrder,
    KeyStats,
    LanguageModel,
    MemoryLinks,
    MemoryList,
    Neighbours,
    Run,
    RunStatus,
    Sentence,
    SentenceTriggers,
    TokenMemoryList,
    ValueHistogram,
    now,
)
from ffmem.store.vocabularies import stored_text


def upsert_model(
    *,
    session: Session,
    slug: str,
    source: str,
    revision: str | None,
    architecture: str,
    family: str,
    n_layers: int,
    n_keys: int,
    d_model: int,
    vocab_size: int,
    activation: str,
    gated: bool,
) -> LanguageModel:
    """The model row for `slug`, created or updated to these fields."""
    fields = dict(
        source=source,
        revision=revision,
        architecture=architecture,
        family=family,
        n_layers=int(n_layers),
        n_keys=int(n_keys),
        d_model=int(d_model),
        vocab_size=int(vocab_size),
        activation=activation,
        gated=bool(gated),
    )
    model = session.scalars(select(LanguageModel).where(LanguageModel.slug == slug)).one_or_none()
    if model is None:
        model = LanguageModel(slug=slug, created_at=now(), **fields)
        session.add(model)
    else:
        for name, value in fields.items():
            setattr(model, name, value)
    session.flush()
    return model


def list_models(*, session: Session) -> list[LanguageModel]:
    """Every indexed model, by slug, with its runs."""
    return list(session.scalars(select(LanguageModel).order_by(LanguageModel.slug)))


def get_model(*, session: Session, slug: str) -> LanguageModel | None:
    """The model with this URL name, if any."""
    query = select(LanguageModel).where(LanguageModel.slug == stored_text(slug))
    return session.scalars(query).one_or_none()


def create_run(
    *,
    session: Session,
    model_id: int,
    corpus_id: int,
    top_k: int,
    n_value_tokens: int,
    n_sentences: int,
    dtype: str,
    device: str,
    package_version: str,
    provenance: dict,
    histogram_edges: list[float],
    started_at: datetime | None = None,
) -> Run:
    """A new run, running, started at `started_at` (default now, UTC)."""
    run = Run(
        model_id=model_id,
        corpus_id=corpus_id,
        status=RunStatus.running,
        top_k=int(top_k),
        n_value_tokens=int(n_value_tokens),
        n_sentences=int(n_sentences),
        n_tokens=0,
        dtype=dtype,
        device=device,
        package_version=package_version,
        provenance=dict(provenance),
        histogram_edges=[float(edge) for edge in histogram_edges],
        started_at=started_at or now(),
    )
    session.add(run)
    session.flush()
    return run


def finish_run(*, session: Session, run_id: int, n_tokens: int) -> Run:
    """Mark the run done, with the number of positions mined."""
    run = _run(session, run_id)
    run.status, run.n_tokens, run.finished_at = RunStatus.done, int(n_tokens), now()
    session.flush()
    _gather_statistics(session)
    return run


# The tables a finished run has just filled, whose row counts the explorer's query plans depend on.
RESULT_TABLES = (
    MemoryList,
    KeyStats,
    KeyOrder,
    KeyExamples,
    Neighbours,
    MemoryLinks,
    Explanation,
    Sentence,
    SentenceTriggers,
    TokenMemoryList,
    ValueHistogram,
)


def _gather_statistics(session: Session) -> None:
    """On Postgres, ANALYZE the tables a run has just filled. Its planner reads row counts from the
    statistics, which autovacuum gathers late (or never, where it is off): a layer's value-list lookup then
    scans every list of the layer — 200 ms a token search at SmolLM2's size, under 1 ms once analyzed
    (bench/scale.py). SQLite plans without them."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"ANALYZE {', '.join(table.__tablename__ for table in RESULT_TABLES)}"))


def fail_run(*, session: Session, run_id: int, error: BaseException) -> Run:
    """Mark the run failed, storing the error as {type, message, traceback}."""
    run = _run(session, run_id)
    run.status, run.finished_at = RunStatus.failed, now()
    run.error = {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
    }
    session.flush()
    return run


def delete_run(*, session: Session, run_id: int) -> None:
    """Delete a run and the jobs that built, analyze or wait to analyze it; the database cascades to
    its memory lists, key stats, shards and analyses (labels belong to the model and stay)."""
    builders = select(Job.id).where(Job.run_id == run_id, Job.kind == JobKind.index)
    waiting = Job.after_job_id.in_(builders)  # analyses waiting for this run (the cascade would take them)
    session.execute(delete(Job).where((Job.run_id == run_id) | waiting))
    session.execute(delete(Run).where(Run.id == run_id))


def get_run(*, session: Session, run_id: int) -> Run | None:
    """The run with this id, if any (its corpus loaded with it: pages show its name)."""
    return session.get(Run, run_id, options=[joinedload(Run.corpus)])


def find_finished_run(*, session: Session, model_slug: str, n_sentences: int | None = None) -> Run | None:
    """The latest finished run of the model `model_slug` (over `n_sentences` corpus sentences when given)."""
    query = (
        select(Run)
        .join(LanguageModel, Run.model_id == LanguageModel.id)
        .join(Corpus, Run.corpus_id == Corpus.id)
        .where(LanguageModel.slug == model_slug, Run.status == RunStatus.done)
        .order_by(Run.id.desc())
        .limit(1)
    )
    if n_sentences is not None:
        query = query.where(Corpus.n_sentences == n_sentences)
    return session.scalars(query).first()


def latest_finished_run(*, session: Session, model_id: int | None = None) -> Run | None:
    """The model's newest finished run (of any model when `model_id` is None), if any (its corpus loaded
    with it: pages show its name)."""
    query = select(Run).where(Run.status == RunStatus.done).order_by(Run.id.desc())
    if model_id is not None:
        query = query.where(Run.model_id == model_id)
    query = query.options(joinedload(Run.corpus))
    return session.scalars(query.limit(1)).first()


def clear_results(*, session: Session, run_id: int) -> None:
    """Delete what storing a run writes before its values' lists (its triggers, by key and by sentence, key
    statistics with their orders, and key examples), so that a finisher taken up again starts clean: one
    that died may have stored some."""
    session.execute(delete(MemoryList).where(MemoryList.run_id == run_id, MemoryList.kind == TRIGGERS))
    for table in (SentenceTriggers, KeyStats, KeyOrder, KeyExamples):
        session.execute(delete(table).where(table.run_id == run_id))


def count_entries(*, session: Session, run_id: int, kind: str) -> int:
    """How many entries the run's lists of one kind hold: "triggers" (both signs), or a readout's value
    tokens ("raw" or "norm"; both directions)."""
    data, where = MemoryList.data, (MemoryList.run_id == run_id, MemoryList.kind == kind)
    if kind == TRIGGERS:  # by header (the packed lists': their widths; the fixed ones' before 0031: even)
        header, packed = func.substr(data, 1, 2), func.length(data) % 2
        total = 0
        for first, odd, size in session.execute(
            select(header, packed, func.sum(func.length(data))).where(*where).group_by(header, packed)
        ):
            if not odd:
                total += size // memory_lists.TRIGGER.itemsize
                continue
            entry = memory_lists.entry_bytes(bytes(first)) + 4  # the padding byte is less than an entry
            total += session.scalar(
                select(func.sum((func.length(data) - 2) // entry)).where(*where, header == first, packed == 1)
            )
        return total
    width = func.substr(data, 1, 1)  # a value list's token width (memory_lists.VALUE_HEADER)
    total = 0
    for first, lists, size in session.execute(
        select(width, func.count(), func.sum(func.length(data))).where(*where).group_by(width)
    ):
        entry = bytes(first)[0] + 4  # the token id, its logit (float32)
        total += (size - lists * memory_lists.VALUE_HEADER.itemsize) // entry
    return total


def _run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"no run with id {run_id}")
    return run
