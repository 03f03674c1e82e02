"""Keyword-only reads and writes of the index database. No torch here: array inputs are numpy arrays.

Bulk writes (memory lists, key stats, sentences, vocabulary) go through `ffmem.store.bulk.bulk_insert`:
COPY on Postgres, a driver-level executemany per chunk on SQLite (about twice as fast as Core's
dict rows), always inside the session's transaction.
A memory's triggers and value tokens are stored as packed lists (ffmem.store.memory_lists, the
`memory_lists` table); the reads here decode them into `Trigger` and `ValueToken` rows. Reads across a
whole finished run (free-text search, token search) decode all its lists of one kind once per process.
Postgres text cannot hold NUL characters, so every stored text has "\\x00" replaced by "␀" (U+2400),
on every backend alike; the replacement keeps lengths, so character offsets stay valid.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from itertools import repeat

import numpy as np
from sqlalchemy import Row, case, delete, exists, func, or_, select, union_all
from sqlalchemy.orm import Session, joinedload

from ffmem.engine.token_display import byte_form
from ffmem.store import memory_lists
from ffmem.store.bulk import bulk_insert, chunks
from ffmem.store.cache import ProcessCache
from ffmem.store.memory_lists import TRIGGERS, Lists, Trigger, ValueToken
from ffmem.store.models import (
    Corpus,
    Job,
    JobKind,
    KeyStats,
    Label,
    LanguageModel,
    MemoryList,
    Run,
    Sentence,
    Token,
)

NUL_SHOWN_AS = "\u2400"


# ---- models and vocabulary ----------------------------------------------------------------------


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
        model = LanguageModel(slug=slug, created_at=_now(), **fields)
        session.add(model)
    else:
        for name, value in fields.items():
            setattr(model, name, value)
    session.flush()
    return model


def store_vocabulary(*, session: Session, model_id: int, texts: list[str], pieces: list[str]) -> None:
    """Store the model's vocabulary (token id = list index); a no-op if it is already stored."""
    if len(texts) != len(pieces):
        raise ValueError(f"{len(texts)} texts but {len(pieces)} pieces")
    if session.scalar(select(exists().where(Token.model_id == model_id))):
        return
    pairs = enumerate(zip(texts, pieces, strict=True))
    rows = ((model_id, token_id, stored_text(text), stored_text(piece)) for token_id, (text, piece) in pairs)
    bulk_insert(session, Token.__table__, ("model_id", "token_id", "text", "piece"), rows)


# ---- corpora ------------------------------------------------------------------------------------


def list_corpora(*, session: Session) -> list[Corpus]:
    """Every corpus the database holds (one per source and tokenization), the newest first."""
    return list(session.scalars(select(Corpus).order_by(Corpus.id.desc())))


def find_corpus(*, session: Session, fingerprint: str) -> Corpus | None:
    """The corpus tokenized with this fingerprint, if stored."""
    return session.scalars(select(Corpus).where(Corpus.fingerprint == fingerprint)).one_or_none()


def store_corpus(
    *,
    session: Session,
    name: str,
    source: str,
    source_sha256: str,
    fingerprint: str,
    tokenizer: str,
    max_tokens: int,
    skipped: dict,
    sentences: Iterable[tuple[str, list[int], list[tuple[int, int]], int]],
) -> Corpus:
    """Store a corpus and its sentences (text, token ids, offsets, first position), indexed 0..N-1."""
    corpus = Corpus(
        name=name,
        source=source,
        source_sha256=source_sha256,
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        max_tokens=int(max_tokens),
        n_sentences=0,
        n_tokens=0,
        skipped=dict(skipped),
        created_at=_now(),
    )
    session.add(corpus)
    session.flush()
    counts = {"sentences": 0, "tokens": 0}

    def rows() -> Iterator[tuple]:
        for index, (text, token_ids, offsets, first_position) in enumerate(sentences):
            counts["sentences"] += 1
            counts["tokens"] += len(token_ids)
            yield (
                corpus.id,
                index,
                stored_text(text),
                [int(t) for t in token_ids],
                [[int(start), int(end)] for start, end in offsets],
                int(first_position),
            )

    columns = ("corpus_id", "index", "text", "token_ids", "offsets", "first_position")
    bulk_insert(session, Sentence.__table__, columns, rows())
    corpus.n_sentences, corpus.n_tokens = counts["sentences"], counts["tokens"]
    session.flush()
    return corpus


