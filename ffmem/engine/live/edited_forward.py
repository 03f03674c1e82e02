"""`with intervene(loaded, interventions):` — memories switched off, forced on or scaled.

Each intervention edits its coefficient m_i at every position, at the input of the value
projection, so the layer's FF output changes by exactly (m_i' − m_i)·v_i. Hooks are removed when
the block exits, also after an exception. Entered before `capture`, the captured coefficients are
the edited ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from ffmem.engine.live.interventions import Intervention
from ffmem.engine.model.loaded import LoadedModel


@contextmanager
def intervene(loaded: LoadedModel, interventions: Sequence[Intervention]) -> Iterator[None]:
    by_layer: dict[int, list[Intervention]] = defaultdict(list)
    for intervention in interventions:
        by_layer[intervention.layer].append(intervention)
    blocks = loaded.adapter.blocks(loaded.model)
    handles = []
    try:
        for layer, edits in by_layer.items():
            projection = loaded.adapter.value_projection(blocks[layer])
            handles.append(projection.register_forward_pre_hook(_edit(edits)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _edit(edits: list[Intervention]):
    def hook(module, inputs):
        coefficients = inputs[0].clone()  # [batch, pos, d_ff] ([batch·pos, d_ff] for OPT)
        for edit in edits:
            coefficients[..., edit.key] = edit.apply(coefficients[..., edit.key])
        return (coefficients, *inputs[1:])

    return hook


def generate(
    loaded: LoadedModel, token_ids: Sequence[int], n: int, interventions: Sequence[Intervention] = ()
) -> list[int]:
    """The `n` tokens greedy decoding appends to `token_ids` (fewer if it reaches end of text)."""
    ids = torch.tensor([list(token_ids)], device=loaded.device)  # [1, pos]
    eos = loaded.tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=False, max_new_tokens=n, pad_token_id=loaded.tokenizer.pad_token_id or eos, eos_token_id=eos
    )
    with torch.inference_mode(), intervene(loaded, interventions):
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1] :].tolist()
