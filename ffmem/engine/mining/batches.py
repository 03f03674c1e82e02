"""Mining batches: each batch through the model, every layer's coefficients folded into a MiningState;
the length-bucketed batches of one shard of the corpus, and of a whole corpus shard by shard."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ffmem.engine.mining.corpus import (
    Batch,
    length_bucketed_batches,
    mined_sentences,
    shard_members,
    shard_size,
)
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel


def mine_batches(
    loaded: LoadedModel,
    batches: Iterable[Batch],
    state: MiningState,
    on_batch: Callable[[Batch], None] | None = None,
) -> MiningState:
    """Run each batch through the model (no unembedding) and fold every layer's coefficients in."""
    backbone = loaded.model.base_model
    current: list[Batch] = []
    fields = ("coefficients", "inputs") if state.gated else ("coefficients",)

    def fold(layer: int, coefficients: torch.Tensor) -> None:  # coefficients: [batch, pos, keys]
        state.update(layer, coefficients, current[0], captured.inputs.get(layer))

    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, fields=fields, on_coefficients=fold) as captured,
    ):
        for batch in batches:  # counted on the host copy: reading a device tensor back would wait for it
            current[:] = [batch.to(loaded.device)]
            on_device = current[0]
            backbone(input_ids=on_device.input_ids, attention_mask=on_device.attention_mask, use_cache=False)
            state.count(batch)
            if on_batch is not None:
                on_batch(batch)
    return state


def shard_batches(
    token_ids: list[list[int]],
    first_positions: list[int],
    *,
    shard: int,
    shard_sentences: int,
    batch_tokens: int,
    pad_id: int,
    held_out_every: int = 0,
) -> list[Batch]:
    """The length-bucketed batches of shard number `shard` (corpus.shard_members of the mined sentences)."""
    members = shard_members(mined_sentences(len(token_ids), held_out_every), shard, shard_sentences)
    return list(
        length_bucketed_batches(
            [token_ids[i] for i in members],
            [first_positions[i] for i in members],
            indices=members,
            batch_tokens=batch_tokens,
            pad_id=pad_id,
        )
    )


def corpus_batches(
    token_ids: list[list[int]],
    first_positions: list[int],
    *,
    shard_sentences: int,
    memories: int,
    batch_tokens: int,
    pad_id: int,
) -> list[Batch]:
    """Every shard's batches of a whole corpus, in order, its shards sized as a run sizes them
    (corpus.shard_size: `shard_sentences`, or 0 to size them by the model's `memories`)."""
    size = shard_size(shard_sentences, memories=memories, corpus_tokens=sum(map(len, token_ids)),
                      corpus_sentences=len(token_ids))  # fmt: skip
    batches: list[Batch] = []
    for shard in range(-(-len(token_ids) // size)):
        batches += shard_batches(
            token_ids,
            first_positions,
            shard=shard,
            shard_sentences=size,
            batch_tokens=batch_tokens,
            pad_id=pad_id,
        )
    return batches