def load_sentence_tokens(*, session: Session, corpus_id: int) -> list[list[int]]:
    """Token ids of every sentence of the corpus, by index."""
    query = select(Sentence.token_ids).where(Sentence.corpus_id == corpus_id).order_by(Sentence.index)
    return list(session.scalars(query))


def load_first_positions(*, session: Session, corpus_id: int) -> list[int]:
    """First mined position of every sentence of the corpus, by index."""
    query = select(Sentence.first_position).where(Sentence.corpus_id == corpus_id).order_by(Sentence.index)
    return list(session.scalars(query))


# ---- runs ---------------------------------------------------------------------------------------


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
    """A new run, status "running", started at `started_at` (default now, UTC)."""
    run = Run(
        model_id=model_id,
        corpus_id=corpus_id,
        status="running",
        top_k=int(top_k),
        n_value_tokens=int(n_value_tokens),
        n_sentences=int(n_sentences),
        n_tokens=0,
        dtype=dtype,
        device=device,
        package_version=package_version,
        provenance=dict(provenance),
        histogram_edges=[float(edge) for edge in histogram_edges],
        started_at=started_at or _now(),
    )
    session.add(run)
    session.flush()
    return run


def finish_run(*, session: Session, run_id: int, n_tokens: int) -> Run:
    """Mark the run done, with the number of positions mined."""
    run = _run(session, run_id)
    run.status, run.n_tokens, run.finished_at = "done", int(n_tokens), _now()
    session.flush()
    return run


def fail_run(*, session: Session, run_id: int, error: BaseException) -> Run:
    """Mark the run failed, storing the error as {type, message, traceback}."""
    run = _run(session, run_id)
    run.status, run.finished_at = "failed", _now()
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


def count_entries(*, session: Session, run_id: int, kind: str) -> int:
    """How many entries the run's lists of one kind hold: "triggers" (both signs), or a readout's value
    tokens ("raw" or "norm"; both directions)."""
    data, where = MemoryList.data, (MemoryList.run_id == run_id, MemoryList.kind == kind)
    if kind == TRIGGERS:
        size = session.scalar(select(func.sum(func.length(data))).where(*where))
        return (size or 0) // memory_lists.TRIGGER.itemsize
    width = func.substr(data, 1, 1)  # a value list's token width (memory_lists.VALUE_HEADER)
    total = 0
    for first, lists, size in session.execute(
        select(width, func.count(), func.sum(func.length(data))).where(*where).group_by(width)
    ):
        entry = memory_lists.value_entry(bytes(first)[0]).itemsize
        total += (size - lists * memory_lists.VALUE_HEADER.itemsize) // entry
    return total


def get_run(*, session: Session, run_id: int) -> Run | None:
    """The run with this id, if any (its corpus loaded with it: pages show its name)."""
    return session.get(Run, run_id, options=[joinedload(Run.corpus)])


def find_finished_run(*, session: Session, model_slug: str, n_sentences: int | None = None) -> Run | None:
    """The latest finished run of the model `model_slug` (over `n_sentences` corpus sentences when given)."""
    query = (
        select(Run)
        .join(LanguageModel, Run.model_id == LanguageModel.id)
        .join(Corpus, Run.corpus_id == Corpus.id)
        .where(LanguageModel.slug == model_slug, Run.status == "done")
        .order_by(Run.id.desc())
        .limit(1)
    )
    if n_sentences is not None:
        query = query.where(Corpus.n_sentences == n_sentences)
    return session.scalars(query).first()


# ---- per-key results ----------------------------------------------------------------------------


def store_triggers(
    *,
    session: Session,
    run_id: int,
    layer: int,
    sign: int,
    coefficients: np.ndarray,
    sentence_index: np.ndarray,
    position: np.ndarray,
) -> int:
    """Store one layer's top-T triggers of one sign ([n_keys, T] arrays, rank = column), one packed list
    per key; returns the triggers stored. Entries with sentence_index -1 (fewer sentences than T) are
    skipped; a key with none stores no list."""
    sentence_index, position, coefficients = _same_shape(
        2, sentence_index=sentence_index, position=position, coefficients=coefficients
    )
    blobs = memory_lists.encode_triggers(sentence_index, position, coefficients)
    rows = ((run_id, TRIGGERS, int(sign), int(layer), key, blob) for key, blob in enumerate(blobs) if blob)
    bulk_insert(session, MemoryList.__table__, LIST_COLUMNS, rows)
    return int((sentence_index >= 0).sum())


