"""Two runs side by side, the arithmetic (ffmem.worker.comparison reads the runs and stores the result):

- weights: per memory, the cosine of its key and of its value between two models of one shape (the same
  layers × keys and hidden size: another revision of one architecture, or the same model). Keys as
  ffmem.engine.relations.neighbours compares them: a plain FF's key k_i → cos(k_a, k_b); a gated FF's gate row
  g_i and up row u_i compared apart and together, their product cos(g_a, g_b)·cos(u_a, u_b) being the cosine
  of the rank-one form g·uᵀ (m_i ≈ xᵀ g_i u_iᵀ x where the gate is open), high only when both rows kept
  their direction. Values: cos(v_a, v_b). A zero row has cosine 0 with anything.
- triggers: how much of a key's top-T trigger set the other run shares, |A ∩ B| / max(|A|, |B|)
  (overlap@T when both hold T).

The weights are read to numpy once per model (`memory_weights`), so two models are never held at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ffmem.engine.errors import FfmemError
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.neighbours import key_factors, value_factors


@dataclass
class MemoryWeights:
    """Every memory's key and value rows of one model, float32 on the CPU."""

    keys: np.ndarray  # [layers, keys, d]: the key rows (the up rows of a gated FF)
    gates: np.ndarray | None  # [layers, keys, d]: the gate rows of a gated FF, else None
    values: np.ndarray  # [layers, keys, d]


@dataclass
class WeightCosines:
    """Per memory, the cosine of its rows between two models: [layers, keys] float64 each."""

    key: np.ndarray  # plain FF: cos(k); gated: cos(g)·cos(u)
    gate: np.ndarray | None  # gated FFs only
    up: np.ndarray | None  # gated FFs only (the same rows as `key` of a plain FF)
    value: np.ndarray

    @property
    def moved(self) -> np.ndarray:
        """1 − min(key, value cosine): 0 when neither row turned, up to 2 when one reversed. [layers, keys]"""
        return 1.0 - np.minimum(self.key, self.value)


def memory_weights(loaded: LoadedModel) -> MemoryWeights:
    """The model's key (and gate) and value rows, layer by layer."""
    with torch.inference_mode():
        factors = key_factors(loaded)  # [K] or [G, U], each [layers · keys, d]
        (values,) = value_factors(loaded)  # [layers · keys, d]
    shape = (loaded.n_layers, loaded.n_keys, -1)

    def rows(matrix: torch.Tensor) -> np.ndarray:
        return matrix.detach().float().cpu().numpy().reshape(shape)  # [layers, keys, d]

    gates = rows(factors[0]) if len(factors) == 2 else None
    return MemoryWeights(keys=rows(factors[-1]), gates=gates, values=rows(values))


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """cos(a[..., i, :], b[..., i, :]) for every row, in float64; 0 where either row is zero. [..., rows]"""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)  # [..., rows, d]
    dot = np.einsum("...d,...d->...", a64, b64)  # [..., rows]
    norms = np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1)  # [..., rows]
    return np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0)


def weight_cosines(a: MemoryWeights, b: MemoryWeights) -> WeightCosines:
    """Each memory's key (gate, up) and value cosine between `a` and `b`, a layer at a time."""
    if a.values.shape != b.values.shape or (a.gates is None) != (b.gates is None):
        gated = {"a": a.gates is not None, "b": b.gates is not None}
        raise FfmemError(
            f"the models differ in shape (layers, keys, d: {a.values.shape} and {b.values.shape}; gated: "
            f"{gated}): only models of one architecture and size can be compared memory by memory"
        )

    def per_layer(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.stack([row_cosines(x[layer], y[layer]) for layer in range(x.shape[0])])  # [layers, keys]

    up = per_layer(a.keys, b.keys)
    value = per_layer(a.values, b.values)
    if a.gates is None:
        return WeightCosines(key=up, gate=None, up=None, value=value)
    gate = per_layer(a.gates, b.gates)
    return WeightCosines(key=gate * up, gate=gate, up=up, value=value)


def overlap(a: Iterable[Hashable], b: Iterable[Hashable]) -> float | None:
    """|A ∩ B| / max(|A|, |B|) of two trigger sets (1: the same set); None when both are empty."""
    first, second = set(a), set(b)
    larger = max(len(first), len(second))
    return len(first & second) / larger if larger else None
