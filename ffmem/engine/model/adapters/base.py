"""What an adapter says about an architecture family: where the FF memories live.

Paths are dotted attribute paths: model-level ones from the *ForCausalLM module, block-level
ones from one decoder block. Keys and values come back as rows, one per memory, whatever the
weight layout (nn.Linear stores [out, in], GPT-2's Conv1D stores [in, out]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig


def resolve(root: nn.Module, path: str) -> nn.Module:
    """`resolve(model, "model.layers")` → model.model.layers."""
    module = root
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def rows_out(module: nn.Module) -> torch.Tensor:
    """One row per output feature: [out, in]."""
    return module.weight if _is_linear(module) else module.weight.T


def rows_in(module: nn.Module) -> torch.Tensor:
    """One row per input feature: [in, out]."""
    return module.weight.T if _is_linear(module) else module.weight


@dataclass(frozen=True)
class Adapter:
    family: str
    architectures: tuple[str, ...]  # HF class names this adapter serves
    layers: str  # model → ModuleList of decoder blocks
    keys: str  # block → projection x·K (up projection for gated FFs)
    values: str  # block → projection m·V + b: its input is the coefficients, its output is y
    final_norm: str  # model → norm applied before the unembedding
    unembedding: str  # model → Linear whose weight is E [vocab, d]
    activation: Callable[[PretrainedConfig], str]
    ff_norm: str | None = None  # block → norm whose input is r (sequential blocks)
    gates: str | None = None  # block → gate projection of a gated FF (act(x·g)·(x·u))
    parallel: Callable[[PretrainedConfig], bool] = lambda config: False  # attention ∥ FF (GPT-J)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(resolve(model, self.layers))

    def key_matrix(self, block: nn.Module) -> torch.Tensor:
        """K: [d_ff, d]; row i is key i (the up projection's row for gated FFs)."""
        return rows_out(resolve(block, self.keys))

    def gate_matrix(self, block: nn.Module) -> torch.Tensor | None:
        """G: [d_ff, d] for gated FFs, else None."""
        return rows_out(resolve(block, self.gates)) if self.gates else None

    def value_matrix(self, block: nn.Module) -> torch.Tensor:
        """V: [d_ff, d]; row i is value i."""
        return rows_in(resolve(block, self.values))

    def value_bias(self, block: nn.Module) -> torch.Tensor | None:
        return resolve(block, self.values).bias  # [d] or None

    def value_projection(self, block: nn.Module) -> nn.Module:
        return resolve(block, self.values)

    def residual_norm(self, model: nn.Module, block: nn.Module) -> nn.Module | None:
        """The module whose input is r, or None when r must be derived as o − y (parallel blocks)."""
        if self.parallel(model.config) or self.ff_norm is None:
            return None
        return resolve(block, self.ff_norm)
