"""One prompt, one forward pass: how the FF memories build the prediction, layer by layer (§5.1–5.2).

For the selected position and every layer ℓ, read through the model's output embedding (the
`readout`: "norm" = the model's own final norm + unembedding, so the last layer's top(o) is the
model's prediction; "raw" = the paper's r·E):
- top(r)  the residual before the FF, top(y) the FF output, top(o) the layer output o = r + y;
- the probability and rank of the final prediction under r (the paper's Fig. 10);
- the case: agreement (all three equal), residual (top(o) = top(r)), ffn (top(o) = top(y)),
  composition (none);
- the memories ranked by |m_i|·‖v_i‖, with their signed coefficients;
- who pushes a target token (default: the prediction): each memory's direct contribution to its logit
  (ffmem.engine.live.attribution).
Over all layers × positions: the number of active memories and the FF's share of the logit of each
position's final prediction (lens(o)[t] − lens(r)[t], = y·e_t for the raw readout).

With interventions, every figure is read from the edited forward pass (what the model computed with
the edits), and `Trace.unedited` holds the same figures from a second pass without them; without
interventions there is one pass and `unedited` is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ffmem.engine.live.attribution import Attribution, attribute
from ffmem.engine.live.edited_forward import generate, intervene
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.paper.cases import case_of
from ffmem.engine.values.projection import norm_parts, readout_input, value_logits

ACTIVE_RATIO = 2.0**-3  # active: |m_i| within 3 octaves of the position's strongest memory (cf. density)


@dataclass
class Memory:
    layer: int
    key: int
    coefficient: float  # m_i at the position (signed; edited, with interventions)
    score: float  # |m_i|·‖v_i‖: the size of its contribution to y
    tokens: list[int] = field(default_factory=list)  # top tokens of sign(m_i)·v_i, when asked for
    unedited_coefficient: float | None = None  # m_i without the interventions (None without any)


@dataclass
class LayerReading:
    """One layer at the selected position, read off one forward pass."""

    layer: int
    top_r: int
    top_y: int
    top_o: int
    final_prob: float  # probability of that pass's final prediction under r
    final_rank: int  # its 0-based rank under r
    case: str
    settled: bool  # top(r) is already the final prediction


@dataclass
class LayerTrace(LayerReading):
    memories: list[Memory]


@dataclass
class Reading:
    """What one forward pass gives, layer by layer: the figures a trace shows."""

    prediction: int  # the top token after the selected position
    layers: list[LayerReading]
    active: list[list[int]]  # [layers][positions] memories within 3 octaves of the strongest
    ff_logit: list[list[float]]  # [layers][positions] the FF's change to each position's final logit


@dataclass
class TokenChange:
    token_id: int
    before: float  # probability without the interventions
    after: float  # with them


@dataclass
class Trace:
    """A traced prompt. `prediction`, `layers`, `active` and `ff_logit` come from the forward pass that
    was computed: the edited one when there are interventions; `unedited` has them without the edits."""

    token_ids: list[int]
    position: int
    readout: str
    prediction: int  # the model's top token after `position`
    top_tokens: list[TokenChange]  # the final distribution's top tokens (after = before without edits)
    layers: list[LayerTrace]
    active: list[list[int]]  # [layers][positions] memories within 3 octaves of the strongest
    ff_logit: list[list[float]]  # [layers][positions] the FF's change to the final token's logit
    unedited: Reading | None = None  # the same figures without the interventions (None without any)
    interventions: list[Intervention] = field(default_factory=list)
    edited_coefficients: list[float] = field(default_factory=list)  # each edited m_i before the edit
    generated: list[int] = field(default_factory=list)  # greedy continuation without the interventions
    generated_edited: list[int] = field(default_factory=list)  # and with them
    attribution: Attribution | None = None  # who pushes the target token, in the pass shown


def top_index(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """argmax over the last dimension (the first maximum), through a blocked amax: on CPU torch's
    max/argmax with indices runs ~10× slower than amax. [rows, vocab] → [rows]."""
    rows, vocab = logits.shape
    if vocab % block:
        logits = torch.nn.functional.pad(
            logits, (0, -vocab % block), value=-torch.inf
        )  # [rows, blocks·block]
    blocks = logits.view(rows, -1, block)  # [rows, blocks, block]
    first = blocks.amax(dim=-1).argmax(dim=-1)  # [rows]: the first block that holds the maximum
    inside = blocks[torch.arange(rows, device=logits.device), first].argmax(dim=-1)  # [rows]
    return first * block + inside


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
    target: int | None = None,
    attribution: bool = True,
) -> Trace:
    """Trace the prompt `token_ids` at `position` (default: the last): one forward pass, two with
    interventions (the edited one, read in full, and the unedited one for comparison). With
    `attribution`, the memories' contributions to `target`'s logit (default: the prediction) in the
    pass read in full."""
    n_positions = len(token_ids)
    position = n_positions - 1 if position is None else position
    ids = torch.tensor([list(token_ids)], device=loaded.device)  # [1, pos]
    with torch.inference_mode():
        with intervene(loaded, interventions):  # no hooks without interventions
            reading, m, logits, stream = _read(loaded, ids, position, readout)  # m [layers, pos, d_ff]
        unedited, clean_m, clean_logits = None, m, logits
        if interventions:
            unedited, clean_m, clean_logits, _ = _read(loaded, ids, position, readout)

        # The memories at the selected position, by the size of their contribution.
        layers = [row.layer for row in reading.layers]
        attributed = None
        if attribution:
            wanted = reading.prediction if target is None else target
            attributed = attribute(loaded, layers, m[:, position], *stream, wanted, readout, memories)
        scores = m[:, position].abs() * loaded.value_norms[layers]  # [layers, d_ff]
        best = scores.topk(min(memories, scores.shape[1]), dim=-1)  # [layers, k]
        coefficients = m[:, position].gather(1, best.indices)  # [layers, k]
        before = clean_m[:, position].gather(1, best.indices)  # [layers, k]: the same memories unedited
        tokens = _memory_tokens(loaded, best.indices, coefficients, readout, value_tokens)

        probs = clean_logits.softmax(dim=-1)  # [vocab]: without the interventions
        edited_probs = logits.softmax(dim=-1)  # [vocab]: with them (the same tensor without any)
        shown = edited_probs.topk(top_tokens).indices  # [top_tokens]
        if interventions:  # the new top tokens beside the old ones
            shown = torch.cat([shown, probs.topk(top_tokens).indices]).unique()
            shown = shown[edited_probs[shown].argsort(descending=True)]

    layer_traces = []
    for i, row in enumerate(reading.layers):
        listed = zip(
            best.indices[i].tolist(),
            coefficients[i].tolist(),
            best.values[i].tolist(),
            before[i].tolist(),
            strict=True,
        )
        layer_traces.append(
            LayerTrace(
                **vars(row),
                memories=[
                    Memory(
                        row.layer,
                        key,
                        coefficient,
                        score,
                        tokens[i][j] if tokens else [],
                        unedited_coefficient=was if interventions else None,
                    )
                    for j, (key, coefficient, score, was) in enumerate(listed)
                ],
            )
        )
    result = Trace(
        token_ids=list(token_ids),
        position=position,
        readout=readout,
        prediction=reading.prediction,
        top_tokens=[TokenChange(int(t), float(probs[t]), float(edited_probs[t])) for t in shown.tolist()],
        layers=layer_traces,
        active=reading.active,
        ff_logit=reading.ff_logit,
        unedited=unedited,
        interventions=list(interventions),
        edited_coefficients=[float(clean_m[i.layer, position, i.key]) for i in interventions],
        attribution=attributed,
    )
    if generate_tokens:
        result.generated = generate(loaded, token_ids, generate_tokens)
        if interventions:
            result.generated_edited = generate(loaded, token_ids, generate_tokens, interventions)
    return result


def _read(
    loaded: LoadedModel, ids: torch.Tensor, position: int, readout: str
) -> tuple[Reading, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward pass of `ids` ([1, pos]) read layer by layer at `position`, under whatever
    interventions are active. → (the reading, the coefficients m [layers, pos, d_ff] in float32, the
    model's logits after `position` [vocab] in float32, (r, y, o) at `position` [layers, d] each)."""
    with capture(loaded.model, loaded.adapter) as captured:
        nothing = torch.empty(0, dtype=torch.long, device=ids.device)
        loaded.model(ids, logits_to_keep=nothing, use_cache=False)  # no logits: the readout is below
    layers = sorted(captured.coefficients)
    r = torch.stack([captured.residual[layer][0] for layer in layers])  # [layers, pos, d]
    y = torch.stack([captured.ff_output[layer][0, position] for layer in layers])  # [layers, d]
    o = torch.stack([captured.layer_output[layer][0] for layer in layers])  # [layers, pos, d]
    m = torch.stack([captured.coefficients[layer][0] for layer in layers]).float()  # [layers, pos, d_ff]

    finals = readout_input(loaded, o[-1], "norm")  # [pos, d]: what the model's unembedding reads
    logits, read_ry, read_o = read_layers(loaded, finals, r[:, position], y, o[:, position], readout)
    n_layers, n_vocab = read_o.shape
    final = top_index(logits)  # [pos]: each position's prediction
    top_ry = top_index(read_ry.view(2 * n_layers, n_vocab)).view(n_layers, 2)  # [layers, 2]
    tops = [top_ry[:, 0].tolist(), top_ry[:, 1].tolist(), top_index(read_o).tolist()]  # [3][layers]
    read_r = read_ry[:, 0]  # [layers, vocab]
    target = int(final[position])
    log_z = read_r.logsumexp(dim=-1)  # [layers]
    final_prob = (read_r[:, target] - log_z).exp().tolist()  # [layers]
    final_rank = (read_r > read_r[:, target : target + 1]).sum(dim=-1).tolist()  # [layers]

    # Over layers × positions: active memories and the FF's change to each prediction's logit.
    magnitude = m.abs()  # [layers, pos, d_ff]
    active = (magnitude >= ACTIVE_RATIO * magnitude.amax(dim=-1, keepdim=True)).sum(dim=-1)  # [L, pos]
    embedding = resolve(loaded.model, loaded.adapter.unembedding).weight[final].float()  # [pos, d]
    lens_o = (readout_input(loaded, o, readout).float() * embedding).sum(dim=-1)  # [layers, pos]
    lens_r = (readout_input(loaded, r, readout).float() * embedding).sum(dim=-1)  # [layers, pos]

    rows = []
    for i, layer in enumerate(layers):
        top_r, top_y, top_o = tops[0][i], tops[1][i], tops[2][i]
        rows.append(
            LayerReading(
                layer=layer,
                top_r=top_r,
                top_y=top_y,
                top_o=top_o,
                final_prob=final_prob[i],
                final_rank=final_rank[i],
                case=case_of(top_r, top_y, top_o),
                settled=top_r == target,
            )
        )
    reading = Reading(target, rows, active.tolist(), (lens_o - lens_r).tolist())
    return reading, m, logits[position].float(), (r[:, position], y, o[:, position])


