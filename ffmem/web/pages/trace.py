"""The live view: a trace answered by the live worker, named with the index's tokens.

The worker answers a TraceAnswer (ffmem/engine/live/protocol.py) of token ids; the database gives their
texts and, from the newest run that has projected its values, each listed memory's value tokens (its top
tokens for m > 0, its bottom tokens for m < 0: a negative coefficient flips the value). With edits, the
figures are those of the edited forward pass, each layer's unedited figures beside them. The attribution
(who pushes the target token, here) is of that pass too; its memories' own top tokens, for the veto
marks, come from the same run's value tokens.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.engine.live.interventions import Intervention, format_interventions
from ffmem.engine.live.protocol import LayerFigures
from ffmem.engine.paper.cases import CASES
from ffmem.store import jobs, memory_reads, runs, vocabularies
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.web import urls
from ffmem.web.pages.attribution import AttributionView, attributed, attribution_view, other_spelling, signed
from ffmem.web.pages.trace_query import TraceQuery
from ffmem.web.views import ModelPage, TokenRef
from ffmem.web.worker_client import LiveWorker

MEMORY_TOKENS = 5  # value tokens shown per memory


class PromptToken(TokenRef):
    position: int
    url: str = Field(description="This trace with the position selected.")


class TraceMemory(BaseModel):
    """One memory at the selected position, ranked by |m_i|·‖v_i‖ (with the edits, if any)."""

    layer: int
    key: int
    coefficient: float = Field(description="signed: m < 0 flips the value's effect (edited, with edits)")
    unedited_coefficient: float | None = Field(description="m without the edits (None without edits)")
    score: float
    tokens: list[TokenRef] = Field(
        description="Top tokens of sign(m)·v under the trace's readout (from the index)"
    )
    agrees: bool | None = Field(description="top(y) is among them (None: the index has no value tokens)")
    url: str = Field(description="The key page.")
    edit: str | None = Field(description="This memory's intervention in the trace, if any.")
    off_url: str = Field(description="This trace with the memory switched off.")
    scale_url: str = Field(description="… scaled ×2.")
    flip_url: str = Field(description="… scaled ×−1.")


class LayerFiguresView(BaseModel):
    """A layer at the selected position in one forward pass."""

    top_r: TokenRef = Field(description="The residual entering layer ℓ's FF (before it).")
    top_y: TokenRef = Field(description="The FF output.")
    top_o: TokenRef = Field(description="The layer output.")
    final_prob: float = Field(
        description="Probability of that pass's final prediction under the residual entering layer ℓ's FF "
        "(this layer's own FF not yet added; after the last layer: the trace's `prediction_prob`)."
    )
    final_rank: int
    case: str = Field(description="agreement | residual | ffn | composition.")
    settled: bool = Field(description="top(r) is already the final prediction.")


class TraceLayer(LayerFiguresView):
    """A layer of the forward pass that was computed (with the edits, if any)."""

    layer: int
    agrees: bool | None = Field(description="One of the listed memories' top tokens is top(y)")
    memories: list[TraceMemory]
    unedited: LayerFiguresView | None = Field(
        description="The same figures without the edits (None without edits)"
    )


class TokenChangeView(TokenRef):
    before: float
    after: float
    change: float
    target_url: str = Field(description="This trace with this token as the attribution's target.")


class EditView(BaseModel):
    text: str = Field(description="L12K345*0.5.")
    layer: int
    key: int
    mode: str = Field(description="off | scale | set.")
    value: float
    coefficient: float | None = Field(description="m at the selected position before the edit.")
    url: str = Field(description="The key page.")
    remove_url: str = Field(description="This trace without it.")


class UneditedTrace(BaseModel):
    """The trace's figures without the edits, beside those with them."""

    prediction: TokenRef
    prediction_prob: float | None = Field(
        description="Its probability after the last layer (the model's output)."
    )
    heatmap: dict = Field(description='{"active": [layers][positions], "ff_logit": [layers][positions]}.')
    cases: dict[str, int] = Field(description="Layers per case.")


class Generation(BaseModel):
    tokens: int
    clean: str
    edited: str | None = Field(description="With the interventions (None without any)")


