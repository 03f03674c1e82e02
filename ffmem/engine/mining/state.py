"""Streaming trigger mining: per key, the top-T sentences by maximum (and minimum) coefficient.

The semantics follow the paper's code: for each sentence and key, the coefficient's maximum over
the sentence's positions and where it occurs (the argmax position; the trigger prefix is the
sentence up to and including it). Signed activations (GELU, SwiGLU) get the same treatment for
the most negative coefficient. Alongside, per key: a histogram over fixed bins, the sum (for the
mean); the share of positive coefficients comes from the histogram.

The state is bounded (T entries per key and sign, whatever the corpus size), mergeable (its
layers as ffmem.engine.mining.mined_layer.MinedLayer: two shards mined apart and merged equal one pass) and
orderless: ties are broken by the sentence index, so the result does not depend on how sentences are
split into batches or shards (up to the last bits of float32 between batch shapes, which can flip an
exact tie between identical sentences). Which positions are mined is each batch's `mined` mask
(ffmem.engine.mining.corpus.mined_from): the triggers and every statistic cover exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from ffmem.engine.mining import fold_cpu
from ffmem.engine.mining import mined_layer as mined
from ffmem.engine.mining.bins import CODE_STRIDE, CODES, FOLD_BYTES, code_values, histogram_bins, scratch
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.mined_layer import (
    EMPTY_SAMPLE,
    N_BINS,
    QUADRANT_EXAMPLES,
    QUADRANT_SIGNS,
    QUADRANTS,
    SAMPLES,
    SIGNS,
    ZERO_BIN,
    MinedLayer,
    histogram_edges,
)
from ffmem.engine.mining.order import first_of_stable_sort, order_key, sample_priority, unpack


@dataclass
class TopK:
    """Running top-T of s·m per key, best first, as packed order keys (see order_key)."""

    order: torch.Tensor  # [layers, keys, T] int64: s·coefficient and sentence in one sortable number
    position: torch.Tensor  # [layers, keys, T] int64: where in the sentence s·m is highest


class MiningState:
    """Everything mined so far: per sign a TopK, and the per-key statistics."""

    def __init__(
        self, n_layers: int, n_keys: int, top_k: int, device: torch.device | str = "cpu", gated: bool = False
    ):
        self.n_layers, self.n_keys, self.top_k, self.gated = n_layers, n_keys, top_k, gated
        shape = (n_layers, n_keys, top_k)
        empty = order_key(torch.tensor(float("-inf")), torch.tensor(-1))  # ranks below every entry
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
        # Gated FFs: per quadrant the positions mined in it, and its top sentences by |m| (order keys of
        # |m|, as the triggers'), where in the sentence, and the input x·u there ([layers, keys, 4] and
        # [layers, keys, 4, E]; empty where not gated).
        quadrants = (n_layers, n_keys, len(QUADRANTS), QUADRANT_EXAMPLES) if gated else (0, 0, 0, 0)
        self.quadrant_count = torch.zeros(quadrants[:3], dtype=torch.long, device=device)
        self.quadrant_order = torch.full(quadrants, int(empty), dtype=torch.long, device=device)
        self.quadrant_position = torch.zeros(quadrants, dtype=torch.long, device=device)
        self.quadrant_input = torch.zeros(quadrants, dtype=torch.float32, device=device)
        self.positions = 0  # mined positions (the denominator of every share)
        # A key's codes in the bincount (see _histogram): (bits >> 23) + CODES / 2 + key · CODE_STRIDE.
        offsets = torch.arange(n_keys, dtype=torch.int32, device=device) * CODE_STRIDE + CODES // 2  # [keys]
        self._key_offsets = offsets
        # (bits >> 23) + 256 is 256 + exponent for a positive float, the exponent for a negative one.
        code_bins = histogram_bins(code_values())  # [CODES] int32: each (sign, exponent) code's bin
        self._code_bins_by_code = code_bins.numpy()  # the compiled fold's table
        shifted = torch.arange(CODES) ^ (CODES // 2)  # [CODES]: each shifted code's (sign, exponent) code
        self._code_bins = code_bins[shifted].long().to(device)  # [CODES]: its bin
        self._workspace: dict[str, torch.Tensor] = {}
        self._pending: list[int] = []  # layers of `_pending_batch` copied into `_buffer`, not yet folded
        self._pending_batch: Batch | None = None
        self._buffer: torch.Tensor | None = None  # [group, batch, pos, keys] float32
        self._input_buffer: torch.Tensor | None = None  # [group, batch, pos, keys] float32 (gated)
        self._group = 1
        self.sentences = 0

    # -- update ---------------------------------------------------------------------------------
    def update(
        self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs: torch.Tensor | None = None
    ) -> None:
        """Fold one layer's coefficients for one batch into the state (and, for a gated state, the
        inputs x·u of the same positions, [batch, pos, keys]).

        On a CPU, one compiled pass (ffmem.engine.mining.fold_cpu); elsewhere the vectorised torch fold
        (`fold_tensors`), which gives the same state, of consecutive layers together (`_gather`: the
        last layer, or a full group, folds them). `coefficients` may be overwritten.
        """
        if self.gated and inputs is None:
            raise ValueError("a gated mining state needs each layer's inputs x·u beside its coefficients")
        if coefficients.device.type != "cpu":
            self._gather(layer, coefficients, batch, inputs)
            return
        c = coefficients.float().contiguous()  # [batch, pos, keys] (no copy when already float32)
        u = inputs.float().contiguous() if self.gated else _NO_INPUTS  # [batch, pos, keys]
        quadrants = (
            (self.quadrant_count[layer], self.quadrant_order[layer], self.quadrant_position[layer])
            + (self.quadrant_input[layer],)
            if self.gated
            else _NO_QUADRANTS
        )
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(threads)
        arrays = (
            self.histogram, self.total, self.top[1].order, self.top[1].position, self.top[-1].order,
            self.top[-1].position, self.sample_order, self.sample_position, self.sample_coefficient,
        )  # fmt: skip
        fold_cpu.fold(
            c.numpy(),
            batch.mined.numpy(),
            batch.sentence_index.numpy(),
            layer * self.n_keys,
            self._code_bins_by_code,
            *(array[layer].numpy() for array in arrays),
            u.numpy(),
            self.gated,
            *(array.numpy() for array in quadrants),
            threads,
        )

    def _gather(
        self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs: torch.Tensor | None
    ) -> None:
        """Copy one layer's coefficients (and inputs, gated) into the group of the batch's consecutive
        layers (float32, in the workspace), folding the group when it is full or holds the last layer."""
        pending = self._pending
        if pending and (pending[-1] != layer - 1 or self._pending_batch is not batch):
            self._fold_pending()
        if not pending:
            per_layer = coefficients.numel() * 4 * (2 if self.gated else 1)
            self._group = max(1, min(self.n_layers - layer, FOLD_BYTES // max(per_layer, 1)))
            shape = (self._group, *coefficients.shape)  # [group, batch, pos, keys]
            self._buffer = scratch(self._workspace, "group", shape, torch.float32, coefficients.device)
            if self.gated:
                self._input_buffer = scratch(self._workspace, "inputs", shape, torch.float32, inputs.device)
            self._pending_batch = batch
        self._buffer[len(pending)].copy_(coefficients)  # [batch, pos, keys], as float32
        if self.gated:
            self._input_buffer[len(pending)].copy_(inputs)  # [batch, pos, keys], as float32
        pending.append(layer)
        if len(pending) == self._group or layer == self.n_layers - 1:
            self._fold_pending()

    def _fold_pending(self) -> None:
        layers, n = slice(self._pending[0], self._pending[-1] + 1), len(self._pending)
        inputs = self._input_buffer[:n] if self.gated else None
        self.fold_tensors(layers, self._buffer[:n], self._pending_batch, inputs)
        self._pending.clear()
        self._pending_batch = self._buffer = self._input_buffer = None

    def fold_tensors(
        self, layers: int | slice, c: torch.Tensor, batch: Batch, inputs: torch.Tensor | None = None
    ) -> None:
        """`update` in torch operations on any device, for one layer (`c` [batch, pos, keys]) or
        consecutive ones (a slice, `c` [layers, batch, pos, keys]); `c`, float32, is overwritten. A gated
        state takes the `inputs` x·u of the same shape (read, not overwritten).

        Every operation has a shape fixed by (layers, batch, pos, keys, T, bins, SAMPLES): no `nonzero`,
        no boolean indexing, no value read back to the host. On a GPU a batch's folds of every layer are
        then enqueued without waiting for one to finish. Passes over the whole [layers, batch, pos,
        keys] tensor: the fill of unmined positions, the maximum and the minimum with their positions,
        the zeroing, the sum, the codes and their count; the top-T and the band samples then work on
        [signs, layers, batch, keys], both signs at once.
        """
        if isinstance(layers, int):
            layers, c = slice(layers, layers + 1), c[None]
            inputs = None if inputs is None else inputs[None]
        n_layers, n_keys = c.shape[0], self.n_keys
        mined = batch.mined[None, :, :, None]  # [1, batch, pos, 1]
        if self.gated:
            self._fold_quadrants(layers, c, inputs, batch)
        anchor, has_mined = batch.anchor  # [batch] each: the first mined position, whether there is one
        # Unmined positions first hold their row's first mined coefficient, which changes neither its
        # maximum nor its minimum. Where an extreme's first occurrence is such a copy, its first mined
        # occurrence is the anchor: the anchor holds that value and no mined position comes before it.
        at_anchor = anchor[None, :, None, None].expand(n_layers, -1, 1, n_keys)  # [layers, batch, 1, keys]
        first = c.gather(2, at_anchor)  # [layers, batch, 1, keys]
        torch.where(mined, c, first, out=c)
        (high, high_at), (low, low_at) = c.max(dim=2), c.min(dim=2)  # [layers, batch, keys] each
        # [signs, layers, batch, keys] each: the maximum (+1) and the minimum (−1), where each first is
        # (torch.max's rule), whether that is a mined position, and so its first mined occurrence
        extreme, at = torch.stack([high, low]), torch.stack([high_at, low_at])
        at_mined = batch.mined.expand(len(SIGNS), n_layers, -1, -1).gather(3, at)
        at = torch.where(at_mined, at, anchor[:, None])
        # best: s·extreme. A sentence with no mined position has best −inf; its sentence −1 then gives
        # it the empty slot's order key (and position 0: its anchor), so it never ranks above an empty slot.
        best = torch.stack([high, low.neg()]).masked_fill_(~has_mined[:, None], float("-inf"))
        sentence = batch.sentence_index.masked_fill(~has_mined, -1)  # [batch]
        # Statistics with unmined positions set to +0.0: they add nothing to the sum, and their
        # histogram bin (ZERO_BIN) is corrected by their number, counted on the device.
        c.masked_fill_(~mined, 0.0)
        self.total[layers] += c.sum(dim=(1, 2), dtype=torch.float64)  # [layers, keys]
        self.histogram[layers] += self._histogram(c, batch.mined.numel() - batch.mined.sum())
        self._enter_top(layers, best, at, sentence)
        priority = sample_priority(batch.sentence_index, layers, n_keys)  # [layers, keys, batch]
        self._sample(layers, extreme, best, at, priority << 32 | batch.sentence_index)

    def _fold_quadrants(self, layers: slice, c: torch.Tensor, u: torch.Tensor, batch: Batch) -> None:
        """Fold a batch's sign quadrants (before `c` [layers, batch, pos, keys] is overwritten; `u` the
        inputs x·u, like `c`): the positions in each, and per sentence its largest |m| in each quadrant (a
        NaN coefficient ranks nowhere), first where it is, entered into the quadrant's top examples.

        Three counts give the four: the mined positions with a negative gate, a negative input, and both.
        The largest |m| of the four quadrants take four maxima, one per input sign and sign of m: where the
        input is ≥ 0, m ≥ 0 is pp and m < 0 np; where it is < 0, m > 0 is nn and m ≤ 0 pn."""
        mined = batch.mined[None, :, :, None]  # [1, batch, pos, 1]
        input_negative = u < 0  # [layers, batch, pos, keys]
        gate_negative = torch.where(input_negative, c > 0, (c < 0) & (u > 0))  # the gate's sign: m / u
        gate = (gate_negative & mined).sum(dim=(1, 2))  # [layers, keys]
        both = (gate_negative.logical_and_(input_negative) & mined).sum(dim=(1, 2))  # [layers, keys]
        inputs = (input_negative & mined).sum(dim=(1, 2))  # [layers, keys]
        positions = batch.mined.sum()  # 0-dim: the mined positions of the batch
        counts = (positions - gate - inputs + both, inputs - both, gate - both, both)  # the four quadrants'
        self.quadrant_count[layers] += torch.stack(counts, dim=-1)  # [layers, keys, 4]
        usable = mined & ~torch.isnan(c)  # [layers, batch, pos, keys]
        positive_input, negative_input = usable & ~input_negative, usable.logical_and_(input_negative)
        negated = c.neg()  # [layers, batch, pos, keys]
        sides = (positive_input, c), (negative_input, negated), (positive_input, negated), (negative_input, c)
        found = [  # per quadrant: s·m's largest where it lies, first where it is ([layers, batch, keys] each)
            torch.where(where, signed, float("-inf")).max(dim=2) for where, signed in sides
        ]
        best = torch.stack([value for value, _ in found])  # [4, layers, batch, keys]: s·m, −inf where none
        at = torch.stack([where for _, where in found])  # [4, layers, batch, keys]
        present = torch.stack([best[0] >= 0, best[1] >= 0, best[2] > 0, best[3] > 0])  # pp, pn: m may be 0
        best = best.abs().masked_fill_(~present, float("-inf"))  # |m| (+0.0 for m = −0.0)
        entered = torch.where(
            present, batch.sentence_index[:, None], -1
        )  # [4, layers, batch, keys]: −1 empty
        new = order_key(best, entered).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        at = at.masked_fill_(~present, 0)  # [4, layers, batch, keys]
        read = torch.stack([u.gather(2, where[:, :, None]).squeeze(2) for where in at])  # like at
        read = read.masked_fill_(~present, 0.0).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        merged = torch.cat([self.quadrant_order[layers], new], dim=3)  # [layers, keys, 4, E + batch]
        kept, index = merged.topk(QUADRANT_EXAMPLES, dim=3)  # [layers, keys, 4, E] each
        where = torch.cat([self.quadrant_position[layers], at.permute(1, 3, 0, 2)], dim=3)  # like merged
        values = torch.cat([self.quadrant_input[layers], read], dim=3)  # like merged
        self.quadrant_order[layers] = kept
        self.quadrant_position[layers] = where.gather(3, index)  # [layers, keys, 4, E]
        self.quadrant_input[layers] = values.gather(3, index)  # [layers, keys, 4, E]

    def _histogram(self, c: torch.Tensor, unmined: torch.Tensor) -> torch.Tensor:
        """[layers, keys, bins] counts of one batch's coefficients `c` [layers, batch, pos, keys]
        (`unmined`, a 0-dim tensor, of each layer's are padding set to +0.0).

        Each float's sign and exponent (a code) is counted per layer and key with one scatter-add
        (torch.bincount would read its input's maximum back to the host), then the codes are folded into
        the histogram's bins: two cheap passes over the coefficients, not ten.
        """
        n_layers, n_keys = c.shape[0], self.n_keys
        codes = scratch(self._workspace, "codes", c.shape, torch.int32, c.device)  # like c
        torch.bitwise_right_shift(c.contiguous().view(torch.int32), 23, out=codes)  # −256 … 255
        layer_offsets = torch.arange(n_layers, dtype=torch.int32, device=c.device) * (n_keys * CODE_STRIDE)
        offsets = self._key_offsets + layer_offsets[:, None]  # [layers, keys]: each layer after the last
        codes = codes.view(n_layers, -1, n_keys).add_(offsets[:, None])  # [layers, batch·pos, keys]
        ones = torch.ones(1, dtype=torch.int32, device=c.device).expand(codes.numel())  # [codes]
        by_code = torch.zeros(n_layers * n_keys * CODE_STRIDE, dtype=torch.int32, device=c.device)
        by_code.index_add_(0, codes.view(-1), ones)  # [layers · keys · CODE_STRIDE]
        by_code = by_code.view(n_layers, n_keys, CODE_STRIDE)[..., :CODES].long()  # [layers, keys, CODES]
        counts = torch.zeros((n_layers, n_keys, N_BINS), dtype=torch.long, device=c.device)
        counts.index_add_(2, self._code_bins, by_code)  # [layers, keys, bins]
        counts[..., ZERO_BIN] -= unmined
        return counts

    def _enter_top(self, layers: slice, best: torch.Tensor, at: torch.Tensor, sentence: torch.Tensor) -> None:
        """Merge a batch's sentences into the top-T of both signs: `best` [signs, layers, batch, keys] is
        s·m's maximum per sentence, `at` [signs, layers, batch, keys] where it first is, `sentence`
        [batch] the sentences (−1: none mined). One topk over every key's kept and new order keys; order
        keys are unique but for the empty slot's, whose position is 0 wherever it is, so ties do not
        change the state."""
        kept_order = torch.stack([self.top[sign].order[layers] for sign in SIGNS])  # [signs, layers, keys, T]
        kept_position = torch.stack([self.top[sign].position[layers] for sign in SIGNS])  # like kept_order
        new = order_key(best.transpose(2, 3), sentence)  # [signs, layers, keys, batch]
        merged = torch.cat([kept_order, new], dim=3)  # [signs, layers, keys, T + batch]
        kept, index = merged.topk(self.top_k, dim=3)  # [signs, layers, keys, T] each, best first
        positions = torch.cat([kept_position, at.transpose(2, 3)], dim=3)  # [signs, layers, keys, T + batch]
        position = positions.gather(3, index)  # [signs, layers, keys, T]
        for i, sign in enumerate(SIGNS):
            self.top[sign].order[layers] = kept[i]
            self.top[sign].position[layers] = position[i]

    def _sample(
        self,
        layers: slice,
        extreme: torch.Tensor,
        best: torch.Tensor,
        at: torch.Tensor,
        sample_key: torch.Tensor,
    ) -> None:
        """Fold a batch's sentence extremes into the band samples (MinedLayer.sample_order).

        `extreme`, `best` (s·extreme, −inf for a sentence with no mined position) and `at` (where the
        extreme first is): [signs, layers, batch, keys]; `sample_key`: [layers, keys, batch] each
        sentence's order key. A maximum above 0 and a minimum below 0 lie in different bins, so both
        signs are the candidates of one pass. The candidates' lowest per key and bin are found with
        SAMPLES rounds of a scatter-min (each round also scatters the candidate that holds them), then
        every cell is merged with its kept samples (`first_of_stable_sort` of [.., bins, 2·SAMPLES]).
        """
        n_bins, n_layers, n_keys = N_BINS, extreme.shape[1], self.n_keys

        def by_key(x: torch.Tensor) -> torch.Tensor:
            return x.permute(1, 3, 0, 2).reshape(n_layers, n_keys, -1)  # [layers, keys, signs·batch]

        useful = by_key((best > 0) & torch.isfinite(best))  # not −inf (nothing mined), not NaN
        bins = by_key(histogram_bins(extreme).long()).masked_fill(~useful, n_bins)  # n_bins: no bin
        order = torch.where(useful, sample_key.repeat(1, 1, len(SIGNS)), EMPTY_SAMPLE)  # like useful
        candidates = torch.arange(order.shape[2], device=order.device)  # [signs·batch]
        candidates = candidates.expand(n_layers, n_keys, -1)  # [layers, keys, signs·batch]
        found, found_at = [], []  # per round: [layers, keys, bins] each
        for _ in range(SAMPLES):
            cells = (n_layers, n_keys, n_bins + 1)
            lowest = torch.full(cells, EMPTY_SAMPLE, dtype=torch.long, device=order.device)
            lowest.scatter_reduce_(2, bins, order, "amin")  # [layers, keys, bins + 1]
            hit = order == lowest.gather(2, bins)  # like order: each cell's lowest (or none left)
            which = torch.zeros(cells, dtype=torch.long, device=order.device)
            which.scatter_(2, torch.where(hit, bins, n_bins), candidates)  # [layers, keys, bins + 1]
            found.append(lowest[..., :n_bins])
            found_at.append(which[..., :n_bins])
            order = order.masked_fill(hit, EMPTY_SAMPLE)  # [layers, keys, signs·batch]
        found = torch.stack(found, dim=-1)  # [layers, keys, bins, S], lowest first
        which = torch.stack(found_at, dim=-1).view(n_layers, n_keys, -1)  # [layers, keys, bins·S]
        position = by_key(at).gather(2, which).view(found.shape)  # [layers, keys, bins, S]
        coefficient = by_key(extreme).gather(2, which).view(found.shape)  # [layers, keys, bins, S]
        # Stable: among empty entries the kept ones come first, so an empty slot keeps what it held (a
        # found empty entry, whose candidate means nothing, is never among the first SAMPLES), as in the
        # compiled fold, which never writes an empty slot.
        orders = torch.cat([self.sample_order[layers], found], dim=-1)  # [layers, keys, bins, 2S]
        slot = first_of_stable_sort(orders, SAMPLES)  # [layers, keys, bins, S]: 0 … S − 1 kept, S … found
        positions = torch.cat([self.sample_position[layers], position.to(torch.int16)], dim=-1)
        coefficients = torch.cat([self.sample_coefficient[layers], coefficient], dim=-1)
        self.sample_order[layers] = orders.gather(-1, slot)  # [layers, keys, bins, S]
        self.sample_position[layers] = positions.gather(-1, slot)  # [layers, keys, bins, S]
        self.sample_coefficient[layers] = coefficients.gather(-1, slot)  # [layers, keys, bins, S]

    def count(self, batch: Batch) -> None:
        """Count a batch's positions and sentences once (after its layers were folded in)."""
        if self._pending:
            self._fold_pending()
        self.positions += int(batch.mined.sum())
        self.sentences += len(batch.sentence_index)

    # -- checkpoints (shards merge as MinedLayer, ffmem.engine.mining.mined_layer) -------------------------
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
            **(self._quadrant_arrays(layer) if self.gated else {}),
        )

    def _quadrant_arrays(self, layer: int) -> dict[str, np.ndarray]:
        """A layer's quadrant state as MinedLayer's arrays (m signed by its quadrant, 0 where empty)."""
        magnitude, sentence = unpack(self.quadrant_order[layer])  # [keys, 4, E] each
        empty = torch.isinf(magnitude)  # [keys, 4, E]
        signs = torch.tensor(QUADRANT_SIGNS, dtype=torch.float32, device=magnitude.device)[:, None]  # [4, 1]
        return {
            "quadrant_count": self.quadrant_count[layer].cpu().numpy(),
            "quadrant_coefficient": (magnitude * signs).masked_fill(empty, 0.0).cpu().numpy(),
            "quadrant_sentence": sentence.masked_fill(empty, -1).cpu().numpy().astype(np.int32),
            "quadrant_position": self.quadrant_position[layer].cpu().numpy().astype(np.int16),
            "quadrant_input": self.quadrant_input[layer].cpu().numpy(),
        }

    @classmethod
    def from_layers(cls, layers: list[MinedLayer], device: torch.device | str = "cpu") -> MiningState:
        """The state whose `layer(l)` gives back `layers[l]`."""
        first = layers[0]
        state = cls(len(layers), first.histogram.shape[0], first.top_k, device=device, gated=first.gated)
        for index, layer in enumerate(layers):
            for sign in SIGNS:
                values = torch.from_numpy(sign * layer.coefficient[sign]).to(device)  # [keys, T]; −inf: empty
                sentence = torch.from_numpy(layer.sentence[sign]).to(device).long()  # [keys, T]
                state.top[sign].order[index] = order_key(values, sentence)
                state.top[sign].position[index] = torch.from_numpy(layer.position[sign]).to(device).long()
            state.histogram[index] = torch.from_numpy(layer.histogram).to(device)
            state.total[index] = torch.from_numpy(layer.total).to(device)
            state.sample_order[index] = torch.from_numpy(layer.sample_order).to(device)
            state.sample_position[index] = torch.from_numpy(layer.sample_position).to(device)
            state.sample_coefficient[index] = torch.from_numpy(layer.sample_coefficient).to(device)
            if state.gated:
                sentence = torch.from_numpy(layer.quadrant_sentence).long()  # [keys, 4, E]
                magnitude = torch.from_numpy(np.abs(layer.quadrant_coefficient))  # [keys, 4, E]
                magnitude = magnitude.masked_fill(sentence < 0, -np.inf)
                state.quadrant_order[index] = order_key(magnitude, sentence).to(device)
                state.quadrant_count[index] = torch.from_numpy(layer.quadrant_count).to(device)
                state.quadrant_position[index] = torch.from_numpy(layer.quadrant_position).to(device).long()
                state.quadrant_input[index] = torch.from_numpy(layer.quadrant_input).to(device)
        state.positions, state.sentences = first.positions, first.sentences
        return state

    # -- results --------------------------------------------------------------------------------
    def triggers(self, layer: int, sign: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(coefficients, sentence index, position), each [keys, T]; sentence −1 marks empty slots."""
        top = self.top[sign]
        values, sentence = unpack(top.order[layer])  # [keys, T] each
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


_NO_INPUTS = torch.zeros((1, 1, 1), dtype=torch.float32)  # the compiled fold's inputs of an ungated layer
_NO_QUADRANTS = (
    torch.zeros((1, 4), dtype=torch.long),
    torch.zeros((1, 4, 1), dtype=torch.long),
    torch.zeros((1, 4, 1), dtype=torch.long),
    torch.zeros((1, 4, 1), dtype=torch.float32),
)  # and its quadrant arrays
