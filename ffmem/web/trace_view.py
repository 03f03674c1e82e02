"""The live view's contexts: a trace answered by the live worker, named with the index's tokens.

The worker answers a TraceAnswer (ffmem/engine/trace_answer.py) of token ids; the database gives their
texts and, from the newest run that has projected its values, each listed memory's value tokens (its top
tokens for m > 0, its bottom tokens for m < 0: a negative coefficient flips the value). With edits, the
figures are those of the edited forward pass, each layer's unedited figures beside them. The attribution
(who pushes the target token, here) is of that pass too; its memories' own top tokens, for the veto
marks, come from the same run's value tokens.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from ffmem.engine.attribution_terms import TARGET_CHARS, is_veto, target_id
from ffmem.engine.cases import CASES
from ffmem.engine.interventions import (
    Intervention,
    InterventionError,
    format_interventions,
    parse_interventions,
)
from ffmem.engine.trace_answer import AttributionAnswer, ContributionAnswer, LayerFigures, MemoryAnswer
from ffmem.store import jobs, queries
from ffmem.store.models import LanguageModel, Run
from ffmem.web import pages, urls
from ffmem.web.contexts import (
    AblationContext,
    AblationRow,
    AttributedMemory,
    AttributionLayer,
    AttributionView,
    EditView,
    Generation,
    LayerFiguresView,
    PromptToken,
    TokenChangeView,
    TokenRef,
    TraceContext,
    TraceLayer,
    TraceMemory,
    UneditedTrace,
)
from ffmem.web.display import visible
from ffmem.web.errors import AppError, sentence
from ffmem.web.worker_client import LiveWorker, text_max_length

MEMORY_TOKENS = 5  # value tokens shown per memory
DEFAULTS = {"readout": "norm", "memories": 10, "generate": 0}


class TraceQuery:
    """What a trace URL holds; `url(**changes)` is the same trace with some of it changed."""

    def __init__(
        self, model: LanguageModel, text, position, readout, memories, generate, intervene, target=None
    ) -> None:
        self.model, self.text, self.position, self.target = model, text, position, target
        self.readout, self.memories, self.generate = readout, memories, generate
        self.typed, self.error = intervene or "", None
        try:
            self.interventions = parse_interventions(intervene, model.n_layers, model.n_keys)
        except InterventionError as error:  # raised by trace_page; the form shows what was typed
            self.interventions = []
            self.error = AppError(400, "Bad intervention", sentence(str(error)), field="intervene")

    def url(self, fmt: str | None = None, **changes) -> str:
        values = {
            "text": self.text,
            "position": self.position,
            "intervene": format_interventions(self.interventions) or None,
            "readout": self.readout,
            "memories": self.memories,
            "generate": self.generate,
            "target": self.target,
        } | changes
        kept = {k: v for k, v in values.items() if v is not None and DEFAULTS.get(k) != v}
        return urls.trace_url(self.model.slug, fmt, **kept)

    def with_edit(self, edit: Intervention) -> str:
        others = [i for i in self.interventions if (i.layer, i.key) != (edit.layer, edit.key)]
        return self.url(intervene=format_interventions([*others, edit]))

    def without(self, layer: int, key: int) -> str:
        kept = [i for i in self.interventions if (i.layer, i.key) != (layer, key)]
        return self.url(intervene=format_interventions(kept) or None)


def value_run(session: Session, model: LanguageModel) -> Run | None:
    """The run whose value tokens name the memories: the newest finished one, else the one being built
    (its values are projected before it mines)."""
    run = queries.latest_finished_run(session=session, model_id=model.id)
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
    if q.text is None:
        return trace_form(live, q, max_tokens)
    if q.error:
        raise q.error
    if not q.text.strip():
        raise AppError(400, "Empty prompt", "The prompt is empty: type some text.", field="text")
    if len(q.text) > text_max_length(max_tokens):
        raise AppError(400, "Prompt too long", f"Prompts are limited to {max_tokens} tokens.", field="text")
    if q.target == "":
        raise AppError(
            400,
            "Empty target",
            "The target is empty: type a token, e.g. ' London', or leave it out.",
            field="target",
        )
    if q.target is not None and len(q.target) > TARGET_CHARS:
        raise AppError(
            400,
            "Target too long",
            f"A target is one token: at most {TARGET_CHARS} characters.",
            field="target",
        )
    answer = live.trace(
        {
            "model": q.model.source,
            "text": q.text,
            "position": q.position,
            "memories": q.memories,
            "readout": q.readout,
            "interventions": format_interventions(q.interventions),
            "generate": q.generate,
            "target": q.target,
        }
    )
    run = value_run(session, q.model)
    attribution = answer.attribution
    traced = {_signed(m) for layer in answer.layers for m in layer.memories}
    attributed = {_signed(m) for m in _attributed(attribution)} - traced if attribution else set()
    value_tokens = {}
    if run is not None:  # the listed memories' value tokens; the attribution's others only their top one
        for memories, n in ((traced, MEMORY_TOKENS), (attributed, 1)):
            value_tokens |= queries.memory_value_tokens(
                session=session, run_id=run.id, readout=q.readout, memories=memories, n=n
            )
    unedited = answer.unedited
    figures = [*answer.layers, *(unedited.layers if unedited else [])]
    wanted = set(answer.token_ids) | {answer.prediction} | {c.token_id for c in answer.top_tokens}
    wanted |= {t for layer in figures for t in (layer.top_r, layer.top_y, layer.top_o)}
    wanted |= {t for ids in value_tokens.values() for t in ids}
    wanted |= {unedited.prediction} if unedited else set()
    wanted |= {attribution.target, *attribution.typed_tokens} if attribution else set()
    other = _other_spelling(session, q.model, attribution) if attribution else None
    wanted |= {other} if other is not None else set()
    texts = queries.token_texts(session=session, model_id=q.model.id, token_ids=wanted)

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
            ids = value_tokens.get(_signed(m))
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
    return TraceContext(
        **_query_fields(q, max_tokens) | {"position": position},
        worker={"status": "ready"},
        run=None if run is None else run.id,
        tokens=[
            PromptToken(position=i, url=q.url(position=i), **ref(t).model_dump())
            for i, t in enumerate(answer.token_ids)
        ],
        prediction=ref(answer.prediction),
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
            heatmap={"active": unedited.active, "ff_logit": unedited.ff_logit},
            cases=_cases(unedited.layers),
        )
        if unedited
        else None,
        attribution=_attribution_view(q, attribution, value_tokens, ref, other) if attribution else None,
    )


def _attributed(attribution: AttributionAnswer) -> list[ContributionAnswer]:
    """Every memory the attribution lists: per layer and overall."""
    listed = [m for layer in attribution.layers for m in layer.memories]
    return listed + attribution.promoters + attribution.suppressors


def _other_spelling(session: Session, model: LanguageModel, answer: AttributionAnswer) -> int | None:
    """The token that is a typed target's other spelling — ` Paris` for `Paris`, `Paris` for ` Paris` —
    when the vocabulary has it as one token and it is not the token attributed; None otherwise."""
    typed = answer.typed
    if typed is None or target_id(typed) is not None:
        return None
    spelling = typed[1:] if typed.startswith(" ") else " " + typed
    if not spelling:
        return None
    found = queries.find_tokens(session=session, model_id=model.id, texts=[spelling])
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


def _attribution_view(
    q: TraceQuery, answer: AttributionAnswer, value_tokens: dict, ref, other: int | None
) -> AttributionView:
    """The attribution named with the index: each memory's own top token (the first of its signed value
    tokens), the veto marks (ffmem.engine.attribution_terms.is_veto), which token a typed target is and
    its `other` spelling."""
    sums = {layer.layer: layer.memories_sum for layer in answer.layers}
    largest = {
        layer.layer: max((abs(c.contribution) for c in layer.memories), default=0.0)
        for layer in answer.layers
    }

    def memory(m: ContributionAnswer) -> AttributedMemory:
        ids = value_tokens.get(_signed(m))
        top = ids[0] if ids else None
        return AttributedMemory.model_construct(  # built, not validated: hundreds per page, our own data
            layer=m.layer,
            key=m.key,
            coefficient=m.coefficient,
            value_logit=m.value_logit,
            contribution=m.contribution,
            top_token=None if top is None else ref(top),
            veto=is_veto(m.contribution, sums[m.layer], largest[m.layer], top == answer.target),
            url=urls.key_url(q.model.slug, m.layer, m.key),
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
        other_url=None if other is None else q.url(target=f"#{other}"),
        readout=answer.readout,
        logit=answer.logit,
        scale=answer.scale,
        total=answer.total,
        largest_residual=max((abs(layer.residual) for layer in answer.layers), default=0.0),
        vetoes=sum(m.veto for row in rows for m in row.memories),
        layers=rows,
        promoters=[memory(m) for m in answer.promoters],
        suppressors=[memory(m) for m in answer.suppressors],
    )


def _cases(layers: list[LayerFigures]) -> dict[str, int]:
    """Layers per case (§5.2)."""
    return {case: sum(layer.case == case for layer in layers) for case in CASES}


def _signed(memory: MemoryAnswer | ContributionAnswer) -> tuple[int, int, int]:
    """(layer, key, direction): a negative coefficient reads the value's bottom tokens."""
    return memory.layer, memory.key, 1 if memory.coefficient >= 0 else -1


