"""A trace of the tiny Llama computed by hand, without ffmem's hooks or interventions: plain PyTorch
hooks on the Llama modules edit m at the input of down_proj (off, scale or set, as the interventions
say) and record r (the input of post_attention_layernorm), m, y (the MLP's output) and o (the block's
output); the readout is lm_head(norm(x)) ("norm") or x·E ("raw"). The tests of the live view compare
ffmem's trace, with and without edits, against it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ffmem.engine.paper.cases import case_of


@dataclass
class HandLayer:
    top_r: int
    top_y: int
    top_o: int
    final_prob: float
    final_rank: int
    case: str
    settled: bool
    m: torch.Tensor  # [d_ff] the coefficients at the position


@dataclass
class HandTrace:
    prediction: int
    probs: torch.Tensor  # [vocab] the model's distribution after the position
    layers: list[HandLayer]
    active: list[list[int]]  # [layers][positions]
    ff_logit: list[list[float]]  # [layers][positions]


def trace_by_hand(loaded, ids: Sequence[int], position: int, readout: str = "norm", edits=()) -> HandTrace:
    blocks = loaded.model.model.layers
    seen: dict[str, dict[int, torch.Tensor]] = {"r": {}, "m": {}, "y": {}, "o": {}}

    def edit_and_keep(layer):
        def hook(module, inputs):
            m = inputs[0].clone()  # [1, pos, d_ff]
            for e in (e for e in edits if e.layer == layer):
                if e.mode == "off":
                    m[..., e.key] = 0.0
                elif e.mode == "scale":
                    m[..., e.key] *= e.value
                else:  # set
                    m[..., e.key] = e.value
            seen["m"][layer] = m[0]
            return (m,)

        return hook

    def keep(name, layer, pick):
        return lambda module, inputs, output=None: seen[name].__setitem__(layer, pick(inputs, output)[0])

    handles = []
    for layer, block in enumerate(blocks):
        handles += [
            block.mlp.down_proj.register_forward_pre_hook(edit_and_keep(layer)),
            block.post_attention_layernorm.register_forward_pre_hook(keep("r", layer, lambda i, o: i[0])),
            block.mlp.register_forward_hook(keep("y", layer, lambda i, o: o)),
            block.register_forward_hook(keep("o", layer, lambda i, o: o[0] if isinstance(o, tuple) else o)),
        ]
    try:
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([list(ids)])).logits[0]  # [pos, vocab]
    finally:
        for handle in handles:
            handle.remove()

    def lens(x):  # [..., d] → [..., vocab]
        if readout == "raw":
            return x @ loaded.model.lm_head.weight.T
        return loaded.model.lm_head(loaded.model.model.norm(x))

    p = position
    final = logits.argmax(-1)  # [pos]
    prediction = int(final[p])
    layers, active, ff_logit = [], [], []
    with torch.inference_mode():
        for layer in range(len(blocks)):
            r, y, o, m = (seen[name][layer] for name in "ryom")  # [pos, d] ×3, [pos, d_ff]
            read = lens(torch.stack([r[p], y[p], o[p]]))  # [3, vocab]
            top_r, top_y, top_o = read.argmax(-1).tolist()
            layers.append(
                HandLayer(
                    top_r=top_r,
                    top_y=top_y,
                    top_o=top_o,
                    final_prob=float(read[0].softmax(-1)[prediction]),
                    final_rank=int((read[0] > read[0][prediction]).sum()),
                    case=case_of(top_r, top_y, top_o),
                    settled=top_r == prediction,
                    m=m[p],
                )
            )
            active.append((m.abs() >= m.abs().max(-1, keepdim=True).values / 8).sum(-1).tolist())
            ff_logit.append((lens(o) - lens(r)).gather(1, final[:, None])[:, 0].tolist())
    return HandTrace(prediction, logits[p].softmax(-1), layers, active, ff_logit)