def store_value_tokens(
    *,
    session: Session,
    run_id: int,
    layer: int,
    readout: str,
    direction: int,
    token_ids: np.ndarray,
    logits: np.ndarray,
    log_z: np.ndarray,
) -> int:
    """Store one layer's top (+1) or bottom (-1) value tokens under one readout (token ids and logits
    [n_keys, n], and log_z [n_keys], each value's log-sum-exp over the full readout), one packed list
    per key; returns the tokens stored."""
    if readout not in memory_lists.READOUTS:
        raise ValueError(f"unknown readout {readout!r}; choose from {memory_lists.READOUTS}")
    token_ids, logits = _same_shape(2, token_ids=token_ids, logits=logits)
    log_z = np.asarray(log_z).reshape(-1)  # [n_keys]
    if log_z.shape[0] != token_ids.shape[0]:
        raise ValueError(f"log_z has {log_z.shape[0]} values for {token_ids.shape[0]} keys")
    blobs = memory_lists.encode_value_tokens(token_ids, logits, log_z)
    rows = ((run_id, readout, int(direction), int(layer), key, blob) for key, blob in enumerate(blobs))
    bulk_insert(session, MemoryList.__table__, LIST_COLUMNS, rows)
    return token_ids.size


LIST_COLUMNS = ("run_id", "kind", "sign", "layer", "key", "data")


def store_key_stats(
    *,
    session: Session,
    run_id: int,
    layer: int,
    mean: np.ndarray,
    positive_share: np.ndarray,
    max_coefficient: np.ndarray,
    min_coefficient: np.ndarray,
    value_norm: np.ndarray,
    histogram: np.ndarray,
    density: np.ndarray,
    max_prob: np.ndarray,
    agreement: np.ndarray,
    next_token_rank: np.ndarray,
) -> None:
    """Store one layer's key statistics ([n_keys]; histogram [n_keys, n_bins]).

    NaN or ±inf max/min → NULL; a next-token rank of −1 (no token after the top trigger) → NULL.
    """
    arrays = _same_shape(
        1,
        mean=mean,
        positive_share=positive_share,
        max_coefficient=max_coefficient,
        min_coefficient=min_coefficient,
        value_norm=value_norm,
        density=density,
        max_prob=max_prob,
        agreement=agreement,
        next_token_rank=next_token_rank,
    )
    mean, positive_share, max_coefficient, min_coefficient, value_norm = arrays[:5]
    density, max_prob, agreement, next_token_rank = arrays[5:]
    histogram = np.asarray(histogram)
    if histogram.ndim != 2 or histogram.shape[0] != mean.shape[0]:
        raise ValueError(f"histogram has shape {histogram.shape}; expected [{mean.shape[0]}, n_bins]")
    rows = zip(
        repeat(run_id),
        repeat(int(layer)),
        range(mean.shape[0]),
        mean.tolist(),
        positive_share.tolist(),
        map(_finite_or_none, max_coefficient.tolist()),
        map(_finite_or_none, min_coefficient.tolist()),
        value_norm.tolist(),
        histogram.tolist(),
        density.tolist(),
        max_prob.tolist(),
        agreement.astype(int).tolist(),
        [None if rank < 0 else rank for rank in next_token_rank.astype(int).tolist()],
    )
    columns = (
        "run_id",
        "layer",
        "key",
        "mean",
        "positive_share",
        "max_coefficient",
        "min_coefficient",
        "value_norm",
        "histogram",
        "density",
        "max_prob",
        "agreement",
        "next_token_rank",
    )
    bulk_insert(session, KeyStats.__table__, columns, rows)


def _list(session: Session, run_id: int, kind: str, sign: int, layer: int, key: int) -> bytes | None:
    """One memory's packed list, if stored."""
    return session.scalar(
        select(MemoryList.data).where(
            MemoryList.run_id == run_id,
            MemoryList.kind == kind,
            MemoryList.sign == sign,
            MemoryList.layer == layer,
            MemoryList.key == key,
        )
    )


def _layer_lists(session: Session, run_id: int, kind: str, sign: int, layer: int, keys=None) -> Lists:
    """The lists of one kind and sign of a layer's keys (all, or `keys`), decoded, by key then rank."""
    query = select(MemoryList.key, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind == kind,
        MemoryList.sign == sign,
        MemoryList.layer == layer,
    )
    if keys is not None:
        query = query.where(MemoryList.key.in_([int(k) for k in keys]))
    rows = session.execute(query.order_by(MemoryList.key)).all()
    return memory_lists.decode_many(kind, [layer] * len(rows), [r.key for r in rows], [r.data for r in rows])