class TraceContext(ModelPage):
    """A prompt traced by the live worker: its memories, layer by layer, with the edits if any."""

    page: str = "trace"
    n_layers: int
    n_keys: int
    text: str | None = Field(description="None: no prompt yet (the form only)")
    position: int | None
    readout: str
    memories: int
    generate: int
    interventions: str = Field(description="The set as the URL keeps it.")
    max_tokens: int
    worker: dict = Field(description="The live worker's state (status: ready | loading | idle | down)")
    notice: str | None = Field(None, description="Why there is no trace (worker down, loading or busy)")
    run: int | None = Field(None, description="The index run whose value tokens name the memories' tokens.")
    tokens: list[PromptToken] = []
    # prediction, layers, heatmap and cases: the forward pass that was computed, with the edits if any
    prediction: TokenRef | None = None
    prediction_prob: float | None = Field(
        None,
        description="The prediction's probability after the last layer (the model's output): the point "
        "after the last layer's FF, where each layer's `final_prob` is the residual entering its FF.",
    )
    top_tokens: list[TokenChangeView] = []
    layers: list[TraceLayer] = []
    heatmap: dict = Field({}, description='{"active": [layers][positions], "ff_logit": [layers][positions]}.')
    edits: list[EditView] = []
    generation: Generation | None = None
    cases: dict[str, int] = Field({}, description="Layers per case.")
    unedited: UneditedTrace | None = Field(
        None, description="The same without the edits (None without edits)"
    )
    heatmap_mode: str = Field(
        "ff_logit", description="The heatmap shown first (`heatmap=`; pages/trace_charts.HEATMAP_MODES)"
    )
    notice_field: str | None = Field(
        None, description="The form field the notice is about: shown next to it."
    )
    target: str | None = Field(
        None, description="The attribution's target as the URL asks (`target=`; None: the prediction)"
    )
    attribution: AttributionView | None = Field(None, description="Who pushes the target token, here.")
    link: str | None = Field(
        None, description="This trace's URL, its share link; None: too long for a URL (sent by POST)"
    )
    circuit_url: str | None = Field(
        None, description="This prompt's memory circuit (its position, edits, readout and target)."
    )


def value_run(session: Session, model: LanguageModel) -> Run | None:
    """The run whose value tokens name the memories: the newest finished one, else the one being built
    (its values are projected before it mines)."""
    run = runs.latest_finished_run(session=session, model_id=model.id)
    if run is None and (building := jobs.building(session=session, model_id=model.id)) is not None:
        run = building.run
    return run


def _query_fields(q: TraceQuery, max_tokens: int) -> dict:
    """The fields every live-view context has: what the URL asked for."""
    return dict(
        title=f"{q.model.slug}: live view",
        model=q.model.slug,
        n_layers=q.model.n_layers,
        n_keys=q.model.n_keys,
        text=q.text,
        position=q.position,
        readout=q.readout,
        memories=q.memories,
        generate=q.generate,
        interventions=q.typed if q.error else format_interventions(q.interventions),
        max_tokens=max_tokens,
        target=q.target,
    )


def trace_form(live: LiveWorker, q: TraceQuery, max_tokens: int, notice: str | None = None) -> TraceContext:
    """The live view without a trace: the prompt form and the worker's state."""
    return TraceContext(**_query_fields(q, max_tokens), worker=live.health(), notice=notice)


