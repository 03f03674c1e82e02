"""Keyword-only reads and writes of two runs side by side: `comparisons` and `key_changes` (computed by
ffmem.worker.comparison), the comparison job, and what that job reads of each run (its top triggers and
key statistics). A pair is stored once, the lower run id as `run_a`; `pair` says whether a request's
order is the other one (the pages then negate the statistics' changes). No torch."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ffmem.store import jobs, memory_lists
from ffmem.store.bulk import bulk_insert
from ffmem.store.memory_lists import TRIGGERS
from ffmem.store.models import Comparison, Job, KeyChange, KeyStats, LanguageModel, MemoryList, Run, RunStatus
from ffmem.store.specs import ComparisonSpec

BASES = ("sentences", "texts")  # the trigger overlap compares sentence indices (one corpus) or texts
STATISTICS = ("mean", "positive_share", "max_coefficient", "min_coefficient", "density")  # of KeyStats
COSINES = ("key_cosine", "gate_cosine", "up_cosine", "value_cosine")
COLUMNS = ("overlap", "negative_overlap", *COSINES, "moved", *(f"d_{name}" for name in STATISTICS))


# How the key list can be sorted, each the biggest change first (what the page says of each:
# ffmem.web.pages.compare.SORT_NAMES); each is stored as a rank per row (KeyChange.rank_<sort>).
SORTS = (
    "change", "overlap", "key", "value", "mean", "positive_share", "max_coefficient", "min_coefficient",
    "density",
)  # fmt: skip


def sort_ranks(changes: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each sort's rank of every memory (0 first), from COLUMNS' [layers, keys] arrays: "change" by moved
    (desc) then overlap (asc); "overlap" by overlap (asc) then moved (desc); "key", "value" by their cosine
    (asc); a statistic by its |change| (desc). Missing figures (NaN) last; ties by layer, then key."""
    n_layers, n_keys = changes["moved"].shape
    layer, key = np.divmod(np.arange(n_layers * n_keys), n_keys)

    def last(values: np.ndarray) -> np.ndarray:
        return np.where(np.isnan(values), np.inf, values).ravel()

    moved, shared = -changes["moved"].ravel(), last(changes["overlap"])
    criteria = {  # the first criterion decides, the next break ties
        "change": (moved, shared),
        "overlap": (shared, moved),
        "key": (last(changes["key_cosine"]),),
        "value": (last(changes["value_cosine"]),),
        **{name: (last(-np.abs(changes[f"d_{name}"])),) for name in STATISTICS},
    }
    ranks = {}
    for name, keys in criteria.items():
        order = np.lexsort((key, layer, *reversed(keys)))  # lexsort: its last key is the primary one
        rank = np.empty(order.size, dtype=np.int64)
        rank[order] = np.arange(order.size)
        ranks[name] = rank.reshape(n_layers, n_keys)
    return ranks


def pair(run_a: int, run_b: int) -> tuple[int, int, bool]:
    """(lower id, higher id, whether the request's order is reversed from the stored one)."""
    return min(run_a, run_b), max(run_a, run_b), run_a > run_b


def shape(model: LanguageModel) -> tuple[int, int, int, bool]:
    """What two models must share to be compared memory by memory: layers, keys, hidden size, gating."""
    return model.n_layers, model.n_keys, model.d_model, model.gated


def why_not_comparable(a: Run, b: Run) -> str | None:
    """Why runs `a` and `b` cannot be compared (a sentence), or None when they can."""
    if a.id == b.id:
        return f"Run {a.id} is compared with itself; pick another run."
    for run in (a, b):
        if run.status != RunStatus.done:
            return f"Run {run.id} is {run.status}; only finished runs can be compared."
    if shape(a.model) != shape(b.model):
        described = [
            f"run {run.id} ({run.model.slug}): {run.model.n_layers} layers × {run.model.n_keys} keys, "
            f"hidden size {run.model.d_model}, {'gated' if run.model.gated else 'plain'} FF"
            for run in (a, b)
        ]
        return f"The runs' models differ in shape: {'; '.join(described)}."
    return None


def comparable_runs(*, session: Session, run: Run, limit: int = 200) -> list[Run]:
    """Finished runs other than `run` whose models have its model's shape, newest first."""
    n_layers, n_keys, d_model, gated = shape(run.model)
    query = (
        select(Run)
        .join(LanguageModel, Run.model_id == LanguageModel.id)
        .where(
            Run.status == RunStatus.done,
            Run.id != run.id,
            LanguageModel.n_layers == n_layers,
            LanguageModel.n_keys == n_keys,
            LanguageModel.d_model == d_model,
            LanguageModel.gated == gated,
        )
        .order_by(Run.id.desc())
        .limit(limit)
    )
    return list(session.scalars(query))


def basis(a: Run, b: Run) -> str:
    """What the trigger overlap compares: sentence indices in one corpus, else trigger texts."""
    return "sentences" if a.corpus_id == b.corpus_id else "texts"


