"""The mining fold in torch operations, the fold of every device but the CPU (which runs
ffmem.engine.mining.fold_cpu): a batch's coefficients folded into a MiningState's tensors, the batch's
consecutive layers gathered into groups and each group folded at once.

Every operation has a shape fixed by (layers, batch, pos, keys, T, bins, SAMPLES): no `nonzero`, no boolean
indexing, no value read back to the host, so that on a GPU a batch's folds of every layer are enqueued
without waiting for one to finish. The state it gives is the compiled fold's, tested equal: the same order
keys and ties, the same positions, histograms and band samples.

What costs is the passes over the group's [layers, batch, pos, keys] coefficients, so they are few. An
ungated layer's are seven: the fill of unmined positions with their row's first mined coefficient, the
maximum and the minimum with their positions, the sum, and the histogram's codes (a shift, the keys'
offsets, one scatter-add). The fill serves them all: it changes no extreme, and the copies it makes are
taken back out of the sum and the histogram from the [layers, batch, keys] first coefficients alone (no
zeroing pass). A gated layer's sign quadrants add comparisons and byte-wide logic on the signs of m and
of its input x·u, counted in 16-bit sums, and four masked extremes: the largest m and the smallest over
the positions of each input sign give the four quadrants' largest |m| (two maxima and two minima, where
there were four maxima over four masked copies and a negation). The rest (top-T, band samples, quadrant
examples) works on [.., layers, batch, keys] tensors, a position's worth less.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ffmem.engine.mining.bins import CODE_STRIDE, CODES, FOLD_BYTES, code_values, histogram_bins, scratch
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.mined_layer import EMPTY_SAMPLE, N_BINS, QUADRANT_EXAMPLES, SAMPLES, SIGNS
from ffmem.engine.mining.order import first_of_stable_sort, order_key, sample_priority

if TYPE_CHECKING:
    from ffmem.engine.mining.state import MiningState


class TorchFold:
    """The torch fold into one MiningState: its tables, its workspace, and the group of a batch's
    consecutive layers gathered so far and not yet folded."""

    def __init__(self, state: MiningState, device: torch.device | str):
        self.state = state
        # A key's codes in the bincount (see _histogram): (bits >> 23) + CODES / 2 + key · CODE_STRIDE.
        keys = torch.arange(state.n_keys, dtype=torch.int32, device=device)  # [keys]
        self._key_offsets = keys * CODE_STRIDE + CODES // 2  # [keys]
        # (bits >> 23) + 256 is 256 + exponent for a positive float, the exponent for a negative one.
        code_bins = histogram_bins(code_values())  # [CODES] int32: each (sign, exponent) code's bin
        shifted = torch.arange(CODES) ^ (CODES // 2)  # [CODES]: each shifted code's (sign, exponent) code
        self._code_bins = code_bins[shifted].long().to(device)  # [CODES]: its bin
        self._workspace: dict[str, torch.Tensor] = {}
        self._pending: list[int] = []  # layers of `_pending_batch` copied into `_buffer`, not yet folded
        self._pending_batch: Batch | None = None
        self._buffer: torch.Tensor | None = None  # [group, batch, pos, keys] float32
        self._input_buffer: torch.Tensor | None = None  # [group, batch, pos, keys] float32 (gated)
        self._group = 1

    # -- groups of consecutive layers ------------------------------------------------------------------
    def gather(
        self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs: torch.Tensor | None
    ) -> None:
        """Copy one layer's coefficients (and inputs, gated) into the group of the batch's consecutive
        layers (float32, in the workspace), folding the group when it is full or holds the last layer."""
        state, pending = self.state, self._pending
        if pending and (pending[-1] != layer - 1 or self._pending_batch is not batch):
            self.fold_pending()
        if not pending:
            per_layer = coefficients.numel() * 4 * (2 if state.gated else 1)
            self._group = max(1, min(state.n_layers - layer, FOLD_BYTES // max(per_layer, 1)))
            shape = (self._group, *coefficients.shape)  # [group, batch, pos, keys]
            self._buffer = scratch(self._workspace, "group", shape, torch.float32, coefficients.device)
            if state.gated:
                self._input_buffer = scratch(self._workspace, "inputs", shape, torch.float32, inputs.device)
            self._pending_batch = batch
        self._buffer[len(pending)].copy_(coefficients)  # [batch, pos, keys], as float32
        if state.gated:
            self._input_buffer[len(pending)].copy_(inputs)  # [batch, pos, keys], as float32
        pending.append(layer)
        if len(pending) == self._group or layer == state.n_layers - 1:
            self.fold_pending()

    def fold_pending(self) -> None:
        """Fold the layers gathered so far (none: nothing to do)."""
        if not self._pending:
            return
        layers, n = slice(self._pending[0], self._pending[-1] + 1), len(self._pending)
        inputs = self._input_buffer[:n] if self.state.gated else None
        self.fold(layers, self._buffer[:n], self._pending_batch, inputs)
        self._pending.clear()
        self._pending_batch = self._buffer = self._input_buffer = None

    # -- the fold ----------------------------------------------------------------------------------------
    def fold(
        self, layers: int | slice, c: torch.Tensor, batch: Batch, inputs: torch.Tensor | None = None
    ) -> None:
        """Fold one layer (`c` [batch, pos, keys]) or consecutive ones (a slice, `c` [layers, batch, pos,
        keys]) of a batch into the state; `c`, float32, is overwritten. A gated state takes the `inputs` x·u
        of the same shape (read, not overwritten).

        Passes over the whole [layers, batch, pos, keys] tensor (see the module's docstring): the fill of
        unmined positions, the maximum and the minimum with their positions, the sum, the codes and their
        count; the top-T and the band samples then work on [signs, layers, batch, keys], both signs at once.
        """
        state = self.state
        if isinstance(layers, int):
            layers, c = slice(layers, layers + 1), c[None]
            inputs = None if inputs is None else inputs[None]
        n_layers, n_keys = c.shape[0], state.n_keys
        mined = batch.mined[None, :, :, None]  # [1, batch, pos, 1]
        if state.gated:
            self._fold_quadrants(layers, c, inputs, batch)
        anchor, has_mined = batch.anchor  # [batch] each: the first mined position, whether there is one
        # Unmined positions first hold their row's first mined coefficient, which changes neither its
        # maximum nor its minimum. Where an extreme's first occurrence is such a copy, its first mined
        # occurrence is the anchor: the anchor holds that value and no mined position comes before it. A
        # row with nothing mined holds +0.0 throughout: its copies are taken back out like any row's.
        at_anchor = anchor[None, :, None, None].expand(n_layers, -1, 1, n_keys)  # [layers, batch, 1, keys]
        first = c.gather(2, at_anchor).masked_fill_(~has_mined[None, :, None, None], 0.0)  # like at_anchor
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
        # The sum and the histogram of the filled c, less each row's copies of its first coefficient
        # (an infinite first one is summed as it is: its copies change no infinite sum).
        copies = batch.mined.shape[1] - batch.mined.sum(dim=1)  # [batch]: each row's unmined positions
        first = first[:, :, 0]  # [layers, batch, keys]
        finite = first.double().masked_fill_(~torch.isfinite(first), 0.0)  # like first, float64
        state.total[layers] += self._sum(c) - (finite * copies[:, None]).sum(dim=1)  # [layers, keys]
        state.histogram[layers] += self._histogram(c, first, copies)
        self._enter_top(layers, best, at, sentence)
        priority = sample_priority(batch.sentence_index, layers, n_keys)  # [layers, keys, batch]
        self._enter_samples(layers, extreme, best, at, priority << 32 | batch.sentence_index)

    def _fold_quadrants(self, layers: slice, c: torch.Tensor, u: torch.Tensor, batch: Batch) -> None:
        """Fold a batch's sign quadrants (before `c` [layers, batch, pos, keys] is overwritten; `u` the
        inputs x·u, like `c`): the positions in each, and per sentence its largest |m| in each quadrant (a
        NaN coefficient ranks nowhere), first where it is, entered into the quadrant's top examples.

        A position's quadrant is the compiled fold's: 2·(gate < 0) + (input < 0), the gate negative where
        m < 0 < u or u < 0 < m. Three counts give the four: the mined positions with a negative gate, a
        negative input, and both (bytes summed in 16 bits along a row, then over rows). The largest |m| of
        the four take two maxima and two minima: over the positions whose input is ≥ 0, the largest m ≥ 0
        is pp's and the smallest m < 0 np's; over those whose input is < 0, the largest m > 0 is nn's and
        the smallest m ≤ 0 pn's (m = gate · input: a zero input has a zero m)."""
        state, shape, device = self.state, c.shape, c.device
        mined = batch.mined[None, :, :, None]  # [1, batch, pos, 1]
        flags = [scratch(self._workspace, f"flags{i}", shape, torch.bool, device) for i in range(4)]
        input_negative, gate_negative, usable, scratch_flags = flags  # [layers, batch, pos, keys] each
        torch.lt(u, 0, out=input_negative)
        torch.lt(c, 0, out=gate_negative).logical_and_(torch.gt(u, 0, out=scratch_flags))
        gate_negative.logical_or_(torch.gt(c, 0, out=scratch_flags).logical_and_(input_negative))
        # Mined positions only, `mined` broadcast twice (a slow logical_and on a CPU): m may rank where it
        # is not NaN, and a NaN m has no negative gate.
        torch.logical_and(torch.eq(c, c, out=scratch_flags), mined, out=usable)
        gate_negative.logical_and_(usable)
        input_negative.logical_and_(mined)

        def count(flags: torch.Tensor) -> torch.Tensor:  # [layers, keys]: the positions flagged
            return flags.view(torch.uint8).sum(dim=2, dtype=torch.int16).sum(dim=1)  # a row's < 2¹⁵

        gate, inputs = count(gate_negative), count(input_negative)  # [layers, keys] each
        both = count(gate_negative.logical_and_(input_negative))  # [layers, keys]
        positions = batch.mined.sum()  # 0-dim: the mined positions of the batch
        counts = (positions - gate - inputs + both, inputs - both, gate - both, both)  # the four quadrants'
        state.quadrant_count[layers] += torch.stack(counts, dim=-1)  # [layers, keys, 4]
        negative_input = torch.logical_and(usable, input_negative, out=gate_negative)  # (mined: usable is)
        positive_input = torch.gt(usable, input_negative, out=usable)  # usable and not input_negative
        positive, negative = self._side_extremes(c, positive_input), self._side_extremes(c, negative_input)
        # [4, layers, batch, keys] each, pp, pn, np, nn: m's extreme, where it first is, whether it counts
        extreme = torch.stack([positive[0], negative[2], positive[2], negative[0]])
        at = torch.stack([positive[1], negative[3], positive[3], negative[1]])
        signs = torch.stack([extreme[0] >= 0, extreme[1] <= 0, extreme[2] < 0, extreme[3] > 0])  # like at
        present = signs.logical_and_(torch.stack([positive[4], negative[4], positive[4], negative[4]]))
        best = extreme.abs().masked_fill_(~present, float("-inf"))  # |m| (+0.0 for m = −0.0)
        entered = torch.where(
            present, batch.sentence_index[:, None], -1
        )  # [4, layers, batch, keys]: −1 empty
        new = order_key(best, entered).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        at = at.masked_fill_(~present, 0)  # [4, layers, batch, keys]
        read = torch.stack([u.gather(2, where[:, :, None]).squeeze(2) for where in at])  # like at
        read = read.masked_fill_(~present, 0.0).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        merged = torch.cat([state.quadrant_order[layers], new], dim=3)  # [layers, keys, 4, E + batch]
        kept, index = merged.topk(QUADRANT_EXAMPLES, dim=3)  # [layers, keys, 4, E] each
        where = torch.cat([state.quadrant_position[layers], at.permute(1, 3, 0, 2)], dim=3)  # like merged
        values = torch.cat([state.quadrant_input[layers], read], dim=3)  # like merged
        state.quadrant_order[layers] = kept
        state.quadrant_position[layers] = where.gather(3, index)  # [layers, keys, 4, E]
        state.quadrant_input[layers] = values.gather(3, index)  # [layers, keys, 4, E]

    def _side_extremes(self, c: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The maximum of `c` [layers, batch, pos, keys] over a row's positions in `side` (like c), where
        it first is, the minimum, where it first is, and whether the row has any ([layers, batch, keys]
        each): one masked copy, in which the other positions hold the row's first of the side (as the
        fold's unmined positions hold the first mined one), read by a max and a min."""
        # [layers, batch, 1, keys]: the side's first position (0: none), by max, not argmax (ten times
        # slower on a CPU), whose position is the first of the largest as well
        first = side.view(torch.uint8).max(dim=2, keepdim=True).indices
        masked = scratch(self._workspace, "masked", c.shape, torch.float32, c.device)  # like c
        torch.where(side, c, c.gather(2, first), out=masked)
        (high, high_at), (low, low_at) = masked.max(dim=2), masked.min(dim=2)  # [layers, batch, keys] each
        first = first.squeeze(2)  # [layers, batch, keys]

        def first_on_side(at: torch.Tensor) -> torch.Tensor:  # a copy's first occurrence is the side's first
            return torch.where(side.gather(2, at[:, :, None]).squeeze(2), at, first)

        return high, first_on_side(high_at), low, first_on_side(low_at), side.gather(2, first[:, :, None])[:, :, 0]

    def _sum(self, c: torch.Tensor) -> torch.Tensor:
        """[layers, keys] float64 sums of `c` [layers, batch, pos, keys] over its batch and positions. A
        GPU casts as it reads; torch on a CPU casts into a float64 copy first, four times faster into a
        kept one than into a fresh one (the torch fold runs on a CPU in tests and benches)."""
        if c.device.type != "cpu":
            return c.sum(dim=(1, 2), dtype=torch.float64)
        wide = scratch(self._workspace, "wide", c.shape, torch.float64, c.device)  # like c
        return wide.copy_(c).sum(dim=(1, 2))

    def _histogram(self, c: torch.Tensor, first: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
        """[layers, keys, bins] counts of one batch's coefficients `c` [layers, batch, pos, keys], less
        `copies` [batch] of each row's `first` [layers, batch, keys] (the fill of its unmined positions).

        Each float's sign and exponent (a code) is counted per layer and key with one scatter-add
        (torch.bincount would read its input's maximum back to the host), the copies taken back with a
        second over [layers, batch, keys], then the codes are folded into the histogram's bins.
        """
        n_layers, n_keys = c.shape[0], self.state.n_keys
        layer_offsets = torch.arange(n_layers, dtype=torch.int32, device=c.device) * (n_keys * CODE_STRIDE)
        offsets = (self._key_offsets + layer_offsets[:, None])[:, None]  # [layers, 1, keys]
        codes = scratch(self._workspace, "codes", c.shape, torch.int32, c.device)  # like c
        torch.bitwise_right_shift(c.contiguous().view(torch.int32), 23, out=codes)  # −256 … 255
        codes = codes.view(n_layers, -1, n_keys).add_(offsets)  # [layers, batch·pos, keys]
        ones = torch.ones(1, dtype=torch.int32, device=c.device).expand(codes.numel())  # [codes]
        by_code = torch.zeros(n_layers * n_keys * CODE_STRIDE, dtype=torch.int32, device=c.device)
        by_code.index_add_(0, codes.view(-1), ones)  # [layers · keys · CODE_STRIDE]
        copied = (first.contiguous().view(torch.int32) >> 23).add_(offsets)  # [layers, batch, keys]
        taken = copies.int().neg()[:, None].expand(first.shape).reshape(-1)  # [layers · batch · keys]
        by_code.index_add_(0, copied.view(-1), taken)
        by_code = by_code.view(n_layers, n_keys, CODE_STRIDE)[..., :CODES].long()  # [layers, keys, CODES]
        counts = torch.zeros((n_layers, n_keys, N_BINS), dtype=torch.long, device=c.device)
        return counts.index_add_(2, self._code_bins, by_code)  # [layers, keys, bins]

    def _enter_top(self, layers: slice, best: torch.Tensor, at: torch.Tensor, sentence: torch.Tensor) -> None:
        """Merge a batch's sentences into the top-T of both signs: `best` [signs, layers, batch, keys] is
        s·m's maximum per sentence, `at` [signs, layers, batch, keys] where it first is, `sentence`
        [batch] the sentences (−1: none mined). One topk over every key's kept and new order keys; order
        keys are unique but for the empty slot's, whose position is 0 wherever it is, so ties do not
        change the state."""
        top = self.state.top
        kept_order = torch.stack([top[sign].order[layers] for sign in SIGNS])  # [signs, layers, keys, T]
        kept_position = torch.stack([top[sign].position[layers] for sign in SIGNS])  # like kept_order
        new = order_key(best.transpose(2, 3), sentence)  # [signs, layers, keys, batch]
        merged = torch.cat([kept_order, new], dim=3)  # [signs, layers, keys, T + batch]
        kept, index = merged.topk(self.state.top_k, dim=3)  # [signs, layers, keys, T] each, best first
        positions = torch.cat([kept_position, at.transpose(2, 3)], dim=3)  # [signs, layers, keys, T + batch]
        position = positions.gather(3, index)  # [signs, layers, keys, T]
        for i, sign in enumerate(SIGNS):
            top[sign].order[layers] = kept[i]
            top[sign].position[layers] = position[i]

    def _enter_samples(
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
        state = self.state
        n_bins, n_layers, n_keys = N_BINS, extreme.shape[1], state.n_keys

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
        orders = torch.cat([state.sample_order[layers], found], dim=-1)  # [layers, keys, bins, 2S]
        slot = first_of_stable_sort(orders, SAMPLES)  # [layers, keys, bins, S]: 0 … S − 1 kept, S … found
        positions = torch.cat([state.sample_position[layers], position.to(torch.int16)], dim=-1)
        coefficients = torch.cat([state.sample_coefficient[layers], coefficient], dim=-1)
        state.sample_order[layers] = orders.gather(-1, slot)  # [layers, keys, bins, S]
        state.sample_position[layers] = positions.gather(-1, slot)  # [layers, keys, bins, S]
        state.sample_coefficient[layers] = coefficients.gather(-1, slot)  # [layers, keys, bins, S]
