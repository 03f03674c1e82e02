"""The layer page: every key of one layer in one index run, paged, sortable, filterable by a value token."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import composition, corpora, memory_labels, memory_reads, vocabularies
from ffmem.store.db import Session
from ffmem.store.models import QUADRANT_COLUMNS, KeyStats, LanguageModel, Run
from ffmem.store.results import results_for
from ffmem.web import urls
from ffmem.web.errors import AppError
from ffmem.web.pages.quadrants import QUADRANTS
from ffmem.web.pages.search import token_candidates
from ffmem.web.views import (
    LabelView,
    ModelPage,
    Provisional,
    RunInfo,
    TokenScore,
    Trigger,
    label_view,
    run_info,
    token_score,
    trigger_token_ids,
    trigger_view,
)


class KeyRow(BaseModel):
    """One key in the layer table."""

    key: int
    top_trigger: Trigger | None = Field(description="Its strongest positive trigger.")
    value_top: list[TokenScore] = Field(description="Its value's top tokens (raw readout).")
    max_coefficient: float | None
    min_coefficient: float | None
    positive_share: float = Field(description="The share of mined positions with m > 0.")
    density: float | None = Field(description="The share of positions where |m| is non-negligible.")
    agreement: int | None = Field(description="Positive triggers followed by one of the value's top tokens.")
    max_prob: float | None = Field(description="The value's top token's probability (raw readout).")
    next_token_rank: int | None = Field(
        description="The top trigger's next token's rank in the value's logits."
    )
    value_norm: float | None = Field(description="‖v‖.")
    dominant_quadrant: str | None = Field(
        None, description="Gated FFs: the sign quadrant (gate, input; p: ≥ 0, n: < 0) most positions are in."
    )
    dominant_share: float | None = Field(None, description="The share of mined positions in it.")
    label: LabelView | None = Field(None, description="The memory's label (its newest).")
    explanation_score: float | None = Field(
        None,
        description="Its automatic explanation's score: the scoring protocol's pooled Pearson (top and "
        "random held-out records mixed 1:1) of its dominant side; null: unexplained or unscored.",
    )
    explanation_control: float | None = Field(
        None,
        description="The same score with another memory's pattern of the layer (a fixed shuffle): chance.",
    )


class LayerContext(ModelPage):
    """One page of a layer's keys."""

    page: str = "layer"
    layer: int
    n_layers: int
    n_keys: int
    run: RunInfo
    sort: str = Field(description="The column the keys are sorted by.")
    order: str = Field(description="asc | desc.")
    token: str | None = Field(description="Keep keys whose value promotes this token.")
    token_ids: list[int] = Field(description="The vocabulary entries the token filter matched.")
    page_number: int = Field(description="From 1.")
    per_page: int
    total: int = Field(description="Keys that pass the filter.")
    pages: int
    keys: list[KeyRow]
    gated: bool = Field(description="Whether the model's FF has a gate (its keys have sign quadrants).")
    provisional: Provisional = None


def layer_page(
    session: Session,
    model: LanguageModel,
    run: Run,
    layer: int,
    *,
    pinned: int | None,
    sort: str,
    order: str,
    token: str | None,
    page: int,
    per_page: int,
) -> LayerContext:
    """`pinned`: the run the URL pins (the past-the-last-page link keeps it)."""
    token_ids = token_candidates(session, model, token) if token else None
    window = dict(sort=sort, descending=order == "desc", offset=(page - 1) * per_page, limit=per_page)
    results = results_for(session, run)
    total, stats, tops = results.layer_keys(layer, token_ids=token_ids, **window)
    pages = max(1, -(-total // per_page))
    if page > pages:
        query = dict(run=pinned, sort=sort, order=order, token=token, per_page=per_page, page=pages)
        last = urls.layer_url(model.slug, layer, **query)
        message = (
            f"There are {pages:,} pages of {per_page} keys here ({total:,} keys); "
            f"page {page:,} is past the last."
        )
        raise AppError(404, "No such page", message, link=(last, f"the last page, {pages:,}"))
    keys = [s.key for s in stats]
    values = memory_reads.top_value_tokens(
        session=session, run_id=run.id, layer=layer, keys=keys, readout="raw", n=5
    )
    sentences = corpora.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in tops.values()]
    )
    wanted = trigger_token_ids(list(tops.values()), sentences)
    wanted.update(v.token_id for tokens in values.values() for v in tokens)
    texts = vocabularies.token_texts(session=session, model_id=model.id, token_ids=wanted)
    current = memory_labels.current_labels(session=session, model_id=model.id, layer=layer, keys=keys)
    explained = composition.explanation_scores(session=session, run_id=run.id, layer=layer, keys=keys)
    rows = [
        KeyRow(
            key=s.key,
            top_trigger=(
                trigger_view(tops[s.key], sentences[tops[s.key].sentence_index], texts)
                if s.key in tops
                else None
            ),
            value_top=[token_score(v, texts) for v in values.get(s.key, [])],
            max_coefficient=s.max_coefficient,
            min_coefficient=s.min_coefficient,
            positive_share=s.positive_share,
            density=s.density,
            agreement=s.agreement,
            max_prob=s.max_prob,
            next_token_rank=s.next_token_rank,
            value_norm=s.value_norm,
            **_dominant(s),
            label=label_view(current[s.key]) if s.key in current else None,
            explanation_score=explained.get(s.key, (None, None))[0],
            explanation_control=explained.get(s.key, (None, None))[1],
        )
        for s in stats
    ]
    return LayerContext(
        title=f"{model.slug}: layer {layer}",
        model=model.slug,
        layer=layer,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        sort=sort,
        order=order,
        token=token,
        token_ids=token_ids or [],
        page_number=page,
        per_page=per_page,
        total=total,
        pages=pages,
        keys=rows,
        gated=model.gated,
        provisional=results.coverage(layer),
    )


def _dominant(stats: KeyStats) -> dict:
    """A gated key's dominant quadrant and its share (both None for an ungated one)."""
    if stats.dominant_quadrant is None:
        return {}
    column = QUADRANT_COLUMNS[stats.dominant_quadrant]
    return {"dominant_quadrant": QUADRANTS[stats.dominant_quadrant], "dominant_share": getattr(stats, column)}
