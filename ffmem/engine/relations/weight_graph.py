"""Which memories feed which: the direct path from a memory's value to a later layer's key, in the weights.

Memory j of layer ℓ' writes m_j·v_j into the residual stream; a memory i of a later layer ℓ reads the
stream through that layer's FF input norm, N(x) = w∘x / rms(x) (RMSNorm) or w∘(x − mean x) / σ(x)
(LayerNorm, plus a bias that does not depend on x). So along the direct path (the residual, skipping
the attention and FF layers between) one unit of m_j moves a pre-activation x̂·k_i by v_j·k̃_i / rms(x),
with k̃_i = w∘k_i (LayerNorm: centred, k̃_i − mean k̃_i, because the norm subtracts the mean). The
positive 1/rms(x) changes no sign and no ranking, so it is left out.

**The score of j → i** (`read_vectors` gives each key's r_i, the score is v_j·r_i):

- plain FFs, m_i = act(x̂·k_i + b_i): score = v_j·k̃_i, the change of the pre-activation, which moves
  m_i the same way wherever the key is active (act' > 0 there: ReLU, GELU);
- gated FFs, m_i = act(a)·b with a = x̂·g_i (gate) and b = x̂·u_i (up): a write changes both, and m_i
  by act'(a)·b·δa + act(a)·δb. Where the key fires (its positive triggers: gate open, a > 0, act(a) ≈ a,
  act'(a) ≈ 1, and b > 0) this is b·δa + a·δb: the two reads weighted by each other. With no input to
  take a and b from, the score takes them at the reference point where the normalized input has one
  unit of projection on each direction, a = ‖g̃_i‖ and b = ‖ũ_i‖:
      score = ‖ũ_i‖ (v_j·g̃_i) + ‖g̃_i‖ (v_j·ũ_i) = v_j·r_i,   r_i = ‖ũ_i‖ g̃_i + ‖g̃_i‖ ũ_i.
  It is the first-order change of m_i per unit of m_j there (up to the positive 1/rms(x)); the sum
  keeps the sign right when the two reads disagree (a write that opens the gate but lowers b), which
  neither dot product alone does, and it is linear in v_j, so one matrix product scores every pair.

A positive score: a positive m_j raises key i's coefficient (a negative m_j lowers it); ranking is by
|score|. bench/weight_graph.py checks on the real model that ablating j moves m_i the predicted way.

`weight_graph` scores every (earlier value, later key) pair in blocks of writer layers (one [writers,
d_ff] product at a time) and keeps, for every key, the `n` earlier memories writing most into it
(inbound) and, for every memory, the `n` later keys reading its value most (outbound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel

TOP = 10  # memories kept each way
PRODUCT_ELEMENTS = 2**26  # the largest [writers, d_ff] block of scores: 256 MiB of float32 (and its |·|)


@dataclass
class WeightGraph:
    """Per memory (layer, key), the `n` strongest links each way, strongest first by |score|.

    inbound: earlier memories whose value writes into this key; outbound: later keys that read this
    value. Slots past the available (layer 0 has no inbound, the last layer no outbound) hold layer −1.
    """

    inbound_layer: torch.Tensor  # [layers, d_ff, n] int64
    inbound_key: torch.Tensor  # [layers, d_ff, n] int64
    inbound_score: torch.Tensor  # [layers, d_ff, n] float32
    outbound_layer: torch.Tensor  # [layers, d_ff, n] int64
    outbound_key: torch.Tensor  # [layers, d_ff, n] int64
    outbound_score: torch.Tensor  # [layers, d_ff, n] float32


def input_norm(loaded: LoadedModel, block: nn.Module) -> nn.Module:
    """The norm the FF reads the residual stream through (GPT-J: ln_1, shared with attention)."""
    return resolve(block, loaded.adapter.ff_norm or "ln_1")


def fold_norm(norm: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """Rows k as the residual stream sees them through `norm`: w∘k, centred for a LayerNorm.
    [n, d] → [n, d] float32."""
    rows = rows.float()
    weight = getattr(norm, "weight", None)
    folded = rows if weight is None else rows * weight.float()  # [n, d]
    if isinstance(norm, nn.LayerNorm) or type(norm).__name__.endswith("LayerNorm"):
        folded = folded - folded.mean(dim=-1, keepdim=True)  # (x − mean x)·k = x·(k − mean k)
    return folded


def read_vectors(loaded: LoadedModel, layer: int) -> torch.Tensor:
    """r_i of every key of `layer` (see the module docstring): [d_ff, d] float32."""
    adapter = loaded.adapter
    block = adapter.blocks(loaded.model)[layer]
    norm = input_norm(loaded, block)
    with torch.inference_mode():
        up = fold_norm(norm, adapter.key_matrix(block))  # [d_ff, d]
        gates = adapter.gate_matrix(block)
        if gates is None:
            return up
        gate = fold_norm(norm, gates)  # [d_ff, d]
        return up.norm(dim=-1, keepdim=True) * gate + gate.norm(dim=-1, keepdim=True) * up  # [d_ff, d]


def value_vectors(loaded: LoadedModel, layer: int) -> torch.Tensor:
    """v_j of every memory of `layer`: [d_ff, d] float32."""
    block = loaded.adapter.blocks(loaded.model)[layer]
    with torch.inference_mode():
        return loaded.adapter.value_matrix(block).float()


def _keep(scores: torch.Tensor, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` entries of largest |score| per row: ([rows, n] scores, [rows, n] ids), strongest first."""
    order = scores.abs().topk(min(n, scores.shape[1]), dim=1).indices  # [rows, n]
    return scores.gather(1, order), ids.gather(1, order)