def get_triggers(
    *, session: Session, run_id: int, layer: int, key: int, sign: int, limit: int | None = None
) -> list[Trigger]:
    """A key's triggers of one sign, strongest first (the first `limit` when given)."""
    data = _list(session, run_id, TRIGGERS, sign, layer, key)
    if data is None:
        return []
    return memory_lists.triggers_of(data, run_id=run_id, layer=layer, key=key, sign=sign, limit=limit)


def get_value_tokens(
    *, session: Session, run_id: int, layer: int, key: int, readout: str, direction: int
) -> list[ValueToken]:
    """A value's top (+1) or bottom (−1) tokens under one readout, rank order."""
    data = _list(session, run_id, readout, direction, layer, key)
    if data is None:
        return []
    where = dict(run_id=run_id, layer=layer, key=key, readout=readout, direction=direction)
    return memory_lists.value_tokens_of(data, **where)


def key_lists(
    *, session: Session, run_id: int, layer: int, key: int, kinds: Sequence[str] = memory_lists.KINDS
) -> dict[tuple[str, int], bytes]:
    """One memory's packed lists of these kinds, both signs, in one read: (kind, sign) → data."""
    query = select(MemoryList.kind, MemoryList.sign, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind.in_(kinds),
        MemoryList.sign.in_((1, -1)),  # named, so that the primary key's layer and key columns are used
        MemoryList.layer == layer,
        MemoryList.key == key,
    )
    return {(kind, sign): data for kind, sign, data in session.execute(query)}


def layer_value_tokens(
    *, session: Session, run_id: int, layer: int, readout: str, direction: int, n: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, probabilities float64), each [keys, n]: every value's stored top or bottom tokens
    of a layer (the first `n` of each, or all)."""
    found = _layer_lists(session, run_id, readout, direction, layer)
    keys = len(np.unique(found.key))
    if not keys:
        return np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float64)
    ids = found.entries["token_id"].astype(np.int64).reshape(keys, -1)  # [keys, n]
    probs = memory_lists.probabilities(found.entries["logit"], found.log_z).reshape(keys, -1)  # [keys, n]
    return ids[:, :n], probs[:, :n]


def iter_triggers(*, session: Session, run_id: int) -> Iterator[Trigger]:
    """Every trigger of the run, by layer, key, sign (−1 first) and rank; streamed."""
    query = (
        select(MemoryList.layer, MemoryList.key, MemoryList.sign, MemoryList.data)
        .where(MemoryList.run_id == run_id, MemoryList.kind == TRIGGERS)
        .order_by(MemoryList.layer, MemoryList.key, MemoryList.sign)
    )
    for layer, key, sign, data in session.execute(query.execution_options(yield_per=1000)):
        yield from memory_lists.triggers_of(data, run_id=run_id, layer=layer, key=key, sign=sign)


def iter_value_tokens(*, session: Session, run_id: int) -> Iterator[ValueToken]:
    """Every value token of the run, by layer, key, readout ("norm" first), direction (−1 first) and
    rank; streamed."""
    query = (
        select(MemoryList.layer, MemoryList.key, MemoryList.kind, MemoryList.sign, MemoryList.data)
        .where(MemoryList.run_id == run_id, MemoryList.kind.in_(memory_lists.READOUTS))
        .order_by(MemoryList.layer, MemoryList.key, MemoryList.kind, MemoryList.sign)
    )
    for layer, key, readout, sign, data in session.execute(query.execution_options(yield_per=1000)):
        where = dict(run_id=run_id, layer=layer, key=key, readout=readout, direction=sign)
        yield from memory_lists.value_tokens_of(data, **where)


# A finished run's lists never change, so reads across all of its memories (free-text search over its
# triggers, token search over its values) decode the lists of one kind and sign once per process. Keyed
# by the database, the run and its start time (an id reused by a new run is another entry); a run not yet
# done is read again each time.
RUN_LISTS_KEPT = 4  # SmolLM2's positive triggers: ~45 MB decoded
_RUN_LISTS = ProcessCache(RUN_LISTS_KEPT)  # (database, run id, started_at, kind, sign) -> Lists


def run_lists(*, session: Session, run_id: int, kind: str, sign: int) -> Lists:
    """Every list of one kind and sign of a run, decoded; triggers sorted by sentence index (stable)."""
    run = session.get(Run, run_id)
    if run is None:
        return memory_lists.decode_many(kind, [], [], [])
    cache_key = (_database(session), run_id, run.started_at, kind, sign)
    found = _RUN_LISTS.get(cache_key)
    if found is None:
        query = select(MemoryList.layer, MemoryList.key, MemoryList.data).where(
            MemoryList.run_id == run_id, MemoryList.kind == kind, MemoryList.sign == sign
        )
        rows = session.execute(query.order_by(MemoryList.layer, MemoryList.key)).all()
        found = memory_lists.decode_many(
            kind, [r.layer for r in rows], [r.key for r in rows], [r.data for r in rows]
        )
        if kind == TRIGGERS:
            found = found.take(np.argsort(found.entries["sentence_index"], kind="stable"))
        _RUN_LISTS.put(cache_key, found, final=run.status == "done")
    return found


def _database(session: Session) -> str:
    """The session's database URL: the first part of a per-process cache's keys."""
    return session.get_bind().url.render_as_string()


def get_key_stats(*, session: Session, run_id: int, layer: int, key: int) -> KeyStats | None:
    """One key's statistics, if stored."""
    return session.get(KeyStats, (run_id, layer, key))


