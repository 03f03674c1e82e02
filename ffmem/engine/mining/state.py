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

Two folds fill it, tested equal bit for bit: on a CPU the compiled one (ffmem.engine.mining.fold_cpu), on
every other device the torch one (ffmem.engine.mining.fold_torch). This module holds the state, how it is
built (from a checkpoint's layers) and read out (triggers, statistics, a layer's arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from ffmem.engine.mining import fold_cpu
from ffmem.engine.mining import mined_layer as mined
from ffmem.engine.mining.bins import code_values, histogram_bins
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.fold_torch import TorchFold
from ffmem.engine.mining.mined_layer import (
    EMPTY_SAMPLE,
    N_BINS,
    QUADRANT_EXAMPLES,
    QUADRANT_SIGNS,
    QUADRANTS,
    SAMPLES,
    SIGNS,
    MinedLayer,
    histogram_edges,
)
from ffmem.engine.mining.order import EMPTY_ORDER, order_key, unpack


@dataclass
class TopK:
    """Running top-T of s·m per key, best first, as packed order keys (see order_key)."""

    order: torch.Tensor  # [layers, keys, T] int64: s·coefficient and sentence in one sortable number
    position: torch.Tensor  # [layers, keys, T] int64: where in the sentence s·m is highest


class MiningState:
    """Everything mined so far: per sign a TopK, and the per-key statistics."""

    def __init__(
        self,
        n_layers: int,
        n_keys: int,
        top_k: int,
        device: torch.device | str = "cpu",
        gated: bool = False,
        compiled_fold: bool = False,
        bar_fold: bool = False,
    ):
        """`compiled_fold`: the torch fold's passes compiled by torch.compile (fold_passes.compiled);
        `bar_fold`: its top-T and quadrant examples merged in the bar form (fold_torch)."""
        self.n_layers, self.n_keys, self.top_k, self.gated = n_layers, n_keys, top_k, gated
        self.compiled_fold, self.bar_fold = compiled_fold, bar_fold
        shape = (n_layers, n_keys, top_k)
        self.top = {
            sign: TopK(
                order=torch.full(shape, EMPTY_ORDER, dtype=torch.long, device=device),
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
        self.quadrant_order = torch.full(quadrants, EMPTY_ORDER, dtype=torch.long, device=device)
        self.quadrant_position = torch.zeros(quadrants, dtype=torch.long, device=device)
        self.quadrant_input = torch.zeros(quadrants, dtype=torch.float32, device=device)
        self.positions = 0  # mined positions (the denominator of every share)
        self.sentences = 0
        # The two folds: the compiled one's table ([CODES] int32: each sign and exponent code's bin) and
        # the torch fold of every other device, with its tables and workspace.
        self._code_bins_by_code = histogram_bins(code_values()).numpy()
        self._torch_fold = TorchFold(self, device, compiled=compiled_fold, bar=bar_fold)

    # -- update ---------------------------------------------------------------------------------
    def update(
        self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs: torch.Tensor | None = None
    ) -> None:
        """Fold one layer's coefficients for one batch into the state (and, for a gated state, the
        inputs x·u of the same positions, [batch, pos, keys]).

        On a CPU, one compiled pass (ffmem.engine.mining.fold_cpu); elsewhere the vectorised torch fold
        (ffmem.engine.mining.fold_torch), which gives the same state, of consecutive layers together
        (`_gather`: the last layer, or a full group, folds them).
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
        """`update` on every device but the CPU: the layer gathered with the batch's consecutive layers
        and folded in torch operations as a group (ffmem.engine.mining.fold_torch)."""
        self._torch_fold.gather(layer, coefficients, batch, inputs)

    def fold_tensors(
        self, layers: int | slice, c: torch.Tensor, batch: Batch, inputs: torch.Tensor | None = None
    ) -> None:
        """`update` in torch operations on any device, for one layer (`c` [batch, pos, keys]) or
        consecutive ones (a slice, `c` [layers, batch, pos, keys]), float32. A gated state takes the
        `inputs` x·u of the same shape. Both are read, not overwritten. See fold_torch.TorchFold.fold.
        """
        self._torch_fold.fold(layers, c, batch, inputs)

    def count(self, batch: Batch) -> None:
        """Count a batch's positions and sentences once (after its layers were folded in)."""
        self._torch_fold.fold_pending()
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
    def from_layers(
        cls, layers: list[MinedLayer], device: torch.device | str = "cpu", compiled_fold: bool = False
    ) -> MiningState:
        """The state whose `layer(l)` gives back `layers[l]` (`compiled_fold`: as in the constructor)."""
        first = layers[0]
        n_keys, gated = first.histogram.shape[0], first.gated
        state = cls(len(layers), n_keys, first.top_k, device, gated, compiled_fold=compiled_fold)
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
