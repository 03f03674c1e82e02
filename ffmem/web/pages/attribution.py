"""The live view's attribution: who pushes the target token at the selected position, in the pass the
page shows — each memory's direct contribution to its logit (ffmem.engine.live.attribution), the veto marks,
and which token a typed target is."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field

from ffmem.engine.live.attribution_terms import is_veto, target_id
from ffmem.engine.live.protocol import AttributionAnswer, ContributionAnswer, MemoryAnswer
from ffmem.store import vocabularies
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel
from ffmem.web import urls
from ffmem.web.display import visible
from ffmem.web.views import TokenRef


class AttributedMemory(BaseModel):
    """One memory's direct contribution to the target's logit (ffmem.engine.live.attribution)."""

    layer: int
    key: int
    coefficient: float = Field(description="m_i (edited, with edits)")
    value_logit: float = Field(
        description="The target's logit in the value: v·e_t (raw), v·g_t (norm, the final norm folded)"
    )
    contribution: float = Field(description="m_i · value_logit: > 0 promotes the target, < 0 suppresses it.")
    top_token: TokenRef | None = Field(
        description="The top token of sign(m)·v under the readout (None: the index has none)"
    )
    veto: bool = Field(
        description="A veto case (ffmem.engine.live.attribution_terms): it pushes the target, its layer "
        "pushes it down."
    )
    url: str = Field(description="The key page.")


class AttributionLayer(BaseModel):
    """One layer: its memories' contributions beside the FF's actual change to the target's logit."""

    layer: int
    memories: list[AttributedMemory] = Field(description="The largest |contribution|, largest first.")
    memories_sum: float = Field(description="Σ over all the layer's memories (S_ℓ)")
    bias: float = Field(description="The FF's output bias read the same way (0 without one)")
    direct: float = Field(description="y·e_t (raw) or y·g_t (norm): = memories_sum + bias up to float error.")
    change: float = Field(
        description="The FF's change to the target's logit lens: lens(o) − lens(r) (raw: y·e_t)"
    )
    residual: float = Field(
        description="change − (memories_sum + bias): float error (raw), the norm's non-linearity (norm)"
    )


class AttributionView(BaseModel):
    """Who pushes the target token at the selected position, in the pass the page shows."""

    target: TokenRef
    typed: str | None = Field(description="The target as the URL asked for it (None: the prediction)")
    note: str | None = Field(
        description="A typed text: which token is attributed (its text made visible, its id)"
    )
    other: TokenRef | None = Field(
        None, description="The typed text's other spelling (± a leading space), a token too."
    )
    other_url: str | None = Field(None, description="The same trace with that token as the target.")
    readout: str
    logit: float = Field(description="The target's logit after the position under the readout.")
    scale: float | None = Field(
        description="norm: the final norm's scale at the actual final residual, folded in."
    )
    total: float = Field(description="Σ of every memory's contribution over all layers.")
    largest_residual: float = Field(description="The largest |residual| over the layers.")
    vetoes: int = Field(description="Memories marked as veto cases.")
    layers: list[AttributionLayer]
    promoters: list[AttributedMemory] = Field(description="The largest contributions overall.")
    suppressors: list[AttributedMemory] = Field(description="The most negative overall.")
    circuit_url: str = Field(
        description="The memory circuit of this target here: who fed the memories that push it."
    )


def attributed(attribution: AttributionAnswer) -> list[ContributionAnswer]:
    """Every memory the attribution lists: per layer and overall."""
    listed = [m for layer in attribution.layers for m in layer.memories]
    return listed + attribution.promoters + attribution.suppressors


