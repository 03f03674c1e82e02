"""One prompt, one forward pass: how the FF memories build the prediction, layer by layer (§5.1–5.2).

For the selected position and every layer ℓ, read through the model's output embedding (the
`readout`: "norm" = the model's own final norm + unembedding, so the last layer's top(o) is the
model's prediction; "raw" = the paper's r·E):
- top(r)  the residual before the FF, top(y) the FF output, top(o) the layer output o = r + y;
- the probability and rank of the final prediction under r (the paper's Fig. 10);
- the case: agreement (all three equal), residual (top(o) = top(r)), ffn (top(o) = top(y)),
  composition (none);
- the memories ranked by |m_i|·‖v_i‖, with their signed coefficients.
Over all layers × positions: the number of active memories and the FF's share of the logit of each
position's final prediction (lens(o)[t] − lens(r)[t], = y·e_t for the raw readout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.adapters.base import resolve
from engine.cases import case_of
from engine.hooks import capture
from engine.intervene import generate, intervene
from engine.interventions import Intervention
from engine.loading import LoadedModel
from engine.projection import readout_input, value_logits

ACTIVE_RATIO = 2.0**-3  # active: |m_i| within 3 octaves of the position's strongest memory (cf. density)


@dataclass
class Memory:
    layer: int
    key: int
    coefficient: float  # m_i at the position (signed)
    score: float  # |m_i|·‖v_i‖: the size of its contribution to y
    tokens: list[int] = field(default_factory=list)  # top tokens of sign(m_i)·v_i, when asked for


@dataclass
class LayerTrace:
    layer: int
    top_r: int
    top_y: int
    top_o: int
    final_prob: float  # probability of the final prediction under r
    final_rank: int  # its 0-based rank under r
    case: str
    settled: bool  # top(r) is already the final prediction
    memories: list[Memory]


@dataclass
class TokenChange:
    token_id: int
    before: float  # probability without the interventions
    after: float  # with them


@dataclass
class Trace:
    token_ids: list[int]
    position: int
    readout: str
    prediction: int  # the model's top token after `position`
    top_tokens: list[TokenChange]  # the final distribution's top tokens (after = before without edits)
    layers: list[LayerTrace]
    active: list[list[int]]  # [layers][positions] memories within 3 octaves of the strongest
    ff_logit: list[list[float]]  # [layers][positions] the FF's change to the final token's logit
    interventions: list[Intervention] = field(default_factory=list)
    edited_coefficients: list[float] = field(default_factory=list)  # each edited m_i before the edit
    generated: list[int] = field(default_factory=list)  # greedy continuation without the interventions
    generated_edited: list[int] = field(default_factory=list)  # and with them


def trace(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    position: int | None = None,
    *,
    memories: int = 10,
    readout: str = "norm",
    interventions: Sequence[Intervention] = (),
    generate_tokens: int = 0,
    top_tokens: int = 10,
    value_tokens: int = 0,
) -> Trace:
    """Trace the prompt `token_ids` at `position` (default: the last)."""
    n_positions = len(token_ids)
    position = n_positions - 1 if position is None else position
    ids = torch.tensor([list(token_ids)], device=loaded.device)  # [1, pos]
    with torch.inference_mode():
        with capture(loaded.model, loaded.adapter) as captured:
            loaded.model(ids, logits_to_keep=1)  # the unembedding runs below, once for everything
        layers = sorted(captured.coefficients)
        r = torch.stack([captured.residual[layer][0] for layer in layers])  # [layers, pos, d]
        y = torch.stack([captured.ff_output[layer][0, position] for layer in layers])  # [layers, d]
        o = torch.stack([captured.layer_output[layer][0] for layer in layers])  # [layers, pos, d]
        m = torch.stack([captured.coefficients[layer][0] for layer in layers]).float()  # [layers, pos, d_ff]

        # One read of the output embedding E: the model's logits at every position (final norm of the
        # last layer's output, as the model computes them) and, at the selected position, r, y and o
        # of every layer under the readout.
        unembedding = resolve(loaded.model, loaded.adapter.unembedding)
        at = torch.cat([r[:, position], y, o[:, position]])  # [3·layers, d]
        rows = torch.cat([readout_input(loaded, o[-1], "norm"), readout_input(loaded, at, readout)])
        read = (rows @ unembedding.weight.T).float()  # [pos + 3·layers, vocab]
        if unembedding.bias is not None:
            read[: n_positions if readout == "raw" else None] += unembedding.bias.float()
        best_tokens = read.max(dim=-1).indices  # [pos + 3·layers]
        final = best_tokens[:n_positions]  # [pos]: each position's prediction
        tops = best_tokens[n_positions:].view(3, len(layers)).tolist()  # [3][layers]: top(r), top(y), top(o)
        logits, read = read[:n_positions], read[n_positions:].view(3, len(layers), -1)  # [pos, V], [3, L, V]
        target = int(final[position])
        log_z = read[0].logsumexp(dim=-1)  # [layers]
        final_prob = (read[0][:, target] - log_z).exp().tolist()  # [layers]
        final_rank = (read[0] > read[0][:, target : target + 1]).sum(dim=-1).tolist()  # [layers]

        # Over layers × positions: active memories and the FF's change to each prediction's logit.
        magnitude = m.abs()  # [layers, pos, d_ff]
        active = (magnitude >= ACTIVE_RATIO * magnitude.amax(dim=-1, keepdim=True)).sum(dim=-1)  # [L, pos]
        embedding = resolve(loaded.model, loaded.adapter.unembedding).weight[final].float()  # [pos, d]
        lens_o = (readout_input(loaded, o, readout).float() * embedding).sum(dim=-1)  # [layers, pos]
        lens_r = (readout_input(loaded, r, readout).float() * embedding).sum(dim=-1)  # [layers, pos]

        # The memories at the selected position, by the size of their contribution.
        scores = magnitude[:, position] * loaded.value_norms[layers]  # [layers, d_ff]
        best = scores.topk(min(memories, scores.shape[1]), dim=-1)  # [layers, k]
        coefficients = m[:, position].gather(1, best.indices)  # [layers, k]
        tokens = _memory_tokens(loaded, best.indices, coefficients, readout, value_tokens)

        probs = logits[position].softmax(dim=-1)  # [vocab]
        edited_probs = probs
        if interventions:
            with intervene(loaded, interventions):
                kept = torch.tensor([position], device=ids.device)
                edited = loaded.model(ids, logits_to_keep=kept).logits[0, 0]  # [vocab]
                edited_probs = edited.float().softmax(dim=-1)  # [vocab]

    layer_traces = []
    for i, layer in enumerate(layers):
        top_r, top_y, top_o = tops[0][i], tops[1][i], tops[2][i]
        layer_traces.append(
            LayerTrace(
                layer=layer,
                top_r=top_r,
                top_y=top_y,
                top_o=top_o,
                final_prob=final_prob[i],
                final_rank=final_rank[i],
                case=case_of(top_r, top_y, top_o),
                settled=top_r == target,
                memories=[
                    Memory(layer, key, coefficient, score, tokens[i][j] if tokens else [])
                    for j, (key, coefficient, score) in enumerate(
                        zip(
                            best.indices[i].tolist(),
                            coefficients[i].tolist(),
                            best.values[i].tolist(),
                            strict=True,
                        )
                    )
                ],
            )
        )
    ranked_by = edited_probs if interventions else probs  # [vocab]
    shown = ranked_by.topk(top_tokens).indices  # [top_tokens]
    if interventions:  # the new top tokens beside the old ones
        shown = torch.cat([shown, probs.topk(top_tokens).indices]).unique()
        shown = shown[ranked_by[shown].argsort(descending=True)]
    result = Trace(
        token_ids=list(token_ids),
        position=position,
        readout=readout,
        prediction=target,
        top_tokens=[TokenChange(int(t), float(probs[t]), float(edited_probs[t])) for t in shown.tolist()],
        layers=layer_traces,
        active=active.tolist(),
        ff_logit=(lens_o - lens_r).tolist(),
        interventions=list(interventions),
        edited_coefficients=[float(m[i.layer, position, i.key]) for i in interventions],
    )
    if generate_tokens:
        result.generated = generate(loaded, token_ids, generate_tokens)
        if interventions:
            result.generated_edited = generate(loaded, token_ids, generate_tokens, interventions)
    return result


def _memory_tokens(
    loaded: LoadedModel, keys: torch.Tensor, coefficients: torch.Tensor, readout: str, n: int
) -> list[list[list[int]]]:
    """[layers][k] the top `n` tokens of sign(m_i)·v_i for each listed memory (none when n = 0)."""
    if n == 0:
        return []
    blocks = loaded.adapter.blocks(loaded.model)
    values = torch.stack(
        [loaded.adapter.value_matrix(blocks[layer])[keys[layer]] for layer in range(len(blocks))]
    )  # [layers, k, d]
    signed = values * coefficients.sign().to(values.dtype)[..., None]  # [layers, k, d]
    read = value_logits(loaded, signed.flatten(0, 1), readout).float()  # [layers·k, vocab]
    return read.topk(n, dim=-1).indices.view(*keys.shape, n).tolist()


def ablation(
    loaded: LoadedModel,
    layer: int,
    key: int,
    prefixes: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
) -> tuple[list[list[float]], list[list[float]]]:
    """Probabilities of each prefix's target tokens after its last token, with memory (layer, key)
    as it is and switched off: ([prefix][target] before, [prefix][target] after)."""
    lengths = torch.tensor([len(prefix) for prefix in prefixes], device=loaded.device)  # [n]
    width = int(lengths.max())
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    ids = torch.full((len(prefixes), width), pad, device=loaded.device)  # [n, width]
    for row, prefix in enumerate(prefixes):
        ids[row, : len(prefix)] = torch.tensor(list(prefix))
    mask = torch.arange(width, device=loaded.device)[None, :] < lengths[:, None]  # [n, width]
    wanted = torch.tensor([list(t) for t in targets], device=loaded.device)  # [n, targets]

    def probabilities() -> list[list[float]]:
        logits = loaded.model(ids, attention_mask=mask.long()).logits  # [n, width, vocab]
        last = logits[torch.arange(len(prefixes)), lengths - 1].float().softmax(dim=-1)  # [n, vocab]
        return last.gather(1, wanted).tolist()  # [n, targets]

    with torch.inference_mode():
        before = probabilities()
        with intervene(loaded, [Intervention(layer, key, "off")]):
            after = probabilities()
    return before, after
