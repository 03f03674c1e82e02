"""Full-vocabulary token search from a run's token → memories table (ffmem.engine.values.token_memories,
computed at index time over every memory's whole readout): a query reads its tokens' rows (a few kilobytes
each), merges their lists, and reads the shown memories' value lists for each token's rank there and the
value's log Z. Nothing is kept in memory between queries, whatever the number of runs and memories; no torch.

The table keeps `depth` memories a token each way. A search for more asks the live worker, which holds the
values, for the rest (ffmem.engine.live.token_search: one product of the tokens' output-embedding rows with
every value); the stored pairs come first, then the worker's that are not among them. Without a worker (or
when it fails or is slow) the search shows the stored ones and says why (`Depth`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from ffmem.engine.live.protocol import MAX_SEARCH_TOKENS, TokenMemoriesRequest
from ffmem.store import memory_reads, memory_search
from ffmem.store.memory_lists import TOKEN_LISTS
from ffmem.store.models import LanguageModel, Run
from ffmem.web.errors import AppError
from ffmem.web.worker_client import LiveWorker


@dataclass(frozen=True)
class TokenHit:
    """One memory's score for one searched token."""

    layer: int
    key: int
    token_id: int
    logit: float
    prob: float
    rank: int | None  # the token's rank among the value's stored top / bottom tokens; None: not there


class Depth(BaseModel):
    """How deep a token search's lists go (full coverage): the run's token → memories table stores `stored`
    memories per token each way; past them, the live worker's (`source` "live") or none ("stored")."""

    stored: int = Field(0, description="Memories the run stores per token, each way.")
    source: Literal["stored", "live"] = Field(
        "stored",
        description="live: the lists go to the limit, the pairs past the stored ones from the live worker "
        "(one product of the tokens' output embedding with every value); stored: the stored ones only.",
    )
    reason: str | None = Field(
        None,
        description="Why only the stored ones are shown though the limit asks for more (no live worker, "
        "it failed or was slow); null when they were all there is to show or the worker answered.",
    )


@dataclass
class Ranked:
    """A token search's answer: the strongest memories each way, and what was ranked."""

    promote: list[TokenHit]
    suppress: list[TokenHit]
    memories: int  # memories ranked (every memory of every layer)
    depth: Depth


def rank_memories(
    session: Session,
    model: LanguageModel,
    run: Run,
    token_ids: Sequence[int],
    *,
    readout: str,
    by: str,
    limit: int,
    live: LiveWorker | None = None,
    timeout: float | None = None,
) -> Ranked | None:
    """The (memory, token) pairs, over every memory of every layer and the tokens `token_ids`, whose value
    promotes (the highest score) or suppresses (the lowest) the token most, the score being the token's
    logit in the value's readout (`by="logit"`) or its log-probability (`"prob"`); at most `limit` each way,
    equal scores by memory, then token: the table's depth from the table, the rest from `live` (waiting
    `timeout` seconds), or none past the depth without it. None when the run has no table for `readout`
    (stored before revision 0018)."""
    lists = memory_search.token_memories(session=session, run_id=run.id, readout=readout, token_ids=token_ids)
    if not lists and not memory_search.has_token_memories(session=session, run_id=run.id, readout=readout):
        return None
    stored = next(iter(lists.values())).shape[1] if lists else 0
    chosen = {}
    for direction in (1, -1):
        entries = lists_of(lists, by, direction)
        # Exact to the depth: a pair among the best `depth` of all is among the best `depth` of its token.
        chosen[direction] = sorted(entries, key=lambda e: (-direction * e[2], e[0], e[1]))[
            : min(limit, stored)
        ]
    depth = Depth(stored=stored)
    pairs = model.n_layers * model.n_keys * len(lists)
    if lists and limit > stored and pairs > stored:  # asked for more than the table holds, and there are more
        asked = dict(readout=readout, by=by, limit=limit, live=live, timeout=timeout)
        depth = deeper(chosen, model, sorted(lists), stored, **asked)
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


def deeper(
    chosen: dict[int, list[tuple[int, int, float]]],
    model: LanguageModel,
    token_ids: list[int],
    stored: int,
    *,
    readout: str,
    by: str,
    limit: int,
    live: LiveWorker | None,
    timeout: float | None,
) -> Depth:
    """Extend `chosen` (direction → the `stored` best (memory, token id, score) of the table) to `limit` each
    way with the live worker's pairs that are not among them, in the worker's order; the depth that came of
    it."""
    if live is None:
        return Depth(stored=stored, reason="No live worker is configured.")
    if len(token_ids) > MAX_SEARCH_TOKENS:
        many = f"The query means {len(token_ids)} tokens; the live worker ranks at most {MAX_SEARCH_TOKENS}"
        return Depth(stored=stored, reason=f"{many} at once.")
    request = TokenMemoriesRequest(
        model=model.source, token_ids=token_ids, readout=readout, by=by, limit=limit
    )
    try:
        answer = live.token_memories(request, timeout)
    except AppError as error:
        if error.status != 504:
            return Depth(stored=stored, reason=error.message)
        waited = f" ({timeout:g} s, search_worker_timeout)" if timeout else ""
        return Depth(stored=stored, reason=f"The live worker did not answer in time{waited}.")
    if answer.memories != (memories := model.n_layers * model.n_keys):
        return Depth(
            stored, reason=f"The live worker's model has {answer.memories} memories, not {memories}."
        )
    for direction, found in ((1, answer.promote), (-1, answer.suppress)):
        have = {(memory, token_id) for memory, token_id, _ in chosen[direction]}
        for pair in found:
            if len(chosen[direction]) >= limit:
                break
            memory = pair.layer * model.n_keys + pair.key
            if (memory, pair.token_id) not in have:
                chosen[direction].append((memory, pair.token_id, pair.score))
    return Depth(stored=stored, source="live")


def lists_of(lists: dict, by: str, direction: int) -> list[tuple[int, int, float]]:
    """(memory, token id, score) of every token's list of (`by`, `direction`), empty slots left out."""
    index = TOKEN_LISTS.index((by, direction))
    return [
        (memory, token_id, score)
        for token_id, token_lists in lists.items()
        for memory, score in token_lists[index].tolist()
        if memory >= 0
    ]