# ---- reads for the explorer ---------------------------------------------------------------------

KEY_SORTS = (
    "key",
    "max_coefficient",
    "min_coefficient",
    "positive_share",
    "density",
    "agreement",
    "max_prob",
    "next_token_rank",
    "value_norm",
)


def list_models(*, session: Session) -> list[LanguageModel]:
    """Every indexed model, by slug, with its runs."""
    return list(session.scalars(select(LanguageModel).order_by(LanguageModel.slug)))


def get_model(*, session: Session, slug: str) -> LanguageModel | None:
    """The model with this URL name, if any."""
    query = select(LanguageModel).where(LanguageModel.slug == stored_text(slug))
    return session.scalars(query).one_or_none()


def latest_finished_run(*, session: Session, model_id: int) -> Run | None:
    """The model's newest finished run, if any (its corpus loaded with it: pages show its name)."""
    query = select(Run).where(Run.model_id == model_id, Run.status == "done").order_by(Run.id.desc())
    query = query.options(joinedload(Run.corpus))
    return session.scalars(query.limit(1)).first()


def token_texts(*, session: Session, model_id: int, token_ids: Iterable[int]) -> dict[int, str]:
    """Decoded text of each of these vocabulary ids (those the model's vocabulary holds)."""
    texts = vocabulary(session=session, model_id=model_id)
    return {t: texts[t] for t in {int(i) for i in token_ids} if t in texts}


# A model's vocabulary never changes once stored (store_vocabulary writes it once, with the model row),
# so each process reads it once: a key page looks up ~1,500 token texts. Keyed by the database, the
# model's id and its creation time (an id reused by a new model row is another entry); a vocabulary
# not yet complete (the model row's vocab_size) is read again next time.
VOCABULARIES_KEPT = 4
_VOCABULARIES = ProcessCache(VOCABULARIES_KEPT)  # (database, model id, created_at) -> token texts


def vocabulary(*, session: Session, model_id: int) -> dict[int, str]:
    """Every stored token text of a model by token id, read once per process; a byte-level token that
    is no whole character as its bytes, ⟨0x80⟩ (ffmem.engine.token_display.byte_form), not "�"."""
    model = session.get(LanguageModel, model_id)
    if model is None:
        return {}
    cache_key = (_database(session), model_id, model.created_at)
    found = _VOCABULARIES.get(cache_key)
    if found is None:
        query = select(Token.token_id, Token.text, Token.piece).where(Token.model_id == model_id)
        found = {token_id: byte_form(text, piece) for token_id, text, piece in session.execute(query)}
        _VOCABULARIES.put(cache_key, found, final=len(found) == model.vocab_size)
    return found


def find_tokens(*, session: Session, model_id: int, texts: Iterable[str]) -> list[int]:
    """Ids of the vocabulary entries whose decoded text is exactly one of `texts`."""
    query = select(Token.token_id).where(
        Token.model_id == model_id, Token.text.in_([stored_text(t) for t in texts])
    )
    return sorted(session.scalars(query))