# ---- the job ------------------------------------------------------------------------------------


def job_spec(run_a: int, run_b: int) -> ComparisonSpec:
    """What the comparison job of runs `run_a` and `run_b` (either order) compares."""
    low, high, _ = pair(run_a, run_b)
    return ComparisonSpec(runs=[low, high])


def enqueue_comparison(*, session: Session, run_a: int, run_b: int, again: bool = False):
    """The comparison job of runs `run_a` and `run_b` (either order) and what happened (jobs.Enqueued)."""
    spec = job_spec(run_a, run_b)
    return jobs.enqueue(session=session, spec=spec, again=again, run_id=spec.runs[0])


def comparison_job(*, session: Session, run_a: int, run_b: int) -> Job | None:
    """The newest comparison job of this pair of runs, if any."""
    spec = job_spec(run_a, run_b)
    key = jobs.job_fingerprint(spec, run_id=spec.runs[0])
    return session.scalars(select(Job).where(Job.fingerprint == key).order_by(Job.id.desc()).limit(1)).first()


def top_triggers(*, session: Session, run_id: int, layer: int, top_t: int) -> list[tuple[int, int, int, int]]:
    """(key, sign, sentence index, position) of the layer's top `top_t` triggers per key and sign."""
    query = select(MemoryList.key, MemoryList.sign, MemoryList.data).where(
        MemoryList.run_id == run_id, MemoryList.kind == TRIGGERS, MemoryList.layer == layer
    )
    return [
        (key, sign, int(s), int(p))
        for key, sign, data in session.execute(query)
        for s, p, _ in memory_lists.decode_triggers(data)[:top_t].tolist()
    ]


def key_statistics(*, session: Session, run_id: int, n_layers: int, n_keys: int) -> dict[str, np.ndarray]:
    """Each of STATISTICS for every key of the run: [layers, keys] float64, NaN where none is stored."""
    found = {name: np.full((n_layers, n_keys), np.nan) for name in STATISTICS}
    columns = [getattr(KeyStats, name) for name in STATISTICS]
    query = select(KeyStats.layer, KeyStats.key, *columns).where(KeyStats.run_id == run_id)
    for layer, key, *values in session.execute(query):
        for name, value in zip(STATISTICS, values, strict=True):
            if value is not None:
                found[name][layer, key] = value
    return found


# ---- the result ---------------------------------------------------------------------------------


def store_comparison(
    *,
    session: Session,
    run_a: int,
    run_b: int,
    basis: str,
    top_t: int,
    layers: list[dict],
    details: dict,
    seconds: float,
    changes: dict[str, np.ndarray],
) -> int:
    """Store a comparison (replacing the pair's) with its per-key `changes`: each of COLUMNS as a
    [layers, keys] array (NaN: none), b against a with `run_a` < `run_b`. Returns its id."""
    if not run_a < run_b:
        raise ValueError(f"a pair is stored with the lower run id first, got {run_a}, {run_b}")
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    arrays = [np.asarray(changes[name], dtype=np.float64) for name in COLUMNS]
    ranks = sort_ranks(changes)
    session.execute(delete(Comparison).where(Comparison.run_a == run_a, Comparison.run_b == run_b))
    stored = Comparison(
        run_a=run_a,
        run_b=run_b,
        basis=basis,
        top_t=top_t,
        layers=layers,
        details=details,
        seconds=seconds,
        created_at=datetime.now(timezone.utc),
    )
    session.add(stored)
    session.flush()
    n_layers, n_keys = arrays[0].shape
    rows = (
        (
            stored.id,
            layer,
            key,
            *(_number(array[layer, key]) for array in arrays),
            *(int(ranks[name][layer, key]) for name in SORTS),
        )
        for layer in range(n_layers)
        for key in range(n_keys)
    )
    columns = ("comparison_id", "layer", "key", *COLUMNS, *(f"rank_{name}" for name in SORTS))
    bulk_insert(session, KeyChange.__table__, columns, rows)
    return stored.id


def _number(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def get_comparison(*, session: Session, run_a: int, run_b: int) -> Comparison | None:
    """The stored comparison of two runs (either order), if any."""
    low, high, _ = pair(run_a, run_b)
    query = select(Comparison).where(Comparison.run_a == low, Comparison.run_b == high)
    return session.scalars(query).first()


def key_changes(
    *, session: Session, comparison_id: int, sort: str, limit: int, layer: int | None = None
) -> list[KeyChange]:
    """The memories that changed most by `sort` (one of SORTS), optionally in one layer."""
    query = select(KeyChange).where(KeyChange.comparison_id == comparison_id)
    if layer is not None:
        query = query.where(KeyChange.layer == layer)
    return list(session.scalars(query.order_by(getattr(KeyChange, f"rank_{sort}")).limit(limit)))
