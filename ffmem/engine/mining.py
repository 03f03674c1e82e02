"""Streaming trigger mining: per key, the top-T sentences by maximum (and minimum) coefficient.

The semantics follow the paper's code: for each sentence and key, the coefficient's maximum over
the sentence's positions and where it occurs (the argmax position; the trigger prefix is the
sentence up to and including it). Signed activations (GELU, SwiGLU) get the same treatment for
the most negative coefficient. Alongside, per key: a histogram over fixed bins, the sum (for the
mean); the share of positive coefficients comes from the histogram.

The state is bounded (T entries per key and sign, whatever the corpus size), mergeable (its
layers as ffmem.engine.mined_layer.MinedLayer: two shards mined apart and merged equal one pass) and
orderless: ties are broken by the sentence index, so the result does not depend on how sentences are
split into batches or shards (up to the last bits of float32 between batch shapes, which can flip an
exact tie between identical sentences). Which positions are mined is each batch's `mined` mask
(ffmem.engine.corpus.mined_from): the triggers and every statistic cover exactly those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ffmem.engine import mined_layer as mined
from ffmem.engine.corpus import Batch, length_bucketed_batches, mined_sentences, shard_members
from ffmem.engine.hooks import capture
from ffmem.engine.loading import LoadedModel
from ffmem.engine.mined_layer import (
    EMPTY_SAMPLE,
    N_BINS,
    SAMPLES,
    SIGNS,
    ZERO_BIN,
    MinedLayer,
    histogram_edges,
)

LOWEST_EXPONENT = 118  # float32 biased exponent of 2^-9
CODES = 512  # a float32's sign and biased exponent bits, as the number (bits >> 23) & 511


def _code_values() -> torch.Tensor:
    """One float32 per code (sign and exponent, mantissa 0): its bin is every such float's bin."""
    return (torch.arange(CODES, dtype=torch.int32) << 23).view(torch.float32)  # [CODES]


