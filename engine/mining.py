"""Streaming trigger mining: per key, the top-T sentences by maximum (and minimum) coefficient.

The semantics follow the paper's code: for each sentence and key, the coefficient's maximum over
the sentence's positions and where it occurs (the argmax position; the trigger prefix is the
sentence up to and including it). Signed activations (GELU, SwiGLU) get the same treatment for
the most negative coefficient. Alongside, per key: a histogram over fixed bins, the sum (for the
mean) and the number of positive coefficients.

The state is bounded (T entries per key and sign, whatever the corpus size), mergeable (two
shards mined apart and merged equal one pass) and orderless: ties are broken by the sentence
index, so the result does not depend on batch size or split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.corpus import Batch, length_bucketed_batches
from engine.hooks import capture
from engine.loading import LoadedModel

SIGNS = (1, -1)  # +1: highest coefficients; −1: most negative


OCTAVES = 21  # magnitude bins per sign: |m| < 2^-9, [2^-9, 2^-8), …, [2^9, 2^10), ≥ 2^10
LOWEST_EXPONENT = 118  # float32 biased exponent of 2^-9


def histogram_edges() -> list[float]:
    """Bin edges shared by every key: −2^10 … −2^-9, 0, 2^-9 … 2^10 (one bin per octave and sign).

    Bins 0…20 hold negative coefficients by magnitude (bin 0: m ≤ −2^10), bins 21…41 the rest
    (bin 21: 0 ≤ m < 2^-9, bin 41: m ≥ 2^10). A value exactly on an edge goes to the bin of larger
    magnitude. Octave bins are read straight off the float's exponent bits, which keeps the
    histogram cheap enough to take over every mined position.
    """
    magnitudes = [2.0 ** e for e in range(-9, 11)]  # 20 edges per sign
    return [-m for m in reversed(magnitudes)] + [0.0] + magnitudes


def histogram_bins(flat: torch.Tensor) -> torch.Tensor:
    """Bin index (see histogram_edges) of each float32 coefficient: [n, keys] → [n, keys] int32."""
    code = flat.float().view(torch.int32) >> 23  # sign and biased exponent bits
    octave = (code & 255).sub_(LOWEST_EXPONENT - 1).clamp_(0, OCTAVES - 1)  # 0 … 20 by magnitude
    return torch.where(flat < 0, (OCTAVES - 1) - octave, OCTAVES + octave)  # −0.0 counts as 0


@dataclass
class TopK:
    """Running top-T of s·m per key: values [layers, keys, T], sentence and position of each."""

    values: torch.Tensor  # [layers, keys, T] float32, s·coefficient, −inf where empty
    sentence: torch.Tensor  # [layers, keys, T] int64, −1 where empty
    position: torch.Tensor  # [layers, keys, T] int64; while merging, −(row + 1) marks a new entry


class MiningState:
    """Everything mined so far: per sign a TopK, and the per-key statistics."""

    def __init__(self, n_layers: int, n_keys: int, top_k: int, device: torch.device | str = "cpu"):
        self.n_layers, self.n_keys, self.top_k = n_layers, n_keys, top_k
        shape = (n_layers, n_keys, top_k)
        self.top = {
            sign: TopK(
                values=torch.full(shape, float("-inf"), device=device),
                sentence=torch.full(shape, -1, dtype=torch.long, device=device),
                position=torch.zeros(shape, dtype=torch.long, device=device),
            )
            for sign in SIGNS
        }
        self.edges = histogram_edges()
        n_bins = 2 * OCTAVES
        self.histogram = torch.zeros((n_layers, n_keys, n_bins), dtype=torch.long, device=device)
        self.total = torch.zeros((n_layers, n_keys), dtype=torch.float64, device=device)
        self.positive = torch.zeros((n_layers, n_keys), dtype=torch.long, device=device)
        self.positions = 0  # mined positions (the denominator of every share)
        self.sentences = 0

    # -- update ---------------------------------------------------------------------------------
    def update(self, layer: int, coefficients: torch.Tensor, batch: Batch) -> None:
        """Fold one layer's coefficients for one batch into the state.

        `coefficients` is overwritten at padded and unmined positions (the forward pass is over).
        """
        c = coefficients if coefficients.dtype == torch.float32 else coefficients.float()  # [batch, pos, keys]
        unmined = ~batch.mined[..., None]  # [batch, pos, 1]
        rows = torch.arange(len(batch.sentence_index), device=c.device)  # [batch]
        for sign in SIGNS:
            # The sentence maximum of s·m; argmax only for the few (sentence, key) pairs that enter
            # the top-T, which keeps the full-width reduction a cheap amax.
            if sign == 1:
                best = c.masked_fill_(unmined, float("-inf")).amax(dim=1)  # [batch, keys]
            else:
                best = -c.masked_fill_(unmined, float("inf")).amin(dim=1)  # [batch, keys]
            candidates = TopK(
                values=best.T.unsqueeze(0),  # [1, keys, batch]
                sentence=batch.sentence_index[None, None, :].expand(1, self.n_keys, -1),  # [1, keys, batch]
                position=-(rows + 1)[None, None, :].expand(1, self.n_keys, -1),  # [1, keys, batch]
            )
            top = self.top[sign]
            _merge_into(top, candidates, layer, self.top_k)
            key, slot = (top.position[layer] < 0).nonzero(as_tuple=True)  # [new] each
            if len(key):
                row = -top.position[layer, key, slot] - 1  # [new]
                per_position = c[row, :, key]  # [new, pos]
                where = per_position.argmax(dim=1) if sign == 1 else per_position.argmin(dim=1)
                top.position[layer, key, slot] = where
        flat = c[batch.mined]  # [positions, keys]
        self.total[layer] += flat.sum(dim=0).double()
        self.positive[layer] += torch.count_nonzero(flat > 0, dim=0)
        n_bins = self.histogram.shape[-1]
        bins = histogram_bins(flat).long()  # [positions, keys]
        bins += torch.arange(self.n_keys, device=bins.device) * n_bins
        self.histogram[layer] += torch.bincount(bins.view(-1), minlength=self.n_keys * n_bins).view(
            self.n_keys, n_bins
        )

    def count(self, batch: Batch) -> None:
        """Count a batch's positions and sentences once (after its layers were folded in)."""
        self.positions += int(batch.mined.sum())
        self.sentences += len(batch.sentence_index)

    # -- merge and checkpoint -------------------------------------------------------------------
    def merge(self, other: MiningState) -> MiningState:
        """Fold another shard's state into this one (in place) and return self."""
        if (other.n_layers, other.n_keys, other.top_k) != (self.n_layers, self.n_keys, self.top_k):
            raise ValueError("cannot merge mining states of different shapes")
        for sign in SIGNS:
            theirs = other.top[sign]
            for layer in range(self.n_layers):
                _merge_into(
                    self.top[sign],
                    TopK(*(t[layer : layer + 1].to(self.total.device) for t in (theirs.values, theirs.sentence, theirs.position))),
                    layer,
                    self.top_k,
                )
        self.histogram += other.histogram.to(self.histogram.device)
        self.total += other.total.to(self.total.device)
        self.positive += other.positive.to(self.positive.device)
        self.positions += other.positions
        self.sentences += other.sentences
        return self

    def state_dict(self) -> dict:
        state = {
            "shape": (self.n_layers, self.n_keys, self.top_k),
            "histogram": self.histogram.cpu(),
            "total": self.total.cpu(),
            "positive": self.positive.cpu(),
            "positions": self.positions,
            "sentences": self.sentences,
        }
        for sign in SIGNS:
            top = self.top[sign]
            state[f"top{sign:+d}"] = (top.values.cpu(), top.sentence.cpu(), top.position.cpu())
        return state

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str = "cpu") -> MiningState:
        mined = cls(*state["shape"], device=device)
        for sign in SIGNS:
            mined.top[sign] = TopK(*(t.to(device) for t in state[f"top{sign:+d}"]))
        mined.histogram = state["histogram"].to(device)
        mined.total = state["total"].to(device)
        mined.positive = state["positive"].to(device)
        mined.positions, mined.sentences = state["positions"], state["sentences"]
        return mined

    # -- results --------------------------------------------------------------------------------
    def triggers(self, layer: int, sign: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(coefficients, sentence index, position), each [keys, T]; sentence −1 marks empty slots."""
        top = self.top[sign]
        values = top.values[layer]  # [keys, T]
        sentence = top.sentence[layer].masked_fill(torch.isinf(values), -1)  # [keys, T]
        return (sign * values).cpu(), sentence.cpu(), top.position[layer].cpu()

    def mean(self, layer: int) -> torch.Tensor:
        return (self.total[layer] / max(self.positions, 1)).cpu()  # [keys]

    def positive_share(self, layer: int) -> torch.Tensor:
        return (self.positive[layer].double() / max(self.positions, 1)).cpu()  # [keys]


def _merge_into(state: TopK, candidates: TopK, layer: int, top_k: int) -> None:
    """Keep the top-T of state ∪ candidates for one layer, ordered by value desc, sentence asc."""
    values = torch.cat([state.values[layer], candidates.values[0]], dim=1)  # [keys, T + n]
    sentence = torch.cat([state.sentence[layer], candidates.sentence[0]], dim=1)  # [keys, T + n]
    position = torch.cat([state.position[layer], candidates.position[0]], dim=1)  # [keys, T + n]
    # Two stable sorts give a total order: by value, ties by sentence index (empty slots last).
    by_sentence = torch.where(sentence < 0, torch.iinfo(torch.long).max, sentence).argsort(dim=1, stable=True)
    values, sentence, position = (t.gather(1, by_sentence) for t in (values, sentence, position))
    by_value = values.argsort(dim=1, descending=True, stable=True)[:, :top_k]  # [keys, T]
    state.values[layer] = values.gather(1, by_value)
    state.sentence[layer] = sentence.gather(1, by_value)
    state.position[layer] = position.gather(1, by_value)


def mine_batches(
    loaded: LoadedModel,
    batches: Iterable[Batch],
    state: MiningState,
    on_batch: Callable[[Batch], None] | None = None,
) -> MiningState:
    """Run each batch through the model (no unembedding) and fold every layer's coefficients in."""
    backbone = loaded.model.base_model
    with torch.inference_mode(), capture(loaded.model, loaded.adapter, fields=("coefficients",)) as captured:
        for batch in batches:
            batch = batch.to(loaded.device)
            backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
            for layer, coefficients in captured.coefficients.items():
                state.update(layer, coefficients, batch)  # coefficients: [batch, pos, keys]
            captured.clear()
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
) -> list[Batch]:
    """The length-bucketed batches of shard number `shard` (sentences shard·S … (shard+1)·S − 1)."""
    start = shard * shard_sentences
    stop = min(start + shard_sentences, len(token_ids))
    return list(
        length_bucketed_batches(
            token_ids[start:stop], first_positions[start:stop], start=start, batch_tokens=batch_tokens, pad_id=pad_id
        )
    )