def ablation_page(
    session: Session, live: LiveWorker, slug: str, layer: int, key: int, *, run_id: int | None, limit: int
) -> AblationContext:
    """Switch one memory off on its own top trigger prefixes: how the probabilities of its value's top
    token and of each prefix's true next token change."""
    model, run = pages.key_run_or_404(session, slug, layer, key, run_id)
    where = dict(session=session, run_id=run.id, layer=layer, key=key)
    triggers = pages.positive_triggers(session, run, layer, key, limit)
    if not triggers:
        raise AppError(
            404, "No triggers", f"Key {key} of layer {layer} has no positive triggers in run {run.id}."
        )
    top = queries.get_value_tokens(**where, readout="raw", direction=1)
    if not top:
        raise AppError(404, "No value tokens", f"Run {run.id} stores no value tokens for this memory.")
    value_token = top[0].token_id
    sentences = queries.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in triggers]
    )
    prefixes, targets, nexts = [], [], []
    for trigger in triggers:
        ids = sentences[trigger.sentence_index].token_ids
        following = ids[trigger.position + 1] if trigger.position + 1 < len(ids) else None
        prefixes.append(ids[: trigger.position + 1])
        targets.append([value_token, value_token if following is None else following])
        nexts.append(following)
    answer = live.ablation(
        {"model": model.source, "layer": layer, "key": key, "prefixes": prefixes, "targets": targets}
    )
    texts = queries.token_texts(
        session=session, model_id=model.id, token_ids={value_token, *(n for n in nexts if n is not None)}
    )
    rows = []
    for trigger, following, before, after in zip(triggers, nexts, answer.before, answer.after, strict=True):
        sentence = sentences[trigger.sentence_index]
        rows.append(
            AblationRow(
                prefix=sentence.text[: sentence.offsets[trigger.position][1]],
                coefficient=trigger.coefficient,
                next_token=None
                if following is None
                else TokenRef(token_id=following, token=texts.get(following, "")),
                value_before=before[0],
                value_after=after[0],
                next_before=None if following is None else before[1],
                next_after=None if following is None else after[1],
            )
        )
    with_next = [r for r in rows if r.next_before is not None]
    return AblationContext(
        title=f"{model.slug}: switching off layer {layer}, key {key}",
        model=model.slug,
        layer=layer,
        key=key,
        run=run.id,
        value_token=TokenRef(token_id=value_token, token=texts.get(value_token, "")),
        rows=rows,
        mean_value_change=sum(r.value_after - r.value_before for r in rows) / len(rows),
        mean_next_change=sum(r.next_after - r.next_before for r in with_next) / len(with_next)
        if with_next
        else None,
        trace_url=urls.trace_url(model.slug, text=rows[0].prefix, intervene=f"L{layer}K{key}"),
    )