def histogram_bins(coefficients: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
    """Bin index (see histogram_edges) of each float32 coefficient, same shape, int32.

    `workspace` keeps the scratch tensors between calls: fresh multi-megabyte allocations cost
    more in page faults than the arithmetic itself.
    """
    bits = coefficients.float().contiguous().view(torch.int32)
    code, sign, positive = (
        _scratch(workspace, name, bits.shape, dtype, bits.device)
        for name, dtype in (("code", torch.int32), ("sign", torch.int32), ("positive", torch.bool))
    )
    torch.bitwise_right_shift(bits, 23, out=code)  # sign and biased exponent bits
    torch.bitwise_right_shift(code, 8, out=sign)  # −1 where the sign bit is set, else 0
    torch.gt(code, 0, out=positive)  # sign bit clear and a nonzero exponent
    octave = (
        code.bitwise_and_(255).sub_(LOWEST_EXPONENT - 1).clamp_(0, mined.OCTAVES - 1)
    )  # 0 … 20 by magnitude
    # 21 + octave (+1 when positive), or 20 − octave where negative; +0.0 lands on ZERO_BIN.
    return octave.bitwise_xor_(sign).add_(positive).add_(ZERO_BIN)


def _scratch(workspace: dict | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A reusable tensor of `shape` (grown as needed) from `workspace`, or a new one without it."""
    numel = math.prod(shape)
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.device != device:
        buffer = workspace[name] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


@dataclass
class TopK:
    """Running top-T of s·m per key, best first, as packed order keys (see _order_key)."""

    order: torch.Tensor  # [layers, keys, T] int64: s·coefficient and sentence in one sortable number
    position: torch.Tensor  # [layers, keys, T] int64; while merging, −(row + 1) marks a new entry


class MiningState:
    """Everything mined so far: per sign a TopK, and the per-key statistics."""

    def __init__(self, n_layers: int, n_keys: int, top_k: int, device: torch.device | str = "cpu"):
        self.n_layers, self.n_keys, self.top_k = n_layers, n_keys, top_k
        shape = (n_layers, n_keys, top_k)
        empty = _order_key(torch.tensor(float("-inf")), torch.tensor(-1))  # ranks below every entry
        self.top = {
            sign: TopK(
                order=torch.full(shape, int(empty), dtype=torch.long, device=device),
                position=torch.zeros(shape, dtype=torch.long, device=device),
            )
            for sign in SIGNS
        }
        self.edges = histogram_edges()
        n_bins = N_BINS
        self.histogram = torch.zeros((n_layers, n_keys, n_bins), dtype=torch.long, device=device)
        shape = (n_layers, n_keys, n_bins, SAMPLES)  # band samples (MinedLayer.sample_order)
        self.sample_order = torch.full(shape, EMPTY_SAMPLE, dtype=torch.long, device=device)
        self.sample_position = torch.zeros(shape, dtype=torch.int16, device=device)
        self.sample_coefficient = torch.zeros(shape, dtype=torch.float32, device=device)
        self.total = torch.zeros((n_layers, n_keys), dtype=torch.float64, device=device)
        self.positions = 0  # mined positions (the denominator of every share)
        self._key_offsets = torch.arange(n_keys, dtype=torch.int32, device=device) * CODES  # [keys]
        self._code_bins = histogram_bins(_code_values()).long().to(device)  # [CODES]: each code's bin
        self._workspace: dict[str, torch.Tensor] = {}
        self.sentences = 0

    # -- update ---------------------------------------------------------------------------------
    def update(self, layer: int, coefficients: torch.Tensor, batch: Batch) -> None:
        """Fold one layer's coefficients for one batch into the state.

        `coefficients` is overwritten at padded and unmined positions (the forward pass is over).
        """
        c = coefficients.float()  # [batch, pos, keys] (no copy when already float32)
        unmined = batch.unmined  # (rows, positions) of padded and unmined positions; few after bucketing
        # Statistics first, with unmined positions set to +0.0: they add nothing to the sum, and
        # their histogram bin (ZERO_BIN) is corrected by their number.
        c[unmined] = 0.0
        self.total[layer] += c.sum(dim=(0, 1)).double()
        n_bins = self.histogram.shape[-1]
        # Count each float's sign and exponent (a code, 0 … 511) per key with one bincount, then fold
        # the 512 codes into the histogram's bins: two cheap passes over the coefficients, not ten.
        codes = _scratch(self._workspace, "codes", c.shape, torch.int32, c.device)  # [batch, pos, keys]
        torch.bitwise_right_shift(c.contiguous().view(torch.int32), 23, out=codes).bitwise_and_(CODES - 1)
        codes = codes.view(-1, self.n_keys).add_(self._key_offsets)  # one bincount for every key at once
        by_code = torch.bincount(codes.view(-1), minlength=self.n_keys * CODES).view(self.n_keys, CODES)
        counts = torch.zeros((self.n_keys, n_bins), dtype=torch.long, device=c.device)
        counts.index_add_(1, self._code_bins, by_code)  # [keys, bins]
        counts[:, ZERO_BIN] -= len(unmined[0])
        self.histogram[layer] += counts
        rows = torch.arange(len(batch.sentence_index), device=c.device)  # [batch]
        # A sentence with no mined position (one token, not mined) has best ±inf: give it the empty
        # slot's order key (sentence −1), so it never ranks above an empty slot.
        sentence = batch.sentence_index.masked_fill(~batch.mined.any(dim=1), -1)  # [batch]
        for sign in SIGNS:
            # The sentence maximum of s·m; argmax only for the few (sentence, key) pairs that enter
            # the top-T, which keeps the full-width reduction a cheap amax.
            c[unmined] = float("-inf") if sign == 1 else float("inf")
            best = c.amax(dim=1) if sign == 1 else -c.amin(dim=1)  # [batch, keys]
            order = _order_key(best.T, sentence[None, :].expand(self.n_keys, -1))  # [keys, batch]
            top = self.top[sign]
            _merge_into(top, layer, order, -(rows + 1)[None, :].expand(self.n_keys, -1), self.top_k)
            key, slot = (top.position[layer] < 0).nonzero(as_tuple=True)  # [new] each: entered the top-T
            if len(key):
                row = -top.position[layer, key, slot] - 1  # [new]
                per_position = c[row, :, key]  # [new, pos]
                where = per_position.argmax(dim=1) if sign == 1 else per_position.argmin(dim=1)
                top.position[layer, key, slot] = where
            self._sample(layer, sign, c, best, batch.sentence_index, sentence)

    def _sample(
        self,
        layer: int,
        sign: int,
        c: torch.Tensor,
        best: torch.Tensor,
        index: torch.Tensor,
        sentence: torch.Tensor,
    ) -> None:
        """Fold a batch's sentence extremes into the band samples (MinedLayer.sample_order).

        `best`: [batch, keys] s·(the sentence's extreme); `index`: [batch] the sentences; `sentence`: the
        same with −1 for a sentence with no mined position. The batch's lowest order keys per key and bin
        are found with SAMPLES rounds of a scatter-min, then merged with the kept ones.
        """
        n_bins = N_BINS
        signed = best * sign  # [batch, keys]: the extreme itself
        useful = (best > 0) & torch.isfinite(best) & (sentence >= 0)[:, None]  # [batch, keys]
        bins = histogram_bins(signed).long().masked_fill_(~useful, n_bins).T  # [keys, batch]; n_bins: none
        order = (_priority(index, layer, self.n_keys) << 32) | index[None, :]  # [keys, batch]
        order = order.masked_fill(~useful.T, EMPTY_SAMPLE)  # [keys, batch]
        found = []
        for _ in range(SAMPLES):
            lowest = torch.full((self.n_keys, n_bins + 1), EMPTY_SAMPLE, dtype=torch.long, device=c.device)
            lowest.scatter_reduce_(1, bins, order, "amin")  # [keys, bins + 1]
            found.append(lowest[:, :n_bins])
            order = order.masked_fill(order == lowest.gather(1, bins), EMPTY_SAMPLE)  # [keys, batch]
        merged = torch.cat([self.sample_order[layer], torch.stack(found, dim=-1)], dim=-1)  # [keys, bins, 2S]
        kept, slot = merged.sort(dim=-1)  # [keys, bins, 2S] each
        kept, slot = kept[..., :SAMPLES], slot[..., :SAMPLES]  # [keys, bins, S]
        position = self.sample_position[layer].gather(-1, slot.clamp(max=SAMPLES - 1))  # [keys, bins, S]
        coefficient = self.sample_coefficient[layer].gather(-1, slot.clamp(max=SAMPLES - 1))
        key, band, new = ((slot >= SAMPLES) & (kept != EMPTY_SAMPLE)).nonzero(as_tuple=True)  # [new] each
        if len(key):
            ordered, rows = index.sort()  # [batch] each: the batch's sentences are in length order
            row = rows[torch.searchsorted(ordered, kept[key, band, new] & 0xFFFFFFFF)]  # [new]
            per_position = c[row, :, key]  # [new, pos]
            where = per_position.argmax(dim=1) if sign == 1 else per_position.argmin(dim=1)  # [new]
            position[key, band, new] = where.to(torch.int16)
            coefficient[key, band, new] = signed[row, key]
        self.sample_order[layer], self.sample_position[layer] = kept, position
        self.sample_coefficient[layer] = coefficient

    def count(self, batch: Batch) -> None:
        """Count a batch's positions and sentences once (after its layers were folded in)."""
        self.positions += int(batch.mined.sum())
        self.sentences += len(batch.sentence_index)

    # -- checkpoints (shards merge as MinedLayer, ffmem.engine.mined_layer) -------------------------
    def layer(self, layer: int) -> MinedLayer:
        """One layer of the state as numpy arrays: what checkpoints and snapshots store."""
        coefficient, sentence, position = {}, {}, {}
        for sign in SIGNS:
            c, s, p = self.triggers(layer, sign)  # [keys, T] each
            coefficient[sign] = c.numpy()
            sentence[sign], position[sign] = s.numpy().astype(np.int32), p.numpy().astype(np.int16)
        return MinedLayer(
            coefficient=coefficient,
            sentence=sentence,
            position=position,
            histogram=self.histogram[layer].cpu().numpy(),
            total=self.total[layer].cpu().numpy(),
            positions=self.positions,
            sentences=self.sentences,
            sample_order=self.sample_order[layer].cpu().numpy(),
            sample_position=self.sample_position[layer].cpu().numpy(),
            sample_coefficient=self.sample_coefficient[layer].cpu().numpy(),
        )

    @classmethod
    def from_layers(cls, layers: list[MinedLayer], device: torch.device | str = "cpu") -> MiningState:
        """The state whose `layer(l)` gives back `layers[l]`."""
        first = layers[0]
        state = cls(len(layers), first.histogram.shape[0], first.top_k, device=device)
        for index, layer in enumerate(layers):
            for sign in SIGNS:
                values = torch.from_numpy(sign * layer.coefficient[sign]).to(device)  # [keys, T]; −inf: empty
                sentence = torch.from_numpy(layer.sentence[sign]).to(device).long()  # [keys, T]
                state.top[sign].order[index] = _order_key(values, sentence)
                state.top[sign].position[index] = torch.from_numpy(layer.position[sign]).to(device).long()
            state.histogram[index] = torch.from_numpy(layer.histogram).to(device)
            state.total[index] = torch.from_numpy(layer.total).to(device)
            state.sample_order[index] = torch.from_numpy(layer.sample_order).to(device)
            state.sample_position[index] = torch.from_numpy(layer.sample_position).to(device)
            state.sample_coefficient[index] = torch.from_numpy(layer.sample_coefficient).to(device)
        state.positions, state.sentences = first.positions, first.sentences
        return state

    # -- results --------------------------------------------------------------------------------
    def triggers(self, layer: int, sign: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(coefficients, sentence index, position), each [keys, T]; sentence −1 marks empty slots."""
        top = self.top[sign]
        values, sentence = _unpack(top.order[layer])  # [keys, T] each
        sentence = sentence.masked_fill(torch.isinf(values), -1)  # [keys, T]
        return (sign * values).cpu(), sentence.cpu(), top.position[layer].cpu()

    def mean(self, layer: int) -> torch.Tensor:
        return (self.total[layer] / max(self.positions, 1)).cpu()  # [keys]

    def positive_share(self, layer: int) -> torch.Tensor:
        """Share of positions with m > 0, per key: [keys]."""
        return torch.from_numpy(mined.positive_share(self.histogram[layer].cpu().numpy(), self.positions))

    def density(self, layer: int) -> torch.Tensor:
        """Share of positions with |m| within 3 octaves of the key's peak (mined_layer.density): [keys]."""
        return torch.from_numpy(mined.density(self.histogram[layer].cpu().numpy(), self.positions))


def _order_key(values: torch.Tensor, sentence: torch.Tensor) -> torch.Tensor:
    """One int64 per entry whose order is: value descending, then sentence ascending, empty last.

    The high 32 bits are the float32 value's bits made order-preserving as a signed integer; the
    low 32 bits are 2³²−1 − sentence (0 for an empty slot). A single topk then gives a total order,
    and the top-T is kept as these numbers alone (plus positions).
    """
    bits = values.float().contiguous().view(torch.int32)  # [keys, n]
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # [keys, n]: int order = float order
    tie = torch.where(sentence < 0, 0, 0xFFFFFFFF - sentence)  # [keys, n]
    return (ordered << 32) | tie


def _unpack(order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of _order_key: (values float32, sentence int64 with −1 for empty)."""
    ordered = (order >> 32).int()  # [keys, n]
    values = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).view(torch.float32)  # [keys, n]
    tie = order & 0xFFFFFFFF  # [keys, n]
    return values, torch.where(tie == 0, -1, 0xFFFFFFFF - tie)


def _priority(sentence: torch.Tensor, layer: int, n_keys: int) -> torch.Tensor:
    """A pseudo-random 31-bit number per (key, sentence) of `layer`: [keys, n] int64, the same in every
    batch, shard and device, so the band samples do not depend on how the corpus was split. A
    multiply–xorshift hash in int64 arithmetic that never overflows."""
    memory = torch.arange(n_keys, device=sentence.device) + layer * n_keys  # [keys]
    x = (sentence[None, :] * 2654435761 % 2**32) ^ (memory[:, None] * 2246822519 % 2**32)  # [keys, n]
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B % 2**32
    x = x ^ (x >> 16)
    return x >> 1


def _merge_into(state: TopK, layer: int, order: torch.Tensor, position: torch.Tensor, top_k: int) -> None:
    """Keep the top-T of one layer's state ∪ candidates (order keys and positions, [keys, n])."""
    merged = torch.cat([state.order[layer], order], dim=1)  # [keys, T + n]
    kept, index = merged.topk(top_k, dim=1)  # [keys, T] each, best first
    state.order[layer] = kept
    state.position[layer] = torch.cat([state.position[layer], position], dim=1).gather(1, index)


def mine_batches(
    loaded: LoadedModel,
    batches: Iterable[Batch],
    state: MiningState,
    on_batch: Callable[[Batch], None] | None = None,
) -> MiningState:
    """Run each batch through the model (no unembedding) and fold every layer's coefficients in."""
    backbone = loaded.model.base_model
    current: list[Batch] = []

    def fold(layer: int, coefficients: torch.Tensor) -> None:
        state.update(layer, coefficients, current[0])  # coefficients: [batch, pos, keys]

    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, fields=("coefficients",), on_coefficients=fold),
    ):
        for batch in batches:
            current[:] = [batch.to(loaded.device)]
            batch = current[0]
            backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
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
