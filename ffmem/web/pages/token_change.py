"""What this memory does: one memory amplified and switched off where its key fires, asked of the live
worker (ffmem.engine.values.token_change through /token-change) — on its top trigger prefixes, or at the top
positions of a text of your own (`?text=`: the URL is the share link) — its TokenChange (the tokens that rise
and fall) beside its value's VocabProj, and their agreement against a control memory's. The page renders at
once (`TokenChangePending`) and htmx loads the result into it, as the ablation page does."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.engine.live.protocol import CHANGE_FACTOR, OutputScoreAnswer, TokenChangeRequest
from ffmem.store import corpora, vocabularies
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import results_for
from ffmem.web import urls
from ffmem.web.errors import AppError
from ffmem.web.views import ModelPage, TokenRef
from ffmem.web.worker_client import LiveWorker

SHOWN_CONTEXT = 120  # characters of a context's end shown


class TokenShiftView(BaseModel):
    """One token of the TokenChange."""

    token: TokenRef
    change: float = Field(description="Mean log p(amplified) − log p(switched off).")
    base: float = Field(description="Mean probability, the memory as it is.")
    amplified: float
    off: float


class ChangeContextView(BaseModel):
    """One context: its end, and m at its last token."""

    text: str = Field(description="The context's last characters, ending at the edited token.")
    coefficient: float


class TokenChangeMemory(ModelPage):
    """The memory the page measures, and what it is measured on."""

    page: str = "token_change"
    layer: int
    key: int
    run: int
    text: str | None = Field(None, description="Your text (None: the memory's top trigger prefixes).")
    contexts: int = Field(description="The most contexts measured.")
    factor: float = Field(description="Amplified: m → factor·m at each context's last token.")


class TokenChangePending(TokenChangeMemory):
    """The page before its result: the heading, and the region htmx loads the result into."""

    result_url: str = Field(description="The result, the page's `token_change` fragment (htmx asks it).")


class TokenChangeContext(TokenChangeMemory):
    """What the memory does to the next token where its key fires, and how well its value predicts it."""

    measured: list[ChangeContextView]
    promoted: list[TokenShiftView] = Field(description="Rise most amplified and fall most switched off.")
    suppressed: list[TokenShiftView] = Field(description="The reverse.")
    vocab_proj: list[TokenRef] = Field(description="The value's top tokens by its raw logits (v·E).")
    score: OutputScoreAnswer = Field(description="VocabProj against TokenChange.")
    control: OutputScoreAnswer = Field(description="The control memory's VocabProj against it.")
    control_url: str = Field(description="The control memory's key page.")
    share_url: str = Field(description="This measurement's page.")


def token_change_memory(
    model: LanguageModel, run: Run, layer: int, key: int, text: str | None, contexts: int, factor: float
) -> dict:
    """The fields of `TokenChangeMemory`: what both the page and its result name."""
    title = f"{model.slug}: what layer {layer}, key {key} does"
    return dict(
        title=title,
        model=model.slug,
        layer=layer,
        key=key,
        run=run.id,
        text=text,
        contexts=contexts,
        factor=factor,
    )


def change_query(run: Run, text: str | None, contexts: int, factor: float) -> dict:
    """The query that asks for this measurement again (defaults left out: a short share link)."""
    query: dict = {"run": run.id, "text": text or None}
    if factor != CHANGE_FACTOR:
        query["factor"] = factor
    return query | {"contexts": contexts}


def token_change_pending(
    model: LanguageModel, run: Run, layer: int, key: int, *, text: str | None, contexts: int, factor: float
) -> TokenChangePending:
    """The page before its result: nothing asked of the live worker yet."""
    query = change_query(run, text, contexts, factor)
    return TokenChangePending(
        **token_change_memory(model, run, layer, key, text, contexts, factor),
        result_url=urls.token_change_url(model.slug, layer, key, **query),
    )


def token_change_page(
    session: Session,
    live: LiveWorker,
    model: LanguageModel,
    run: Run,
    layer: int,
    key: int,
    *,
    text: str | None,
    contexts: int,
    factor: float,
) -> TokenChangeContext:
    """Ask the live worker what the memory does on its top triggers (or your text), and name its tokens."""
    request = dict(model=model.source, layer=layer, key=key, factor=factor, contexts=contexts)
    if text:
        request["text"] = text
    else:
        triggers = results_for(session, run).triggers(layer, key, 1, contexts)
        if not triggers:
            raise AppError(
                404, "No triggers", f"Key {key} of layer {layer} has no positive triggers in run {run.id}."
            )
        sentences = corpora.get_sentences(
            session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in triggers]
        )
        request["prefixes"] = [sentences[t.sentence_index].token_ids[: t.position + 1] for t in triggers]
    answer = live.token_change(TokenChangeRequest(**request))
    shown = {t.token_id for t in answer.promoted + answer.suppressed} | set(answer.vocab_proj)
    shown |= {i for row in answer.contexts for i in row[-40:]}
    texts = vocabularies.token_texts(session=session, model_id=model.id, token_ids=shown)

    def ref(token_id: int) -> TokenRef:
        return TokenRef(token_id=token_id, token=texts.get(token_id, ""))

    def views(shifts) -> list[TokenShiftView]:
        return [
            TokenShiftView(
                token=ref(s.token_id), change=s.change, base=s.base, amplified=s.amplified, off=s.off
            )
            for s in shifts
        ]

    query = change_query(run, text, contexts, factor)
    return TokenChangeContext(
        **token_change_memory(model, run, layer, key, text, contexts, factor),
        measured=[
            ChangeContextView(
                text="".join(texts.get(i, "") for i in row[-40:])[-SHOWN_CONTEXT:], coefficient=m
            )
            for row, m in zip(answer.contexts, answer.coefficients, strict=True)
        ],
        promoted=views(answer.promoted),
        suppressed=views(answer.suppressed),
        vocab_proj=[ref(i) for i in answer.vocab_proj],
        score=answer.score,
        control=answer.control,
        control_url=urls.key_url(model.slug, layer, answer.control.key, run=run.id),
        share_url=urls.token_change_url(model.slug, layer, key, **query),
    )
