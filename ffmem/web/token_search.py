"""Full-vocabulary token search from a run's token → memories table (ffmem.engine.values.token_memories,
computed at index time over every memory's whole readout): a query reads its tokens' rows (a few kilobytes
each), merges their lists, and reads the shown memories' value lists for each token's rank there and the
value's log Z. Nothing is kept in memory between queries, whatever the number of runs and memories; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from ffmem.store import memory_reads, memory_search
from ffmem.store.memory_lists import TOKEN_LISTS
from ffmem.store.models import LanguageModel, Run


@dataclass(frozen=True)
class TokenHit:
    """One memory's score for one searched token."""

    layer: int
    key: int
    token_id: int
    logit: float
    prob: float
    rank: int | None  # the token's rank among the value's stored top / bottom tokens; None: not there


@dataclass
class Ranked:
    """A token search's answer: the strongest memories each way, and what was ranked."""

    promote: list[TokenHit]
    suppress: list[TokenHit]
    memories: int  # memories ranked (every memory of every layer)
    depth: int  # each token's memories stored per list: the most a search can show each way


def rank_memories(
    session: Session,
    model: LanguageModel,
    run: Run,
    token_ids: Sequence[int],
    *,
    readout: str,
    by: str,
    limit: int,
) -> Ranked | None:
    """The (memory, token) pairs, over every memory of every layer and the tokens `token_ids`, whose value
    promotes (the highest score) or suppresses (the lowest) the token most, the score being the token's
    logit in the value's readout (`by="logit"`) or its log-probability (`"prob"`); at most `limit` and
    the table's depth each way, equal scores by memory, then token. None when the run has no table for
    `readout` (stored before revision 0018)."""
    lists = memory_search.token_memories(session=session, run_id=run.id, readout=readout, token_ids=token_ids)
    if not lists and not memory_search.has_token_memories(session=session, run_id=run.id, readout=readout):
        return None
    depth = next(iter(lists.values())).shape[1] if lists else 0
    chosen = {}
    for direction in (1, -1):
        entries = lists_of(lists, by, direction)
        # Exact to the depth: a pair among the best `depth` of all is among the best `depth` of its token.
        chosen[direction] = sorted(entries, key=lambda e: (-direction * e[2], e[0], e[1]))[
            : min(limit, depth)
        ]
    shown = {(m // model.n_keys, m % model.n_keys, d) for d, found in chosen.items() for m, _, _ in found}
    values = memory_reads.memory_value_lists(session=session, run_id=run.id, readout=readout, memories=shown)
    hits = {}
    for direction, found in chosen.items():
        hits[direction] = []
        for memory, token_id, score in found:
            layer, key = divmod(memory, model.n_keys)
            value_tokens, log_z = values.get((layer, key, direction), (None, math.nan))
            listed = [] if value_tokens is None else value_tokens["token_id"].tolist()
            rank = listed.index(token_id) if token_id in listed else None
            logit = score if by == "logit" else score + log_z
            hits[direction].append(TokenHit(layer, key, token_id, logit, math.exp(logit - log_z), rank))
    return Ranked(hits[1], hits[-1], model.n_layers * model.n_keys, depth)


def lists_of(lists: dict, by: str, direction: int) -> list[tuple[int, int, float]]:
    """(memory, token id, score) of every token's list of (`by`, `direction`), empty slots left out."""
    index = TOKEN_LISTS.index((by, direction))
    return [
        (memory, token_id, score)
        for token_id, token_lists in lists.items()
        for memory, score in token_lists[index].tolist()
        if memory >= 0
    ]