def read_layers(
    loaded: LoadedModel,
    finals: torch.Tensor,
    r: torch.Tensor,
    y: torch.Tensor,
    o: torch.Tensor,
    readout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over the output embedding E for the model's logits at every position (`finals`, the
    final norm of the last layer's output, [pos, d]) and for r and y of every layer at the selected
    position ([layers, d] each) under `readout`. The readout is linear up to a per-vector scale and
    o = r + y, so the logits of o ([layers, d]) are a per-layer mix of those of r and y: 2·layers rows
    through E instead of 3·layers. → (logits [pos, V], r and y [layers, 2, V], o [layers, V])."""
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    weight = unembedding.weight  # [vocab, d]
    n_layers, n_vocab = len(r), weight.shape[0]
    if readout == "norm":
        (r_part, r_scale, bias), (y_part, y_scale, _) = norm_parts(loaded, r), norm_parts(loaded, y)
        o_scale = norm_parts(loaded, o)[1]  # [layers, 1]
        pairs = torch.stack([r_part * r_scale, y_part * y_scale], dim=1)  # [layers, 2, d]
        mix = torch.cat([o_scale / r_scale, o_scale / y_scale], dim=1)  # [layers, 2]
    else:  # raw: r·E, no norm, no bias
        pairs, bias = torch.stack([r, y], dim=1).float(), None  # [layers, 2, d]
        mix = torch.ones(n_layers, 2, device=r.device)  # [layers, 2]
    rows = torch.cat([finals.float(), pairs.flatten(0, 1)])  # [pos + 2·layers, d]: r₀, y₀, r₁, y₁, …
    products = (rows.to(weight.dtype) @ weight.T).float()  # [pos + 2·layers, vocab]
    logits = products[: len(finals)]  # [pos, vocab]
    read_ry = products[len(finals) :].view(n_layers, 2, n_vocab)  # [layers, 2, vocab]
    read_o = torch.bmm(mix[:, None, :], read_ry)[:, 0]  # [layers, vocab]: (r + y) under the readout
    offset = None  # [vocab]: what the norm's bias and the unembedding's bias add to a readout
    if readout == "norm" and bias is not None:
        offset = weight.float() @ bias
    if unembedding.bias is not None:
        logits = logits + unembedding.bias.float()
        if readout == "norm":
            offset = unembedding.bias.float() + (0 if offset is None else offset)
    if offset is not None:
        read_ry += offset
        read_o += offset
    return logits, read_ry, read_o


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
