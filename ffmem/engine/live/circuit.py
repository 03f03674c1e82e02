"""A prompt's memory circuit (issue 30): the memories that push a target token at the selected position
and, for each, the earlier memories whose output fed its coefficient on *this* prompt — the weight graph
(ffmem.engine.relations.weight_graph) made prompt-specific.

**Nodes.** Hop 0: the `nodes` memories of largest |c_i| in the attribution of the target
(ffmem.engine.live.attribution: c_i = m_i·(v_i·e_t) raw, m_i·(v_i·g_t) norm). Hop 1: the earlier memories that
feed a hop-0 node most; hop 2 (with `hops=2`): those that feed a hop-1 node. Every node carries its
coefficient and its own contribution c to the target.

**The term of an edge j → i** (memory j of layer ℓ' < ℓ, memory i of layer ℓ, both at the selected position):
the first-order change of m_i that m_j·v_j causes along the direct path (the residual stream from layer ℓ'
to layer ℓ's FF, skipping the blocks between), at this prompt's actual FF input x of layer ℓ (the vector
its input norm reads):

    term_ji = m_j · (v_j · ρ_i),     ρ_i = ∂m_i/∂x at x  [d].

ρ_i, key i's read vector on this prompt, in two steps:
1. Through the FF, at the normed input x̂ = N(x):
   - gated, m_i = act(a_i)·b_i with a_i = x̂·g_i (gate) and b_i = x̂·u_i (up), biases where the family has
     them: d m_i = act'(a_i)·b_i·(δx̂·g_i) + act(a_i)·(δx̂·u_i), so q_i = act'(a_i)·b_i·g_i + act(a_i)·u_i;
   - plain, m_i = act(x̂·k_i + b_i) (GELU, ReLU): q_i = act'(x̂·k_i + b_i)·k_i;
   act' is the activation's slope at the actual pre-activation (forward-mode autograd; act is elementwise).
2. Through the norm, at x. RMSNorm N(x) = w⊙x·s, LayerNorm N(x) = w⊙z·s + b, with z = x (RMSNorm) or
   x − mean x (LayerNorm) and s = (mean z² + ε)^−½. Its derivative, exactly:
       ρ_i = s·q̃_i − (s³/d)·(z·q̃_i)·z,     q̃_i = w⊙q_i, centred for a LayerNorm (weight_graph.fold_norm).
   The first term is the key folded with the norm's weight and its scale at x, as attribution folds the final
   norm; the second is the change of the scale itself, which attribution holds fixed and which is kept here,
   so that the term is the exact first-order change of m_i (tests/engine/test_circuit.py checks it against
   finite differences).

A positive term: m_j's write raised m_i here; switching j off (m_j = 0) moves m_i by about −term
(bench/circuit.py checks the sign by ablation on the real model). `upstream_sum`, Σ_j term_ji over every
earlier memory, is the first-order change of m_i from all earlier FF outputs' direct writes.

Not in the circuit: paths through attention — an earlier memory's write, at this position or another, read
by a later attention layer that writes here (the FF is position-wise: only the same position's memories feed
m_i directly) — and through the blocks between ℓ' and ℓ (the second hop follows them one FF at a time); nor
the embeddings and attention outputs that also make up x.

**Pruning.** Per node, the `top` upstream memories of largest |term| (one [nodes, d] × [d, d_ff] product per
earlier layer, each node's read vector against every earlier memory's m ⊙ V); of those, an edge stays when
its |term| is at least `threshold` × the largest |term| of its hop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.activations import ACT2FN

from ffmem.engine.live.attribution import attribute, target_direction
from ffmem.engine.live.edited_forward import intervene
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.live.protocol import CIRCUIT_HOPS, CIRCUIT_NODES, CIRCUIT_THRESHOLD, CIRCUIT_TOP
from ffmem.engine.live.trace import top_index
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.weight_graph import fold_norm, input_norm
from ffmem.engine.values.projection import readout_input


@dataclass(frozen=True)
class MemoryRef:
    layer: int
    key: int


@dataclass
class CircuitNode:
    layer: int
    key: int
    coefficient: float  # m at the position (edited, with interventions)
    contribution: float  # its direct push on the target's logit, c = m·(v·e_t) or m·(v·g_t)
    hop: int  # 0: pushes the target (the largest |c|); 1: feeds a hop-0 node; 2: feeds a hop-1 node
    upstream_sum: float | None = None  # Σ of every earlier memory's term into it (None: not expanded)


@dataclass
class CircuitEdge:
    upstream: MemoryRef  # j, the earlier memory
    downstream: MemoryRef  # i
    term: float  # m_j·(v_j·ρ_i): the first-order change of m_i that j's write causes
    coefficient: float  # m_i, the downstream coefficient


@dataclass
class Circuit:
    token_ids: list[int]
    position: int
    readout: str
    target: int  # the token attributed
    logit: float  # its logit after the position under the readout (ffmem.engine.live.attribution)
    nodes: list[CircuitNode]  # hop 0 by |contribution|, then each hop's new memories as its edges list them
    edges: list[CircuitEdge]  # per hop, per downstream node, by |term|
    largest_terms: list[float]  # per hop, the largest |term| of its candidate edges (the threshold's unit)
    threshold: float
    top: int
    hops: int
    interventions: list[Intervention] = field(default_factory=list)


def circuit(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    position: int | None = None,
    *,
    target: int | None = None,
    readout: str = "norm",
    interventions: Sequence[Intervention] = (),
    nodes: int = CIRCUIT_NODES,
    top: int = CIRCUIT_TOP,
    threshold: float = CIRCUIT_THRESHOLD,
    hops: int = CIRCUIT_HOPS,
) -> Circuit:
    """The circuit of `target` (default: the prediction) after `position` (default: the last) of the prompt
    `token_ids`, in one forward pass (with the interventions, if any)."""
    position = len(token_ids) - 1 if position is None else position
    ids = torch.tensor([list(token_ids)], device=loaded.device)  # [1, pos]
    layers = list(range(loaded.n_layers))
    with torch.inference_mode():
        with intervene(loaded, interventions):
            m, x, r, y, o = _read(loaded, ids, position)  # m [layers, d_ff]; x, r, y, o [layers, d]
        if target is None:  # the model's own prediction
            unembedding = resolve(loaded.model, loaded.adapter.unembedding)
            target = int(top_index(unembedding(readout_input(loaded, o[-1:], "norm")).float())[0])
        attribution = attribute(loaded, layers, m, r, y, o, target, readout, nodes)
        pushing = sorted(attribution.promoters + attribution.suppressors, key=lambda c: -abs(c.contribution))
        g, _ = target_direction(loaded, target, o[-1], readout)  # [d]

        found = {MemoryRef(c.layer, c.key): 0 for c in pushing[:nodes]}  # memory → its hop
        sums: dict[MemoryRef, float] = {}
        edges: list[CircuitEdge] = []
        largest_terms: list[float] = []
        frontier = list(found)
        for hop in range(1, hops + 1):
            if not frontier:
                break
            terms, upstream, totals = upstream_terms(loaded, frontier, m, x, top)  # [n, top] ×2, [n]
            below = torch.tensor([i.layer for i in frontier], device=upstream.device)[:, None]  # [n, 1]
            magnitude = terms.abs() * (upstream // loaded.n_keys < below)  # [n, top]: 0 past layer 0
            largest = float(magnitude.max()) if magnitude.numel() else 0.0
            largest_terms.append(largest)
            kept = (magnitude >= threshold * largest) & (magnitude > 0)  # [n, top]
            sums |= dict(zip(frontier, totals.tolist(), strict=True))
            expanded, frontier = frontier, []
            for down, row, flat_ids, keep in zip(
                expanded, terms.tolist(), upstream.tolist(), kept.tolist(), strict=True
            ):
                for term, flat, kept_edge in zip(row, flat_ids, keep, strict=True):
                    if not kept_edge:
                        continue
                    up = MemoryRef(*divmod(flat, loaded.n_keys))
                    edges.append(CircuitEdge(up, down, term, float(m[down.layer, down.key])))
                    if up not in found:
                        found[up] = hop
                        frontier.append(up)

        refs = list(found)
        where = torch.tensor([[ref.layer, ref.key] for ref in refs], device=m.device)  # [nodes, 2]
        coefficients = m[where[:, 0], where[:, 1]]  # [nodes]
        blocks = loaded.adapter.blocks(loaded.model)
        value_logits = torch.stack(
            [loaded.adapter.value_matrix(blocks[ref.layer])[ref.key].float() @ g for ref in refs]
        )  # [nodes]
        contributions = (coefficients * value_logits).tolist()
    listed = [
        CircuitNode(ref.layer, ref.key, float(c), contribution, found[ref], sums.get(ref))
        for ref, c, contribution in zip(refs, coefficients.tolist(), contributions, strict=True)
    ]
    return Circuit(
        token_ids=list(token_ids),
        position=position,
        readout=readout,
        target=target,
        logit=attribution.logit,
        nodes=listed,
        edges=edges,
        largest_terms=largest_terms,
        threshold=threshold,
        top=top,
        hops=hops,
        interventions=list(interventions),
    )


def _read(
    loaded: LoadedModel, ids: torch.Tensor, position: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward pass of `ids` ([1, pos]), under whatever interventions are active, read at `position`:
    (m [layers, d_ff] float32, the FF inputs x, and r, y, o [layers, d] each)."""
    with capture(loaded.model, loaded.adapter) as captured, _ff_inputs(loaded) as inputs:
        nothing = torch.empty(0, dtype=torch.long, device=ids.device)
        loaded.model(ids, logits_to_keep=nothing, use_cache=False)  # no logits: the readout is below
    layers = sorted(captured.coefficients)
    m = torch.stack([captured.coefficients[layer][0, position] for layer in layers]).float()  # [L, d_ff]
    x = torch.stack([inputs[layer][position] for layer in layers])  # [layers, d]
    r, y, o = (
        torch.stack([seen[layer][0, position] for layer in layers])  # [layers, d]
        for seen in (captured.residual, captured.ff_output, captured.layer_output)
    )
    return m, x, r, y, o