def get_sentences(*, session: Session, corpus_id: int, indices: Iterable[int]) -> dict[int, Row]:
    """These sentences of a corpus, by index: rows with Sentence's columns (read-only; no ORM objects,
    which cost more than the query on a key page)."""
    wanted = sorted({int(i) for i in indices})
    found: dict[int, Row] = {}
    columns = [getattr(Sentence, column.key) for column in Sentence.__table__.columns]
    for chunk in chunks(wanted, 900):
        query = select(*columns).where(Sentence.corpus_id == corpus_id, Sentence.index.in_(chunk))
        found.update((sentence.index, sentence) for sentence in session.execute(query))
    return found


def layer_summaries(*, session: Session, run_id: int) -> list[Row]:
    """One row per layer: key count and aggregates of the key statistics (see results.LayerFigures)."""
    top_agrees = case((KeyStats.next_token_rank == 0, 1.0), (KeyStats.next_token_rank.is_not(None), 0.0))
    query = (
        select(
            KeyStats.layer,
            func.count().label("keys"),
            func.avg(KeyStats.positive_share).label("positive_share"),
            func.avg(KeyStats.density).label("density"),
            func.max(KeyStats.max_coefficient).label("max_coefficient"),
            func.max(KeyStats.max_prob).label("max_prob"),
            func.avg(KeyStats.max_prob).label("mean_max_prob"),
            func.avg(top_agrees).label("agreement_rate"),
            func.sum(case((KeyStats.agreement > 0, 1), else_=0)).label("agreeing_keys"),
            func.count(KeyStats.agreement).label("keys_with_agreement"),
            func.avg(KeyStats.value_norm).label("value_norm"),
        )
        .where(KeyStats.run_id == run_id)
        .group_by(KeyStats.layer)
        .order_by(KeyStats.layer)
    )
    return list(session.execute(query))


def layer_keys(
    *,
    session: Session,
    run_id: int,
    layer: int,
    sort: str,
    descending: bool,
    offset: int,
    limit: int,
    token_ids: Sequence[int] | None = None,
    readout: str = "raw",
) -> tuple[int, list[KeyStats]]:
    """(number of keys that pass the filter, one page of them) for the layer table.

    `token_ids`: keep only keys whose value has one of these among its top tokens. NULLs sort last.
    """
    if sort not in KEY_SORTS:
        raise ValueError(f"unknown sort {sort!r}; choose from {', '.join(KEY_SORTS)}")
    where = [KeyStats.run_id == run_id, KeyStats.layer == layer]
    if token_ids is not None:
        keys = promoting_keys(
            session=session, run_id=run_id, layer=layer, token_ids=token_ids, readout=readout
        )
        where.append(KeyStats.key.in_(keys))
    total = session.scalar(select(func.count()).select_from(KeyStats).where(*where))
    column = getattr(KeyStats, sort)
    ordering = [column.is_(None), column.desc() if descending else column.asc(), KeyStats.key.asc()]
    query = select(KeyStats).where(*where).order_by(*ordering).offset(offset).limit(limit)
    return total, list(session.scalars(query))


def promoting_keys(
    *, session: Session, run_id: int, layer: int, token_ids: Sequence[int], readout: str = "raw"
) -> list[int]:
    """The keys of a layer whose value has one of `token_ids` among its top tokens, ascending."""
    found = _layer_lists(session, run_id, readout, 1, layer)
    hits = np.isin(found.entries["token_id"], np.asarray(list(token_ids), np.int64))  # [entries]
    return np.unique(found.key[hits]).tolist()


def top_triggers(*, session: Session, run_id: int, layer: int, keys: Sequence[int]) -> dict[int, Trigger]:
    """Each key's strongest positive trigger."""
    found = _layer_lists(session, run_id, TRIGGERS, 1, layer, keys)
    first = found.take(np.flatnonzero(found.rank == 0))
    return {
        key: Trigger(run_id, layer, key, 1, 0, s, p, c)
        for key, (s, p, c) in zip(first.key.tolist(), first.entries.tolist(), strict=True)
    }


def top_value_tokens(
    *, session: Session, run_id: int, layer: int, keys: Sequence[int], readout: str, n: int
) -> dict[int, list[ValueToken]]:
    """Each key's first `n` top value tokens under one readout, rank order."""
    query = select(MemoryList.key, MemoryList.data).where(
        MemoryList.run_id == run_id,
        MemoryList.kind == readout,
        MemoryList.sign == 1,
        MemoryList.layer == layer,
        MemoryList.key.in_([int(k) for k in keys]),
    )
    where = dict(run_id=run_id, layer=layer, readout=readout, direction=1, limit=n)
    return {
        key: memory_lists.value_tokens_of(data, key=key, **where)
        for key, data in session.execute(query.order_by(MemoryList.key))
    }


