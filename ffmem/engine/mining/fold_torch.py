"""The mining fold in torch operations, the fold of every device but the CPU (which runs
ffmem.engine.mining.fold_cpu): a batch's coefficients folded into a MiningState's tensors, the batch's
consecutive layers gathered into groups and each group folded at once.

Every operation has a shape fixed by (layers, batch, pos, keys, T, bins, SAMPLES): no `nonzero`, no boolean
indexing, no value read back to the host, so that on a GPU a batch's folds of every layer are enqueued
without waiting for one to finish. The state it gives is the compiled fold's, tested equal: the same order
keys and ties, the same positions, histograms and band samples.

What costs is the passes over the group's [layers, batch, pos, keys] coefficients: they are
ffmem.engine.mining.fold_passes's, eager or compiled. What they give, [.., layers, batch, keys] tensors a
position's worth smaller, is merged here into the top-T, the band samples and the quadrant examples.

The top-T and the quadrant examples are merged in one of two forms (`bar`). The merge: every sentence of
the batch and every kept entry in one topk of [.., T + batch]. The bar form: where the batch has more
sentences than the list has slots, only its best T can enter (a topk of [.., batch]): a candidate buffer of
min(batch, T), which never overflows; each buffered order key is compared with its list's last kept one
(the bar, the T-th largest; the E-th for a quadrant) and those that do not beat it made empty entries; the
buffer goes into the list with one topk of [.., T + min(batch, T)]. Both give the same lists (order keys
are unique but for the empty slot's, whose position is 0 and input 0.0 wherever it is: an empty slot's
payloads are zeroed after the topk). Fixed shapes both: the bar cannot shrink the work to the candidates
that beat it without reading their number back to the host. On a CPU the bar form is the slower at 32
sentences a batch and the faster from ~128 (quadrant examples) and ~512 (top-T) (docs/benchmarks.md, the
torch fold's bar form).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ffmem.engine.mining import fold_passes
from ffmem.engine.mining.bins import CODE_STRIDE, CODES, FOLD_BYTES, code_values, histogram_bins, scratch
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.fold_passes import Reductions
from ffmem.engine.mining.mined_layer import EMPTY_SAMPLE, N_BINS, SAMPLES, SIGNS
from ffmem.engine.mining.order import EMPTY_ORDER, first_of_stable_sort, order_key, sample_priority

if TYPE_CHECKING:
    from ffmem.engine.mining.state import MiningState


class TorchFold:
    """The torch fold into one MiningState: its tables, its workspace, and the group of a batch's
    consecutive layers gathered so far and not yet folded."""

    def __init__(
        self, state: MiningState, device: torch.device | str, compiled: bool = False, bar: bool = False
    ):
        """`compiled`: the passes over a group compiled by torch.compile (fold_passes.compiled); `bar`: the
        top-T and quadrant examples merged in the bar form (see the module's doc)."""
        self.state, self.bar = state, bar
        self._reductions = fold_passes.compiled() if compiled else fold_passes.reductions
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
        keys]) of a batch into the state; `c` is float32. A gated state takes the `inputs` x·u of the same
        shape. Both are read, not overwritten.

        The passes over the whole group (fold_passes.reductions) give each row's extremes and where they
        are, the sums and histograms; the top-T and the band samples then work on [signs, layers, batch,
        keys], both signs at once, and a gated state's quadrant examples on [4, layers, batch, keys].
        """
        state = self.state
        if isinstance(layers, int):
            layers, c = slice(layers, layers + 1), c[None]
            inputs = None if inputs is None else inputs[None]
        anchor, has_mined = batch.anchor  # [batch] each: the first mined position, whether there is one
        found = self._reductions(c, inputs, batch.mined, anchor, self._key_offsets, self._code_bins)
        state.total[layers] += found.total
        state.histogram[layers] += found.histogram
        if state.gated:
            self._enter_quadrants(layers, found, inputs, batch)
        # best: s·extreme. A sentence with no mined position has best −inf; its sentence −1 then gives
        # it the empty slot's order key (and position 0: its anchor), so it never ranks above an empty slot.
        high, low = found.extreme  # [layers, batch, keys] each
        best = torch.stack([high, low.neg()]).masked_fill_(~has_mined[:, None], float("-inf"))
        sentence = batch.sentence_index.masked_fill(~has_mined, -1)  # [batch]
        self._enter_top(layers, best, found.at, sentence)
        priority = sample_priority(batch.sentence_index, layers, state.n_keys)  # [layers, keys, batch]
        self._enter_samples(layers, found.extreme, best, found.at, priority << 32 | batch.sentence_index)

    def _enter_quadrants(self, layers: slice, found: Reductions, u: torch.Tensor, batch: Batch) -> None:
        """Merge a batch's quadrant counts and, per sentence, its largest |m| in each quadrant (first where
        it is, with the input x·u there: `u` [layers, batch, pos, keys]) into the quadrants' top examples."""
        state = self.state
        state.quadrant_count[layers] += found.quadrant_count  # [layers, keys, 4]
        present = found.quadrant_present  # [4, layers, batch, keys]
        best = found.quadrant_extreme.abs().masked_fill_(~present, float("-inf"))  # |m| (+0.0 for m = −0.0)
        entered = torch.where(present, batch.sentence_index[:, None], -1)  # like present: −1 empty
        new = order_key(best, entered).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        at = found.quadrant_at.masked_fill(~present, 0)  # [4, layers, batch, keys]
        read = torch.stack([u.gather(2, where[:, :, None]).squeeze(2) for where in at])  # like at
        read = read.masked_fill_(~present, 0.0).permute(1, 3, 0, 2)  # [layers, keys, 4, batch]
        kept, (where, values) = self._merge(
            state.quadrant_order[layers],  # [layers, keys, 4, E]
            new,
            (state.quadrant_position[layers], at.permute(1, 3, 0, 2)),  # [layers, keys, 4, E] and like new
            (state.quadrant_input[layers], read),
        )
        state.quadrant_order[layers] = kept  # [layers, keys, 4, E]
        state.quadrant_position[layers] = where  # [layers, keys, 4, E]
        state.quadrant_input[layers] = values  # [layers, keys, 4, E]

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
        kept, (position,) = self._merge(kept_order, new, (kept_position, at.transpose(2, 3)))
        for i, sign in enumerate(SIGNS):  # kept, position: [signs, layers, keys, T] each
            top[sign].order[layers] = kept[i]
            top[sign].position[layers] = position[i]

    def _merge(
        self, kept: torch.Tensor, new: torch.Tensor, *payloads: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The best n of `kept` [.., n] (order keys, best first) and `new` [.., batch] (unordered), best
        first, and each payload pair's (kept's [.., n], new's [.., batch]: positions, inputs) entries
        that go with them, [.., n] each: one topk of [.., n + batch], or in the bar form (`self.bar`) the
        batch's best n (where it has more), those of them that beat the bar, then one topk of
        [.., n + min(batch, n)]."""
        n = kept.shape[-1]
        if not self.bar:
            order, index = torch.cat([kept, new], dim=-1).topk(n, dim=-1)  # [.., n] each, best first
            return order, [torch.cat([old, fresh], dim=-1).gather(-1, index) for old, fresh in payloads]
        if new.shape[-1] > n:  # more sentences than slots: only the batch's best n can enter
            new, which = new.topk(n, dim=-1)  # [.., n] each: the candidate buffer
            payloads = tuple((old, fresh.gather(-1, which)) for old, fresh in payloads)
        below = new <= kept[..., -1:]  # [.., min(batch, n)]: the one comparison with each list's bar
        new = new.masked_fill(below, EMPTY_ORDER)  # like below: the candidates; the others empty entries
        order, index = torch.cat([kept, new], dim=-1).topk(n, dim=-1)  # [.., n] each, best first
        empty = order == EMPTY_ORDER  # [.., n]: an empty slot's payload is 0, whichever entry it came from
        return order, [
            torch.cat([old, fresh], dim=-1).gather(-1, index).masked_fill_(empty, 0)
            for old, fresh in payloads
        ]

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
