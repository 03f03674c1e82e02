"""Who pushes this token, here: each memory's direct contribution to one target token's logit at the
selected position of a traced forward pass (issue 17; called by ffmem.engine.live.trace).

raw readout (the paper's r·E): c_i = m_i · (v_i · e_t), e_t the target's row of the output embedding E.
    Per layer Σ_i c_i + b·e_t = y·e_t exactly (b: the FF's output bias, none in gated models), and y·e_t
    is the FF's change to the target's logit in the raw lens: `change` − (`memories_sum` + `bias`) is
    float error only.
norm readout (the model's own path lm_head(final_norm(x))): the final norm is split as
    final_norm(x) = linear(x)·scale(x) + bias (ffmem.engine.values.projection.norm_parts) and linearized at
    the actual final residual x_L (the last layer's output at the position): with scale(x) held at
    scale(x_L), the target's logit is x·g_t + constants, g_t = scale(x_L)·linearᵀ(e_t) — RMSNorm:
    scale·(w⊙e_t); LayerNorm: scale·(w⊙e_t − mean(w⊙e_t)). Folded into g_t: the norm's weight w, its
    centring (LayerNorm) and its scale at x_L. Not folded: the norm's bias and the unembedding's bias
    (constants, no memory's). c_i = m_i · (v_i · g_t). Per layer Σ_i c_i + b·g_t = y·g_t (`direct`:
    the FF output's direct effect on the model's logit) exactly; the FF's change to the target's logit
    in the norm lens, lens(o)[t] − lens(r)[t], reads r and o each at its own scale, so it differs from
    `direct` by the norm's non-linearity: `residual` = `change` − (`memories_sum` + `bias`) says how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import norm_parts, readout_input


@dataclass
class Contribution:
    layer: int
    key: int
    coefficient: float  # m_i at the position (edited, with interventions)
    value_logit: float  # v_i·e_t (raw) or v_i·g_t (norm): the target's logit in the value
    contribution: float  # c_i = m_i · value_logit: > 0 promotes the target, < 0 suppresses it


@dataclass
class LayerAttribution:
    layer: int
    memories: list[Contribution]  # the layer's largest |c_i|, largest first
    memories_sum: float  # Σ_i c_i over all the layer's memories (S_ℓ)
    bias: float  # b·e_t or b·g_t: the FF's output bias (0 without one)
    direct: float  # y·e_t or y·g_t: the FF output's direct effect (= memories_sum + bias)
    change: float  # the FF's change to the target's logit lens: lens(o)[t] − lens(r)[t] (raw: y·e_t)
    residual: float  # change − (memories_sum + bias): float error (raw), the norm's non-linearity (norm)


@dataclass
class Attribution:
    target: int  # the token attributed
    readout: str
    logit: float  # its logit after the position: the model's own (norm) or x_L·e_t (raw)
    scale: float | None  # norm: the final norm's scale at x_L, folded into every contribution
    total: float  # Σ c_i over every memory of every layer
    layers: list[LayerAttribution]
    promoters: list[Contribution]  # the largest c_i > 0 over all layers, largest first
    suppressors: list[Contribution]  # the most negative c_i < 0, most negative first


def target_direction(
    loaded: LoadedModel, target: int, final: torch.Tensor, readout: str
) -> tuple[torch.Tensor, float | None]:
    """(e_t (raw) or g_t = scale(x_L)·linearᵀ(e_t) (norm) [d], scale(x_L) or None), with `final` = x_L
    [d]: the vector whose dot product with anything written into the last residual is its direct
    effect on the target's logit."""
    e = resolve(loaded.model, loaded.adapter.unembedding).weight[target].float()  # [d]
    if readout == "raw":
        return e, None
    d = e.shape[0]
    rows = norm_parts(loaded, torch.eye(d, device=e.device))[0]  # [d, d]: row j = linear(unit j)
    scale = norm_parts(loaded, final[None].float())[1][0, 0]  # []: scale(x_L)
    return scale * (rows @ e), float(scale)  # [d]: linear(u)·e_t = Σ_j u_j·(linear(unit j)·e_t)