def _merge(kept: tuple, found: tuple, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `n` of two ([rows, ·] scores, [rows, ·] ids) lists, row by row."""
    return _keep(torch.cat([kept[0], found[0]], 1), torch.cat([kept[1], found[1]], 1), n)


def _no_links(rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, 0, device=device), torch.zeros(rows, 0, dtype=torch.long, device=device)


def top_per_column(magnitude: torch.Tensor, n: int, group: int = 16) -> torch.Tensor:
    """Rows of the `n` largest entries of each column, largest first: [rows, cols] → [n, cols].

    The same as `magnitude.topk(n, dim=0).indices`, about three times faster on a CPU, whose topk down a
    column is slow: the rows are cut into groups of `group`, each column's `n` groups of largest maximum
    are found first (every one of its top `n` entries lies in one of them), then its top `n` among their
    n·group entries.
    """
    rows, cols = magnitude.shape
    if rows % group or rows < n * group:
        return magnitude.topk(min(n, rows), dim=0).indices
    maxima = magnitude.view(rows // group, group, cols).amax(dim=1)  # [rows / group, cols]
    groups = maxima.topk(n, dim=0).indices  # [n, cols]
    offsets = torch.arange(group, device=magnitude.device)[None, :, None]  # [1, group, 1]
    candidates = (groups[:, None, :] * group + offsets).reshape(n * group, cols)  # [n·group, cols]
    best = magnitude.gather(0, candidates).topk(n, dim=0).indices  # [n, cols]
    return candidates.gather(0, best)


def weight_graph(
    loaded: LoadedModel,
    n: int = TOP,
    block_layers: int | None = None,
    device: torch.device | str | None = None,
) -> WeightGraph:
    """Score every earlier value against every later key and keep the top `n` each way.

    Writers are taken `block_layers` layers at a time against one reader layer: one [block·d_ff, d] ×
    [d, d_ff] product, its top `n` per column (inbound) and per row (outbound) merged into the running
    top `n`. Ids are flat: layer·d_ff + key. By default as many layers (at most 8) as keep the product
    within PRODUCT_ELEMENTS: 8 for SmolLM2 (1,536 keys a layer), 1 from 8,192 (Llama-3.2-1B) on. The
    values are the model's own weights, a block copied to float32 as it is scored.
    """
    device = torch.device(device) if device is not None else loaded.device
    n_layers, d_ff = loaded.n_layers, loaded.n_keys
    block_layers = block_layers or max(1, min(8, PRODUCT_ELEMENTS // (d_ff * d_ff)))
    inbound = [_no_links(d_ff, device)]  # per reader layer: ([d_ff, ≤ n] scores, [d_ff, ≤ n] flat ids)
    outbound = [_no_links(d_ff, device) for _ in range(n_layers)]  # per writer layer, the same
    with torch.inference_mode():
        blocks = loaded.adapter.blocks(loaded.model)
        values = [loaded.adapter.value_matrix(b).to(device) for b in blocks]  # L × [d_ff, d]
        # One buffer each for a block's writers, scores and |scores|, reused block after block: fresh
        # ones would be mapped from the system and faulted in page by page at every block.
        rows = min(block_layers, n_layers - 1) * d_ff
        buffers = _Buffers(rows, values[0].shape[1], d_ff, device)
        for reader in range(1, n_layers):
            reads = read_vectors(loaded, reader).to(device)  # [d_ff, d]
            best_in = _no_links(d_ff, device)
            for start in range(0, reader, block_layers):
                stop = min(start + block_layers, reader)
                writers, scores, magnitude = buffers.block(values[start:stop])  # [w, d], [w, d_ff] ×2
                torch.matmul(writers, reads.T, out=scores)  # [writers, d_ff]
                torch.abs(scores, out=magnitude)  # [writers, d_ff]
                first = start * d_ff
                # inbound: per reader key (a column), the writers with the largest |score|
                top = top_per_column(magnitude, n)  # [n, d_ff]
                found = (scores.gather(0, top).T, (first + top).T)  # [d_ff, n] each
                best_in = _merge(best_in, found, n)
                # outbound: per writer (a row), the reader keys with the largest |score|
                columns = magnitude.topk(min(n, d_ff), dim=1).indices  # [writers, n]
                found = (scores.gather(1, columns), reader * d_ff + columns)  # [writers, n] each
                for offset, layer in enumerate(range(start, stop)):
                    kept = slice(offset * d_ff, (offset + 1) * d_ff)
                    outbound[layer] = _merge(outbound[layer], (found[0][kept], found[1][kept]), n)
            inbound.append(best_in)
    return WeightGraph(*_unflatten(inbound, n, d_ff), *_unflatten(outbound, n, d_ff))


class _Buffers:
    """A block's float32 writers [rows, d], scores and |scores| [rows, d_ff], allocated once."""

    def __init__(self, rows: int, d: int, d_ff: int, device) -> None:
        self.writers = torch.empty(rows, d, device=device)
        self.scores = torch.empty(rows, d_ff, device=device)
        self.magnitude = torch.empty(rows, d_ff, device=device)

    def block(self, values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The writers `values` (each [d_ff, d]) copied in float32 into the first rows, and those rows of
        the score buffers."""
        rows = 0
        for value in values:
            self.writers[rows : rows + len(value)].copy_(value)  # [d_ff, d], in float32
            rows += len(value)
        return self.writers[:rows], self.scores[:rows], self.magnitude[:rows]


def _unflatten(
    per_layer: list[tuple[torch.Tensor, torch.Tensor]], n: int, d_ff: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer ([d_ff, ≤ n] scores, flat ids) → ([L, d_ff, n] layers, keys, scores); missing slots
    get layer −1, key −1, score 0."""
    n_layers = len(per_layer)
    layers = torch.full((n_layers, d_ff, n), -1, dtype=torch.long)
    keys = torch.full((n_layers, d_ff, n), -1, dtype=torch.long)
    scores = torch.zeros(n_layers, d_ff, n)
    for layer, (kept_scores, kept_ids) in enumerate(per_layer):
        width = kept_ids.shape[1]
        layers[layer, :, :width] = (kept_ids // d_ff).cpu()
        keys[layer, :, :width] = (kept_ids % d_ff).cpu()
        scores[layer, :, :width] = kept_scores.float().cpu()
    return layers, keys, scores
