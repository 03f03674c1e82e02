"""Full-vocabulary token search in the web process: each run's value matrix is read from the database
once and kept in memory (float32, ~110 MB for SmolLM2; the `search_cache_runs` newest-used runs), so a
query is one matrix–vector product over all memories plus one small read of the token's embedding row.
No torch: ffmem.engine.vocab_search does the arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from sqlalchemy.orm import Session

from ffmem.engine.vocab_search import SearchArrays, TokenHit
from ffmem.store import memory_search
from ffmem.store.cache import ProcessCache
from ffmem.store.models import Run

_MISSING = object()  # not kept: a run with no arrays is kept as None


class ArrayCache:
    """The search arrays of the last `size` runs used, loaded once each (one load at a time)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._arrays = ProcessCache(size, lru=True)  # (run id, started_at) -> SearchArrays | None
        self._loading = threading.Lock()

    def get(self, session: Session, run: Run) -> SearchArrays | None:
        """The run's arrays, or None when it has none (stored before full-vocabulary search)."""
        name = (run.id, str(run.started_at))  # a deleted run's id may come back: the start tells them apart
        with self._loading:
            arrays = self._arrays.get(name, _MISSING)
            if arrays is _MISSING:
                arrays = memory_search.load_search_arrays(session=session, run_id=run.id)
                self._arrays.put(name, arrays)
            return arrays


def cache_of(app: FastAPI) -> ArrayCache:
    """The app's cache, made on first use with the app's settings."""
    cache = getattr(app.state, "token_search", None)
    if cache is None:
        cache = app.state.token_search = ArrayCache(app.state.settings.search_cache_runs)
    return cache


@dataclass
class Ranked:
    """A token search's answer: the strongest memories each way, and what was ranked."""

    promote: list[TokenHit]
    suppress: list[TokenHit]
    memories: int  # memories ranked (every memory of every layer)
    ranks: dict[tuple[int, int, int, int], int]  # (layer, key, token, direction) → stored rank


def rank_memories(
    session: Session,
    cache: ArrayCache,
    run: Run,
    token_ids: Sequence[int],
    *,
    readout: str,
    by: str,
    limit: int,
) -> Ranked | None:
    """Every memory of every layer ranked by the tokens' logit (or probability) in its value's readout,
    both ways; None when the run has no search arrays, or not for this readout."""
    arrays = cache.get(session, run)
    if arrays is None or readout not in arrays.readouts:
        return None
    token_ids, embedding = memory_search.embedding_rows(session=session, run_id=run.id, token_ids=token_ids)
    if not token_ids:
        return None
    found = arrays.search(embedding, token_ids, readout=readout, by=by, limit=limit)
    shown = [(hit.layer, hit.key) for hits in found.values() for hit in hits]
    ranks = memory_search.stored_ranks(
        session=session, run_id=run.id, readout=readout, token_ids=token_ids, memories=shown
    )
    return Ranked(promote=found[1], suppress=found[-1], memories=arrays.n_values, ranks=ranks)