def trace_page(session: Session, live: LiveWorker, q: TraceQuery, max_tokens: int) -> TraceContext:
    """The trace `q` asks for, asked of the live worker (without a prompt: the form only)."""
    if q.text is None:
        return trace_form(live, q, max_tokens)
    q.check(max_tokens)
    answer = live.trace(q.trace_request())
    run = value_run(session, q.model)
    attribution = answer.attribution
    traced = {signed(m) for layer in answer.layers for m in layer.memories}
    others = {signed(m) for m in attributed(attribution)} - traced if attribution else set()
    value_tokens = {}
    if run is not None:  # the listed memories' value tokens; the attribution's others only their top one
        for listed, n in ((traced, MEMORY_TOKENS), (others, 1)):
            value_tokens |= memory_reads.memory_value_tokens(
                session=session, run_id=run.id, readout=q.readout, memories=listed, n=n
            )
    unedited = answer.unedited
    figures = [*answer.layers, *(unedited.layers if unedited else [])]
    wanted = set(answer.token_ids) | {answer.prediction} | {c.token_id for c in answer.top_tokens}
    wanted |= {t for layer in figures for t in (layer.top_r, layer.top_y, layer.top_o)}
    wanted |= {t for ids in value_tokens.values() for t in ids}
    wanted |= {unedited.prediction} if unedited else set()
    wanted |= {attribution.target, *attribution.typed_tokens} if attribution else set()
    other = other_spelling(session, q.model, attribution) if attribution else None
    wanted |= {other} if other is not None else set()
    texts = vocabularies.token_texts(session=session, model_id=q.model.id, token_ids=wanted)

    def ref(token_id: int) -> TokenRef:  # built, not validated: hundreds per page, from our own data
        return TokenRef.model_construct(token_id=token_id, token=texts.get(token_id, ""))

    def layer_figures(layer: LayerFigures) -> dict:
        return dict(
            top_r=ref(layer.top_r),
            top_y=ref(layer.top_y),
            top_o=ref(layer.top_o),
            final_prob=layer.final_prob,
            final_rank=layer.final_rank,
            case=layer.case,
            settled=layer.settled,
        )

    edits = {(i.layer, i.key): i for i in q.interventions}
    layers = []
    for i, layer in enumerate(answer.layers):
        memories = []
        for m in layer.memories:
            ids = value_tokens.get(signed(m))
            edit = edits.get((m.layer, m.key))
            memories.append(
                TraceMemory.model_construct(
                    layer=m.layer,
                    key=m.key,
                    coefficient=m.coefficient,
                    unedited_coefficient=m.unedited_coefficient,
                    score=m.score,
                    tokens=[ref(t) for t in ids or []],
                    agrees=None if ids is None else layer.top_y in ids,
                    url=urls.key_url(q.model.slug, m.layer, m.key),
                    edit=None if edit is None else str(edit),
                    off_url=q.with_edit(Intervention(m.layer, m.key, "off")),
                    scale_url=q.with_edit(Intervention(m.layer, m.key, "scale", 2.0)),
                    flip_url=q.with_edit(Intervention(m.layer, m.key, "scale", -1.0)),
                )
            )
        known = [m.agrees for m in memories if m.agrees is not None]
        layers.append(
            TraceLayer(
                layer=layer.layer,
                **layer_figures(layer),
                agrees=any(known) if known else None,
                memories=memories,
                unedited=LayerFiguresView(**layer_figures(unedited.layers[i])) if unedited else None,
            )
        )
    position = answer.position
    output = {c.token_id: c for c in answer.top_tokens}  # each pass's prediction is among them
    return TraceContext(
        **_query_fields(q, max_tokens) | {"position": position},
        worker={"status": "ready"},
        run=None if run is None else run.id,
        tokens=[
            PromptToken(position=i, url=q.url(position=i), **ref(t).model_dump())
            for i, t in enumerate(answer.token_ids)
        ],
        prediction=ref(answer.prediction),
        prediction_prob=output[answer.prediction].after if answer.prediction in output else None,
        top_tokens=[
            TokenChangeView(
                before=c.before,
                after=c.after,
                change=c.after - c.before,
                target_url=q.url(target=f"#{c.token_id}"),
                **ref(c.token_id).model_dump(),
            )
            for c in answer.top_tokens
        ],
        layers=layers,
        heatmap={"active": answer.active, "ff_logit": answer.ff_logit},
        edits=[
            EditView(
                text=str(i),
                layer=i.layer,
                key=i.key,
                mode=i.mode,
                value=i.value,
                coefficient=coefficient,
                url=urls.key_url(q.model.slug, i.layer, i.key),
                remove_url=q.without(i.layer, i.key),
            )
            for i, coefficient in zip(q.interventions, answer.edited_coefficients, strict=True)
        ],
        generation=Generation(
            tokens=q.generate,
            clean=answer.generated_text,
            edited=answer.generated_edited_text if q.interventions else None,
        )
        if q.generate
        else None,
        cases=_cases(answer.layers),
        unedited=UneditedTrace(
            prediction=ref(unedited.prediction),
            prediction_prob=output[unedited.prediction].before if unedited.prediction in output else None,
            heatmap={"active": unedited.active, "ff_logit": unedited.ff_logit},
            cases=_cases(unedited.layers),
        )
        if unedited
        else None,
        circuit_url=q.circuit_url(position=position),
        attribution=attribution_view(
            q.model.slug,
            lambda token: q.url(target=f"#{token}"),
            attribution,
            value_tokens,
            ref,
            other,
            q.circuit_url(position=position),
        )
        if attribution
        else None,
    )


def _cases(layers: list[LayerFigures]) -> dict[str, int]:
    """Layers per case (§5.2)."""
    return {case: sum(layer.case == case for layer in layers) for case in CASES}