@contextmanager
def _ff_inputs(loaded: LoadedModel) -> Iterator[dict[int, torch.Tensor]]:
    """Per layer, the input of the FF's norm on every forward pass inside the block: the residual the FF
    reads (the block's input for parallel blocks), [pos, d] (batch 1). Hooks are removed on exit."""
    inputs: dict[int, torch.Tensor] = {}
    handles = []

    def keep(layer: int):
        def hook(module, args):
            inputs[layer] = args[0].reshape(-1, args[0].shape[-1])  # [batch·pos, d]: OPT flattens

        return hook

    try:
        for layer, block in enumerate(loaded.adapter.blocks(loaded.model)):
            handles.append(input_norm(loaded, block).register_forward_pre_hook(keep(layer)))
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def upstream_terms(
    loaded: LoadedModel, frontier: Sequence[MemoryRef], m: torch.Tensor, x: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each memory of `frontier`, its `top` earlier memories by |term| (module docstring), from the
    coefficients m [layers, d_ff] and the FF inputs x [layers, d] of one position: (terms [n, top], flat ids
    layer·d_ff + key [n, top], Σ of every earlier memory's term [n]). A node of layer 0 has no earlier
    memory: its slots hold zeros (ids of layer ≥ its own)."""
    n, d_ff = len(frontier), loaded.n_keys
    reads = torch.zeros(n, x.shape[-1], device=x.device)  # [n, d]: ρ of each node
    for layer in sorted({ref.layer for ref in frontier}):
        rows = [i for i, ref in enumerate(frontier) if ref.layer == layer]
        keys = torch.tensor([frontier[i].key for i in rows], device=x.device)
        reads[rows] = read_vectors_here(loaded, layer, keys, x[layer])
    below = torch.tensor([ref.layer for ref in frontier], device=x.device)  # [n]
    blocks = loaded.adapter.blocks(loaded.model)
    terms = torch.zeros(n, max(1, max(below.tolist())) * d_ff, device=x.device)  # [n, writers·d_ff]
    for writer in range(int(below.max())):
        values = loaded.adapter.value_matrix(blocks[writer])  # [d_ff, d]
        written = (reads.to(values.dtype) @ values.T).float() * m[writer]  # [n, d_ff]: m_j·(v_j·ρ_i)
        terms[:, writer * d_ff : (writer + 1) * d_ff] = written * (below > writer)[:, None]
    best = terms.abs().topk(min(top, terms.shape[1]), dim=1).indices  # [n, top]
    return terms.gather(1, best), best, terms.sum(dim=1)


def read_vectors_here(loaded: LoadedModel, layer: int, keys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ρ_i = ∂m_i/∂x of `keys` ([n]) of `layer` at its FF input x [d] (module docstring): [n, d] float32."""
    adapter = loaded.adapter
    block = adapter.blocks(loaded.model)[layer]
    norm = input_norm(loaded, block)
    normed = norm(x[None])  # [1, d]: what the FF reads
    act = ACT2FN[adapter.activation(loaded.config)]
    first = resolve(block, adapter.keys)(normed)[0, keys].float()  # [n]: x̂·k_i (+ b), the up read if gated
    rows = adapter.key_matrix(block)[keys].float()  # [n, d]
    gates = adapter.gate_matrix(block)
    if gates is None:  # m = act(x̂·k + b)
        _, slope = _activation(act, first)  # [n]
        through_ff = slope[:, None] * rows  # [n, d]
    else:  # m = act(a)·b, a = x̂·g (+ b_g), b = first
        gate = resolve(block, adapter.gates)(normed)[0, keys].float()  # [n]
        opened, slope = _activation(act, gate)  # [n] each
        through_ff = (slope * first)[:, None] * gates[keys].float() + opened[:, None] * rows  # [n, d]
    z, scale = _norm_point(norm, x.float())  # [d], []
    folded = fold_norm(norm, through_ff)  # [n, d]: w⊙q, centred for a LayerNorm
    return scale * folded - (scale**3 / z.shape[0]) * (folded @ z)[:, None] * z  # [n, d]


def _activation(act: nn.Module, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(pre), act'(pre)) of an elementwise activation, by forward-mode autograd: [n] → ([n], [n])."""
    with torch.inference_mode(False):
        point = pre.clone()  # outside inference mode: a tensor autograd may read
        return torch.func.jvp(act, (point,), (torch.ones_like(point),))


def _norm_point(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s) of the norm at x [d]: z = x (RMSNorm) or x − mean x (LayerNorm), s = (mean z² + ε)^−½."""
    if isinstance(norm, nn.LayerNorm):
        z = x - x.mean()
        return z, torch.rsqrt(z.pow(2).mean() + norm.eps)
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return x, torch.rsqrt(x.pow(2).mean() + norm.variance_epsilon)
    raise TypeError(f"ffmem cannot linearise a {type(norm).__name__} FF norm; add it to circuit._norm_point")
