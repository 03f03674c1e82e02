"""One mined layer's results as a run stores them when it finishes: the triggers of both signs and the
key statistics, with key–value agreement (is a key's trigger followed by one of its value's top tokens?),
read from the token that follows each trigger prefix."""

from __future__ import annotations

import torch
from sqlalchemy.orm import Session

from ffmem.engine.mining.state import MiningState
from ffmem.store import memory_reads, memory_writes


def following_tokens(token_ids: list[list[int]]) -> torch.Tensor:
    """[sentences, max_len + 1]: the token after each position (−1 past a sentence's end)."""
    following = torch.full((len(token_ids), max(map(len, token_ids), default=0) + 1), -1, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        following[row, : len(ids) - 1] = torch.tensor(ids[1:], dtype=torch.long)
    return following


def next_token_ids(following: torch.Tensor, sentence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The token that follows each trigger prefix ([keys, T]; −1 at a sentence's end or an empty slot)."""
    found = following[sentence.clamp(min=0), position]  # [keys, T]
    return torch.where(sentence >= 0, found, -1)


def store_layer(
    session: Session,
    run_id: int,
    layer: int,
    state: MiningState,
    next_tokens: torch.Tensor,
    ranks: torch.Tensor,
    norms: torch.Tensor,
) -> int:
    """Store one layer's triggers (both signs) and key statistics; returns triggers stored.

    Key–value agreement: how many of a key's positive triggers are followed by one of its value's
    top raw tokens (stored when the run was prepared); and `ranks`, the raw rank of the token after
    each key's top trigger (the paper's Figs. 4–5).
    """
    top_ids, top_probs = memory_reads.layer_value_tokens(
        session=session, run_id=run_id, layer=layer, readout="raw", direction=1
    )  # [keys, n] each
    agrees = (next_tokens[:, :, None] == torch.from_numpy(top_ids)[:, None, :]).any(dim=-1)  # [keys, T]
    stored = 0
    for sign in (1, -1):
        coefficients, sentence, position = state.triggers(layer, sign)  # [keys, T] each
        stored += memory_writes.store_triggers(
            session=session,
            run_id=run_id,
            layer=layer,
            sign=sign,
            coefficients=coefficients.numpy(),
            sentence_index=sentence.numpy(),
            position=position.numpy(),
        )
    top, _, _ = state.triggers(layer, 1)
    bottom, _, _ = state.triggers(layer, -1)
    shares = (
        (state.quadrant_count[layer].double() / max(state.positions, 1)).cpu().numpy()
        if state.gated
        else None
    )
    memory_writes.store_key_stats(
        session=session,
        run_id=run_id,
        layer=layer,
        mean=state.mean(layer).numpy(),
        positive_share=state.positive_share(layer).numpy(),
        max_coefficient=top[:, 0].numpy(),
        min_coefficient=bottom[:, 0].numpy(),
        value_norm=norms.numpy(),
        histogram=state.histogram[layer].cpu().numpy(),
        density=state.density(layer).numpy(),
        max_prob=top_probs[:, 0],
        agreement=(agrees & (next_tokens >= 0)).sum(dim=-1).numpy(),
        next_token_rank=ranks.numpy(),
        quadrant_shares=shares,
    )
    return stored