def memory_value_tokens(
    *, session: Session, run_id: int, readout: str, memories: Iterable[tuple[int, int, int]], n: int | None
) -> dict[tuple[int, int, int], list[int]]:
    """(layer, key, direction) → the first `n` token ids (all when None) of that value's top (+1) or
    bottom (−1) list."""
    wanted = set(memories)
    if not wanted:
        return {}
    keys_by_layer: dict[int, set[int]] = {}
    for layer, key, _ in wanted:
        keys_by_layer.setdefault(layer, set()).add(key)
    # One SELECT per layer, UNION ALL-ed: each walks the primary key (run, kind, sign, layer, key).
    per_layer = [
        select(MemoryList.layer, MemoryList.key, MemoryList.sign, MemoryList.data).where(
            MemoryList.run_id == run_id,
            MemoryList.kind == readout,
            MemoryList.sign.in_([1, -1]),
            MemoryList.layer == layer,
            MemoryList.key.in_(sorted(keys)),
        )
        for layer, keys in sorted(keys_by_layer.items())
    ]
    found: dict[tuple[int, int, int], list[int]] = {}
    for layer, key, direction, data in session.execute(union_all(*per_layer)):
        if (layer, key, direction) in wanted:
            entries, _ = memory_lists.decode_value_tokens(data)
            found[layer, key, direction] = entries["token_id"][:n].tolist()
    return found


def value_matches(
    *,
    session: Session,
    run_id: int,
    token_ids: Sequence[int],
    readout: str,
    direction: int,
    by: str,
    limit: int,
) -> list[ValueToken]:
    """Values, across all layers, with one of `token_ids` among their top (+1) or bottom (−1) tokens.

    Strongest first: by probability (`by="prob"`) or logit (`"logit"`), descending for the top
    tokens and ascending for the bottom ones; ties by layer and key.
    """
    lists = run_lists(session=session, run_id=run_id, kind=readout, sign=direction)
    found = lists.take(
        np.flatnonzero(np.isin(lists.entries["token_id"], np.asarray(list(token_ids), np.int64)))
    )
    logits = found.entries["logit"].astype(np.float64)  # [found]
    score = logits - found.log_z if by == "prob" else logits  # log prob: the same order as prob
    order = np.lexsort((found.key, found.layer, -score if direction == 1 else score))[:limit]
    probs = memory_lists.probabilities(logits, found.log_z)  # [found]
    return [
        ValueToken(
            run_id,
            int(found.layer[i]),
            int(found.key[i]),
            readout,
            direction,
            int(found.rank[i]),
            int(found.entries["token_id"][i]),
            float(found.entries["logit"][i]),
            float(probs[i]),
        )
        for i in order.tolist()
    ]


def sentences_containing(*, session: Session, corpus_id: int, text: str, limit: int) -> list[Sentence]:
    """The first `limit` sentences of a corpus that contain `text`, ignoring case (LIKE wildcards escaped)."""
    text = stored_text(text)
    query = (
        select(Sentence)
        .where(
            Sentence.corpus_id == corpus_id, func.lower(Sentence.text).contains(text.lower(), autoescape=True)
        )
        .order_by(Sentence.index)
        .limit(limit)
    )
    return list(session.scalars(query))


def triggers_from(
    *, session: Session, run_id: int, first_positions: dict[int, int], limit: int
) -> list[Trigger]:
    """The strongest positive triggers whose prefix (sentence, position) reaches past `first_positions`,
    the strongest first (ties by layer and key), at most `limit`.

    `first_positions` maps a sentence index to the first position whose prefix qualifies. The run's
    positive triggers are decoded once per process and sorted by sentence (run_lists), so each sentence's
    triggers are a slice found by binary search.
    """
    lists = run_lists(session=session, run_id=run_id, kind=TRIGGERS, sign=1)
    # One contiguous copy and two searches for all the sentences: searchsorted copies a strided field
    # (10-byte entries) on every call, 2.3 M entries on the whole default index.
    sentence = np.ascontiguousarray(lists.entries["sentence_index"])  # [entries], ascending
    indices = np.fromiter(first_positions, np.int64, len(first_positions))  # [sentences]
    starts, stops = np.searchsorted(sentence, indices), np.searchsorted(sentence, indices + 1)  # [sentences]
    picked = []
    for start, stop, position in zip(starts.tolist(), stops.tolist(), first_positions.values(), strict=True):
        span = np.arange(start, stop)  # [triggers of this sentence]
        picked.append(span[lists.entries["position"][span] >= position])
    found = lists.take(np.concatenate(picked) if picked else np.zeros(0, np.int64))
    coefficient = found.entries["coefficient"]  # [found]
    order = np.lexsort((found.key, found.layer, -coefficient.astype(np.float64)))[:limit]
    return [
        Trigger(run_id, int(found.layer[i]), int(found.key[i]), 1, int(found.rank[i]), s, p, c)
        for i, (s, p, c) in zip(order.tolist(), found.entries[order].tolist(), strict=True)
    ]


