"""One memory's coefficient at every token of a text: the "try your own text" of a key page.

The same capture as mining (`hooks.capture`, fields=("coefficients",)) on the one layer asked for; the
forward pass stops once that layer's block has run (the later layers and the unembedding are not needed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel


class _Captured(Exception):
    """Raised by the hook after the layer asked for: the rest of the forward pass is skipped."""


def key_coefficients(loaded: LoadedModel, token_ids: Sequence[int], layer: int, key: int) -> torch.Tensor:
    """m_key of `layer` at every position of `token_ids` (one text, no padding): [pos] float32.

    The caller holds `loaded.lock` (the hooks go on the shared model)."""
    block = loaded.adapter.blocks(loaded.model)[layer]
    ids = torch.tensor([list(token_ids)], device=loaded.device)  # [1, pos]

    def stop(module, inputs, output):
        raise _Captured

    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, [layer], fields=("coefficients",)) as captured,
    ):
        handle = block.register_forward_hook(stop)  # after capture's own hook on the block: it runs last
        try:
            loaded.model.base_model(input_ids=ids, use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
        return captured.coefficients[layer][0, :, key].float()  # [pos]
