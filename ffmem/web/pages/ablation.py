"""The ablation page: one memory switched off on its own top trigger prefixes (asked of the live worker):
how the probabilities of its value's top token and of each prefix's true next token change. The page
renders at once (`AblationPending`: its heading and a busy region) and htmx loads the result into it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.engine.live.protocol import AblationRequest
from ffmem.store import corpora, memory_reads, vocabularies
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import results_for
from ffmem.web import urls
from ffmem.web.errors import AppError
from ffmem.web.views import ModelPage, TokenRef
from ffmem.web.worker_client import LiveWorker


class AblationRow(BaseModel):
    prefix: str = Field(description="The trigger prefix, ending at the trigger token.")
    coefficient: float
    next_token: TokenRef | None
    value_before: float = Field(description="Probability of the value's top token, memory on.")
    value_after: float = Field(description="… and switched off.")
    next_before: float | None
    next_after: float | None


class AblationMemory(ModelPage):
    """The memory the ablation page switches off, and the run whose triggers it takes."""

    page: str = "ablation"
    layer: int
    key: int
    run: int


class AblationContext(AblationMemory):
    """One memory switched off on its top trigger prefixes."""

    value_token: TokenRef = Field(description="The value's top token (raw readout)")
    rows: list[AblationRow]
    mean_value_change: float
    mean_next_change: float | None
    trace_url: str = Field(description="The top trigger's prefix in the live view, with this memory off.")


class AblationPending(AblationMemory):
    """The ablation page before its result: the heading, and the region htmx loads the result into."""

    triggers: int = Field(description="Top trigger prefixes it tests on.")
    result_url: str = Field(description="The result, the page's `ablation` fragment (htmx asks it on load).")


def ablation_memory(model: LanguageModel, run: Run, layer: int, key: int) -> dict:
    """The fields of `AblationMemory`: what both the page and its result name."""
    title = f"{model.slug}: switching off layer {layer}, key {key}"
    return dict(title=title, model=model.slug, layer=layer, key=key, run=run.id)


def ablation_pending(model: LanguageModel, run: Run, layer: int, key: int, *, limit: int) -> AblationPending:
    """The page before its result: nothing asked of the live worker yet."""
    return AblationPending(
        **ablation_memory(model, run, layer, key),
        triggers=limit,
        result_url=urls.ablation_url(model.slug, layer, key, run=run.id, triggers=limit),
    )


def ablation_page(
    session: Session, live: LiveWorker, model: LanguageModel, run: Run, layer: int, key: int, *, limit: int
) -> AblationContext:
    """Switch one memory off on its own top trigger prefixes: how the probabilities of its value's top
    token and of each prefix's true next token change."""
    where = dict(session=session, run_id=run.id, layer=layer, key=key)
    triggers = results_for(session, run).triggers(layer, key, 1, limit)
    if not triggers:
        raise AppError(
            404, "No triggers", f"Key {key} of layer {layer} has no positive triggers in run {run.id}."
        )
    top = memory_reads.get_value_tokens(**where, readout="raw", direction=1)
    if not top:
        raise AppError(404, "No value tokens", f"Run {run.id} stores no value tokens for this memory.")
    value_token = top[0].token_id
    sentences = corpora.get_sentences(
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
        AblationRequest(model=model.source, layer=layer, key=key, prefixes=prefixes, targets=targets)
    )
    texts = vocabularies.token_texts(
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
        **ablation_memory(model, run, layer, key),
        value_token=TokenRef(token_id=value_token, token=texts.get(value_token, "")),
        rows=rows,
        mean_value_change=sum(r.value_after - r.value_before for r in rows) / len(rows),
        mean_next_change=sum(r.next_after - r.next_before for r in with_next) / len(with_next)
        if with_next
        else None,
        trace_url=urls.trace_url(model.slug, text=rows[0].prefix, intervene=f"L{layer}K{key}"),
    )