def add_label(
    *, session: Session, model_id: int, layer: int, key: int, pattern: str, tag: str, author: str
) -> Label:
    """A memory's new label; its earlier ones stay as its history."""
    label = Label(
        model_id=model_id, layer=layer, key=key, pattern=pattern, tag=tag, author=author, created_at=_now()
    )
    session.add(label)
    session.flush()
    return label


def label_history(*, session: Session, model_id: int, layer: int, key: int) -> list[Label]:
    """A memory's labels, the newest (its label) first."""
    query = select(Label).where(Label.model_id == model_id, Label.layer == layer, Label.key == key)
    return list(session.scalars(query.order_by(Label.id.desc())))


def get_label(*, session: Session, label_id: int) -> Label | None:
    return session.get(Label, label_id)


def delete_label(*, session: Session, label_id: int) -> None:
    """Delete one label; when it was its memory's newest, the one before it is the label again."""
    session.execute(delete(Label).where(Label.id == label_id))


def _newest_labels(model_id: int):
    """The ids of each labelled memory's newest label."""
    return (
        select(func.max(Label.id)).where(Label.model_id == model_id).group_by(Label.layer, Label.key)
    ).scalar_subquery()


def current_labels(*, session: Session, model_id: int, layer: int, keys: Sequence[int]) -> dict[int, Label]:
    """key → its label, for the labelled ones among `keys` of `layer`."""
    query = select(Label).where(
        Label.id.in_(_newest_labels(model_id)), Label.layer == layer, Label.key.in_(list(keys))
    )
    return {label.key: label for label in session.scalars(query)}


def search_labels(*, session: Session, model_id: int, text: str, limit: int) -> list[Label]:
    """Current labels whose pattern, tag or author contains `text` (any case), by layer and key."""
    needle = stored_text(text).lower()
    matches = [
        func.lower(column).contains(needle, autoescape=True)
        for column in (Label.pattern, Label.tag, Label.author)
    ]
    query = select(Label).where(Label.id.in_(_newest_labels(model_id)), or_(*matches))
    return list(session.scalars(query.order_by(Label.layer, Label.key).limit(limit)))


LABEL_SORTS = ("key", "label", "date")


def model_labels(*, session: Session, model_id: int, sort: str = "key") -> list[Label]:
    """Every labelled memory's current label (its newest) of a model, sorted by memory ("key": layer, then
    key), by the label's text ("label": case-folded, then by memory) or by date ("date": the newest first).
    The text is sorted here, not by the database, whose collation differs between SQLite and Postgres."""
    if sort not in LABEL_SORTS:
        raise ValueError(f"unknown label sort {sort!r}; choose from {LABEL_SORTS}")
    query = select(Label).where(Label.model_id == model_id, Label.id.in_(_newest_labels(model_id)))
    labels = list(session.scalars(query.order_by(Label.layer, Label.key)))
    if sort == "label":
        labels.sort(key=lambda label: (label.pattern.casefold(), label.pattern))  # stable: then by memory
    elif sort == "date":
        labels.sort(key=lambda label: (label.created_at, label.id), reverse=True)
    return labels


def _same_shape(ndim: int, **arrays: np.ndarray) -> list[np.ndarray]:
    """The arrays as numpy arrays, checked to share one shape of `ndim` dimensions (named in the error)."""
    arrays = {name: np.asarray(array) for name, array in arrays.items()}
    shapes = {name: array.shape for name, array in arrays.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != ndim:
        raise ValueError(f"arrays must share one {ndim}-d shape, got {shapes}")
    return list(arrays.values())


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def stored_text(text: str) -> str:
    return text.replace("\x00", NUL_SHOWN_AS)


def _run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise LookupError(f"no run with id {run_id}")
    return run


def _now() -> datetime:
    return datetime.now(timezone.utc)
