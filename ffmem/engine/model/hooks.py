"""`with capture(model, adapter, layers) as captured:` — FF memories read off a forward pass.

Per layer ℓ, after one forward pass inside the block:
- captured.coefficients[ℓ]  m: the input of the value projection          [batch, pos, d_ff]
- captured.ff_output[ℓ]     y = m·V (+ b): the FF output                   [batch, pos, d]
- captured.residual[ℓ]      r: the residual stream the FF adds to          [batch, pos, d]
- captured.layer_output[ℓ]  o = r + y: the block's output                  [batch, pos, d]
- captured.inputs[ℓ]        x·u: a gated FF's input (up) projection        [batch, pos, d_ff]
                            (m = act(x·g)·(x·u)); only for gated FFs
For parallel blocks (GPT-J, Pythia) r is the residual plus attention, i.e. o − y.
Hooks are removed when the block exits, also after an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ffmem.engine.model.adapters import Adapter
from ffmem.engine.model.adapters.base import resolve

FIELDS = ("coefficients", "ff_output", "residual", "layer_output", "inputs")


@dataclass
class Captured:
    coefficients: dict[int, torch.Tensor] = field(default_factory=dict)
    ff_output: dict[int, torch.Tensor] = field(default_factory=dict)
    residual: dict[int, torch.Tensor] = field(default_factory=dict)
    layer_output: dict[int, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        for name in FIELDS:
            getattr(self, name).clear()


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def capture(
    model: nn.Module,
    adapter: Adapter,
    layers: Iterable[int] | None = None,
    fields: Iterable[str] = FIELDS,
    on_coefficients: Callable[[int, torch.Tensor], None] | None = None,
) -> Iterator[Captured]:
    """Capture `fields` of `layers` (default all) on every forward pass inside the block.

    With `on_coefficients`, each layer's coefficients are handed to it as soon as the block has
    run, instead of being kept: one layer's [batch, pos, d_ff] is alive at a time, and the callee
    may overwrite the tensor (the forward pass no longer needs it). A gated FF's `inputs` of the layer,
    where captured, are in `captured.inputs` while it runs (and dropped after).
    """
    fields = set(fields)
    unknown = fields - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown capture fields {sorted(unknown)}; choose from {FIELDS}")
    blocks = adapter.blocks(model)
    layers = range(len(blocks)) if layers is None else list(layers)
    captured = Captured()
    # o − y gives r for every block; capturing r directly is only needed where a norm's input is r.
    need_y = bool(fields & {"ff_output", "residual"})
    need_o = "layer_output" in fields or "residual" in fields
    handles = []
    try:
        for layer in layers:
            block = blocks[layer]
            projection = adapter.value_projection(block)
            if "coefficients" in fields:
                handles.append(
                    projection.register_forward_pre_hook(_store_input(captured.coefficients, layer))
                )
            if need_y:
                handles.append(projection.register_forward_hook(_store_output(captured.ff_output, layer)))
            if "inputs" in fields and adapter.gates is not None:
                keys = resolve(block, adapter.keys)
                handles.append(keys.register_forward_hook(_store_output(captured.inputs, layer)))
            norm = adapter.residual_norm(model, block)
            if "residual" in fields and norm is not None:
                handles.append(norm.register_forward_pre_hook(_store_input(captured.residual, layer)))
            # Always hooked: it also gives [batch, pos, ·] back to tensors the block flattened (OPT).
            derive_r = "residual" in fields and norm is None
            on_output = _store_block_output(captured, layer, need_o, derive_r, on_coefficients)
            handles.append(block.register_forward_hook(on_output))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _store_input(store: dict[int, torch.Tensor], layer: int):
    def hook(module, inputs):
        store[layer] = inputs[0]

    return hook


def _store_block_output(
    captured: Captured,
    layer: int,
    keep_output: bool,
    derive_residual: bool,
    on_coefficients: Callable[[int, torch.Tensor], None] | None,
):
    def hook(module, inputs, output):
        o = _first(output)  # [batch, pos, d]
        for store in (captured.coefficients, captured.ff_output, captured.residual, captured.inputs):
            if layer in store:  # OPT runs its FF on [batch·pos, ·] rows
                store[layer] = store[layer].reshape(*o.shape[:-1], -1)  # [batch, pos, d_ff or d]
        if keep_output:
            captured.layer_output[layer] = o
        if derive_residual:
            captured.residual[layer] = o - captured.ff_output[layer]
        if on_coefficients is not None and layer in captured.coefficients:
            on_coefficients(layer, captured.coefficients.pop(layer))
            captured.inputs.pop(layer, None)

    return hook


def _store_output(store: dict[int, torch.Tensor], layer: int):
    def hook(module, inputs, output):
        store[layer] = _first(output)

    return hook