def attribute(
    loaded: LoadedModel,
    layers: Sequence[int],
    m: torch.Tensor,
    r: torch.Tensor,
    y: torch.Tensor,
    o: torch.Tensor,
    target: int,
    readout: str,
    k: int,
) -> Attribution:
    """Attribute `target`'s logit to the memories of `layers`, from one forward pass at the position:
    m [layers, d_ff] the coefficients, r, y and o [layers, d] the residual before the FF, the FF output
    and the layer output; the `k` largest per layer and each way overall."""
    blocks = loaded.adapter.blocks(loaded.model)
    g, scale = target_direction(loaded, target, o[-1], readout)  # [d]
    value_logit = torch.stack(
        [loaded.adapter.value_matrix(blocks[layer]).float() @ g for layer in layers]
    )  # [layers, d_ff]
    c = m.float() * value_logit  # [layers, d_ff]
    biases = [loaded.adapter.value_bias(blocks[layer]) for layer in layers]
    bias = torch.stack(
        [torch.zeros((), device=g.device) if b is None else b.float() @ g for b in biases]
    )  # [layers]
    direct = y.float() @ g  # [layers]
    if readout == "raw":
        change = direct  # [layers]: the raw lens is linear
    else:
        e = resolve(loaded.model, loaded.adapter.unembedding).weight[target].float()  # [d]
        lens = readout_input(loaded, torch.stack([o, r]), "norm").float() @ e  # [2, layers]
        change = lens[0] - lens[1]  # [layers]: the biases cancel
    memories_sum = c.sum(dim=-1)  # [layers]
    residual = change - (memories_sum + bias)  # [layers]
    logit = _target_logit(loaded, o[-1], target, readout)

    n_keys = c.shape[1]
    best = c.abs().topk(min(k, n_keys), dim=-1).indices  # [layers, k]
    flat = c.flatten()  # [layers·d_ff]
    n = min(k, flat.numel())
    up, down = flat.topk(n), (-flat).topk(n)  # the largest and the most negative
    overall = torch.cat([up.indices[up.values > 0], down.indices[down.values > 0]])  # [≤ 2k]
    picked = torch.cat(
        [(best + torch.arange(len(layers), device=c.device)[:, None] * n_keys).flatten(), overall]
    )
    columns = torch.stack([m.float().flatten()[picked], value_logit.flatten()[picked], c.flatten()[picked]])
    # One transfer to Python for everything listed: [3, layers·k + ≤ 2k] and the per-layer figures.
    coefficient, read, contribution = columns.tolist()
    where = picked.tolist()
    per_layer = torch.stack([memories_sum, bias, direct, change, residual]).tolist()  # [5][layers]
    listed = [
        Contribution(layers[i // n_keys], i % n_keys, *values)
        for i, values in zip(where, zip(coefficient, read, contribution, strict=True), strict=True)
    ]
    width, promoted = best.shape[1], int((up.values > 0).sum())
    rows = [
        LayerAttribution(
            layer,
            listed[i * width : (i + 1) * width],
            *(figure[i] for figure in per_layer),
        )
        for i, layer in enumerate(layers)
    ]
    start = len(layers) * width
    return Attribution(
        target=target,
        readout=readout,
        logit=logit,
        scale=scale,
        total=float(memories_sum.sum()),
        layers=rows,
        promoters=listed[start : start + promoted],
        suppressors=listed[start + promoted :],
    )


def _target_logit(loaded: LoadedModel, final: torch.Tensor, target: int, readout: str) -> float:
    """The target's logit read from x_L ([d]): the model's own under norm, x_L·e_t under raw."""
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    read = readout_input(loaded, final[None], readout).float()  # [1, d]
    logit = read[0] @ unembedding.weight[target].float()
    if readout == "norm" and unembedding.bias is not None:
        logit = logit + unembedding.bias[target].float()
    return float(logit)