def other_spelling(session: Session, model: LanguageModel, answer: AttributionAnswer) -> int | None:
    """The token that is a typed target's other spelling — ` Paris` for `Paris`, `Paris` for ` Paris` —
    when the vocabulary has it as one token and it is not the token attributed; None otherwise."""
    typed = answer.typed
    if typed is None or target_id(typed) is not None:
        return None
    spelling = typed[1:] if typed.startswith(" ") else " " + typed
    if not spelling:
        return None
    found = vocabularies.find_tokens(session=session, model_id=model.id, texts=[spelling])
    return next((t for t in found if t != answer.target), None)


def _target_note(answer: AttributionAnswer, other: int | None, ref) -> str | None:
    """Which token a typed target is (its text as the pages show tokens, its id), or the first of the
    tokens it is; and its other spelling where that is a token too."""
    if answer.typed is None or target_id(answer.typed) is not None:
        return None

    def named(token_id: int) -> str:
        return f"{visible(ref(token_id).token)} #{token_id}"

    typed = f"“{visible(answer.typed)}”"
    if len(answer.typed_tokens) > 1:
        pieces = " + ".join(named(t) for t in answer.typed_tokens)
        note = (
            f"The target {typed} is {len(answer.typed_tokens)} tokens ({pieces}): "
            f"the first, {named(answer.target)}, is attributed."
        )
    else:
        note = f"The target {typed} is the token {named(answer.target)}."
    if other is not None:
        space = "with" if ref(other).token.startswith(" ") else "without"
        note += f" {space.capitalize()} a leading space it is another token, {named(other)}."
    return note


def attribution_view(
    slug: str,
    retarget: Callable[[int], str],
    answer: AttributionAnswer,
    value_tokens: dict,
    ref: Callable[[int], TokenRef],
    other: int | None,
    circuit_url: str,
) -> AttributionView:
    """The attribution named with the index: each memory's own top token (the first of its signed value
    tokens), the veto marks (ffmem.engine.live.attribution_terms.is_veto), which token a typed target is and
    its `other` spelling (`retarget`: the same trace with another token as its target); `circuit_url`: its
    memory circuit."""
    sums = {layer.layer: layer.memories_sum for layer in answer.layers}
    largest = {
        layer.layer: max((abs(c.contribution) for c in layer.memories), default=0.0)
        for layer in answer.layers
    }

    def memory(m: ContributionAnswer) -> AttributedMemory:
        ids = value_tokens.get(signed(m))
        top = ids[0] if ids else None
        return AttributedMemory.model_construct(  # built, not validated: hundreds per page, our own data
            layer=m.layer,
            key=m.key,
            coefficient=m.coefficient,
            value_logit=m.value_logit,
            contribution=m.contribution,
            top_token=None if top is None else ref(top),
            veto=is_veto(m.contribution, sums[m.layer], largest[m.layer], top == answer.target),
            url=urls.key_url(slug, m.layer, m.key),
        )

    rows = [
        AttributionLayer(
            layer=layer.layer,
            memories=[memory(m) for m in layer.memories],
            memories_sum=layer.memories_sum,
            bias=layer.bias,
            direct=layer.direct,
            change=layer.change,
            residual=layer.residual,
        )
        for layer in answer.layers
    ]
    return AttributionView(
        target=ref(answer.target),
        typed=answer.typed,
        note=_target_note(answer, other, ref),
        other=None if other is None else ref(other),
        other_url=None if other is None else retarget(other),
        readout=answer.readout,
        logit=answer.logit,
        scale=answer.scale,
        total=answer.total,
        largest_residual=max((abs(layer.residual) for layer in answer.layers), default=0.0),
        vetoes=sum(m.veto for row in rows for m in row.memories),
        layers=rows,
        promoters=[memory(m) for m in answer.promoters],
        suppressors=[memory(m) for m in answer.suppressors],
        circuit_url=circuit_url,
    )


def signed(memory: MemoryAnswer | ContributionAnswer) -> tuple[int, int, int]:
    """(layer, key, direction): a negative coefficient reads the value's bottom tokens."""
    return memory.layer, memory.key, 1 if memory.coefficient >= 0 else -1
