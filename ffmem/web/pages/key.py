"""The key page: one memory's trigger prefixes (its key) and its value's vocabulary distribution, its
statistics and histogram, key–value agreement, its labels and explanation, and "try your own text"."""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, Field

from ffmem.store import corpora, memory_labels, token_changes, value_histograms, vocabularies
from ffmem.store.db import Session
from ffmem.store.memory_lists import READOUTS
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import results_for
from ffmem.web import patterns, urls
from ffmem.web.pages.composition import KeyExplanation, key_explanation
from ffmem.web.pages.quadrants import QuadrantPanel, quadrant_panel
from ffmem.web.pages.try_text import TryText
from ffmem.web.patterns import PatternHints
from ffmem.web.shading import key_scale, stored_shading
from ffmem.web.views import (
    LabelView,
    ModelPage,
    Provisional,
    RunInfo,
    TokenRef,
    TokenScore,
    Trigger,
    label_view,
    run_info,
    token_score,
    trigger_view,
)


class ValueReadout(BaseModel):
    """A value's top and bottom tokens under one readout."""

    top: list[TokenScore] = Field(description="The highest logits first: what the value promotes.")
    bottom: list[TokenScore] = Field(
        description="The lowest first: what it suppresses (or, for m < 0, promotes)."
    )


class Agreement(BaseModel):
    """How many trigger next-tokens are among the value's top tokens (raw readout).

    Positive triggers are compared with the value's top tokens; negative triggers (m < 0 flips
    the value) with its bottom tokens.
    """

    readout: str = "raw"
    positive: int = Field(description="Positive triggers whose next token is among the value's top tokens.")
    positive_of: int = Field(description="Positive triggers with a next token.")
    negative: int = Field(description="Negative triggers whose next token is among its bottom tokens.")
    negative_of: int = Field(description="Negative triggers with a next token.")


class KeyStatsView(BaseModel):
    """A key's coefficient statistics over every mined position of the run."""

    mean: float = Field(description="The mean coefficient m.")
    positive_share: float = Field(description="The share of positions with m > 0.")
    density: float | None = Field(description="The share of positions where |m| is non-negligible.")
    max_coefficient: float | None
    min_coefficient: float | None
    max_prob: float | None = Field(description="The value's top token's probability (raw readout).")
    agreement: int | None = Field(description="Positive triggers followed by one of the value's top tokens.")
    next_token_rank: int | None = Field(
        description="The top trigger's next token's rank in the value's logits (0: top; Fig. 5)."
    )
    value_norm: float | None = Field(description="‖v‖, the value vector's norm.")
    first_token_change: float | None = Field(
        None,
        description="Fig. 3, when `ffmem analyze` sampled this key: m's relative change without the "
        "prefix's first token.",
    )
    last_token_change: float | None = Field(None, description="… without its last token.")
    shallowness: float | None = Field(None, description="−last_token_change clipped to 0–1.")


class Histogram(BaseModel):
    """A key's coefficients over every mined position, in signed power-of-two bins."""

    edges: list[float] = Field(
        description="The bin edges, shared by all keys (ffmem.engine.mining.histogram_edges)."
    )
    labels: list[str] = Field(description="One per bin: its range.")
    counts: list[int] = Field(description="Positions per bin.")


MARKED_TOKENS = 10  # a value's top and bottom tokens marked on its logit histogram


class ValueHistogramView(BaseModel):
    """A value's logits over the whole vocabulary under one readout, in equal bins
    (ffmem.store.value_histograms); the page marks its first MARKED_TOKENS top and bottom tokens (`value`)."""

    edges: list[float] = Field(
        description="The bins' edges, from its lowest logit to its highest (bins + 1)."
    )
    counts: list[int] = Field(
        description="Tokens per bin (the highest logit in the last bin); they sum to the vocabulary size."
    )


class StoredTokenChange(BaseModel):
    """What the memory's value writes as the run measured it, where the run sampled it
    (ffmem.store.token_changes): its TokenChange over held-out contexts and VocabProj's agreement with it,
    beside a control memory's."""

    contexts: int = Field(description="Held-out contexts where its key fires most, averaged.")
    promoted: list[TokenRef] = Field(description="Rise most amplified and fall most switched off.")
    suppressed: list[TokenRef] = Field(description="The reverse.")
    overlap: float = Field(
        description="Its value's top 10 (raw logits) shared with the top 10 promoted, / 10."
    )
    spearman: float = Field(description="Rank correlation of its value's logits with the TokenChange.")
    control_key: int = Field(description="The control memory of the layer (the key half a layer away).")
    control_overlap: float
    control_spearman: float


class Links(BaseModel):
    """The key page's links."""

    previous: str | None
    next: str | None
    random: str
    permalink: str = Field(description="This key, pinned to the run.")
    layer: str
    samples: str = Field(description="Its examples across the range (the page loads them when scrolled to).")
    related: str = Field(
        description="Its neighbours and weight graph (the page loads them when scrolled to)."
    )
    token_change: str = Field(description="What it does to the next token, live (its TokenChange).")


class KeyContext(ModelPage):
    """One memory in one index run."""

    page: str = "key"
    layer: int
    key: int
    n_layers: int
    n_keys: int
    run: RunInfo
    triggers: list[Trigger] = Field(description="The strongest positive triggers (m > 0), strongest first.")
    negative_triggers: list[Trigger] = Field(
        description="The strongest negative triggers (m < 0), lowest first."
    )
    more_triggers: int = Field(
        description="How many more positive triggers the run holds beyond those shown."
    )
    value: dict[str, ValueReadout] = Field(
        description="Readout (raw: v·E; norm: lm_head(final_norm(v))) → the value's top and bottom tokens."
    )
    stats: KeyStatsView | None
    histogram: Histogram | None
    agreement: Agreement
    links: Links
    provisional: Provisional = None
    patterns: PatternHints | None = Field(None, description="How the shown positive triggers end.")
    label: LabelView | None = Field(None, description="The memory's label (its newest).")
    label_history: list[LabelView] = Field([], description="Its earlier labels, the newest first.")
    label_url: str = Field("", description="Where the label form posts.")
    explanation: KeyExplanation | None = Field(
        None, description="Its automatic description (null: none for this run)."
    )
    try_text: TryText | None = Field(
        None, description='"Try your own text": the box, and the answer for `?text=`.'
    )
    quadrants: QuadrantPanel | None = Field(
        None, description="A gated memory's sign quadrants of gate and input (null: the FF has no gate)."
    )
    token_change: StoredTokenChange | None = Field(
        None, description="Its TokenChange as the run measured it (null: not in the run's sample)."
    )
    value_histograms: dict[str, ValueHistogramView] | None = Field(
        None,
        description="The statistics panel's: readout (raw: v·E; norm: lm_head(final_norm(v))) → the value's "
        "logit histogram over the whole vocabulary; null: the run stores none (built before they were).",
    )


def key_page(
    session: Session, model: LanguageModel, run: Run, layer: int, key: int, *, limit: int
) -> KeyContext:
    slug = model.slug
    results = results_for(session, run)
    shaded = results.shaded_triggers(layer, key)  # the first triggers whose sentences are shaded
    every_positive = results.triggers(layer, key, 1)
    positive = every_positive[: max(limit, shaded[0])]
    negative = results.triggers(layer, key, -1, max(limit, shaded[1]))
    more = len(every_positive) - min(len(positive), limit)
    value_rows = results.value_readouts(layer, key)
    sentences = corpora.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in positive + negative]
    )
    endings = [sentences[t.sentence_index].token_ids[: t.position + 1] for t in positive]
    history = memory_labels.label_history(session=session, model_id=model.id, layer=layer, key=key)
    # The whole vocabulary (cached per process), read once a request: ~1,500 lookups here and below.
    texts = vocabularies.vocabulary(session=session, model_id=model.id)
    top_ids = [v.token_id for v in value_rows["raw", 1]]
    bottom_ids = [v.token_id for v in value_rows["raw", -1]]
    triggers = [trigger_view(t, sentences[t.sentence_index], texts, top_ids) for t in positive]
    negative_triggers = [trigger_view(t, sentences[t.sentence_index], texts, bottom_ids) for t in negative]
    views = [*triggers[: shaded[0]], *negative_triggers[: shaded[1]]]
    arrays = results.trigger_shading(layer, key, [len(sentences[v.sentence_index].token_ids) for v in views])
    scale = key_scale(positive, negative)
    for view, values in zip(views, arrays, strict=True):
        view.shading = stored_shading(sentences[view.sentence_index], values, view.position, texts, scale)
    triggers, negative_triggers = triggers[:limit], negative_triggers[:limit]
    found = results.key_stats(layer, key)
    stats = None if found is None else KeyStatsView.model_validate(found, from_attributes=True)
    histogram = None
    if found is not None:
        edges = run.histogram_edges
        histogram = Histogram(edges=edges, labels=bin_labels(edges), counts=found.histogram)
    value = {
        readout: ValueReadout(
            top=[token_score(v, texts) for v in value_rows[readout, 1]],
            bottom=[token_score(v, texts) for v in value_rows[readout, -1]],
        )
        for readout in READOUTS
    }
    pinned = {"run": run.id}
    previous = (layer, key - 1) if key > 0 else (layer - 1, model.n_keys - 1) if layer > 0 else None
    following = (
        (layer, key + 1) if key + 1 < model.n_keys else (layer + 1, 0) if layer + 1 < model.n_layers else None
    )
    random_key = (random.randrange(model.n_layers), random.randrange(model.n_keys))
    return KeyContext(
        title=f"{model.slug}: layer {layer}, key {key}",
        model=model.slug,
        layer=layer,
        key=key,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        triggers=triggers,
        negative_triggers=negative_triggers,
        more_triggers=more,
        value=value,
        stats=stats,
        histogram=histogram,
        provisional=results.coverage(layer),
        patterns=patterns.pattern_hints(endings, texts),
        label=label_view(history[0]) if history else None,
        label_history=[label_view(label) for label in history[1:]],
        label_url=urls.label_url(slug, layer, key),
        explanation=key_explanation(session, run, layer, key, texts),
        quadrants=quadrant_panel(results, slug, run, layer, key),
        value_histograms=value_histogram_views(session, run, layer, key),
        token_change=stored_token_change(session, run, layer, key, texts),
        agreement=Agreement(
            positive=sum(t.value_rank is not None for t in triggers),
            positive_of=sum(t.next_token_id is not None for t in triggers),
            negative=sum(t.value_rank is not None for t in negative_triggers),
            negative_of=sum(t.next_token_id is not None for t in negative_triggers),
        ),
        links=Links(
            previous=urls.key_url(slug, *previous) if previous else None,
            next=urls.key_url(slug, *following) if following else None,
            random=urls.key_url(slug, *random_key),
            permalink=urls.key_url(slug, layer, key, **pinned),
            layer=urls.layer_url(slug, layer),
            samples=urls.samples_url(slug, layer, key, **pinned),
            related=urls.related_url(slug, layer, key, **pinned),
            token_change=urls.token_change_url(slug, layer, key, **pinned),
        ),
    )


def stored_token_change(
    session: Session, run: Run, layer: int, key: int, texts: dict[int, str]
) -> StoredTokenChange | None:
    """The run's measurement of the memory's TokenChange, its tokens named; None where it has none."""
    row = token_changes.get_token_change(session=session, run_id=run.id, layer=layer, key=key)
    if row is None:
        return None

    def refs(ids: list[int]) -> list[TokenRef]:
        return [TokenRef(token_id=i, token=texts.get(i, "")) for i in ids]

    return StoredTokenChange(
        contexts=row.contexts,
        promoted=refs(row.promoted),
        suppressed=refs(row.suppressed),
        overlap=row.overlap,
        spearman=row.spearman,
        control_key=row.control_key,
        control_overlap=row.control_overlap,
        control_spearman=row.control_spearman,
    )


def value_histogram_views(
    session: Session, run: Run, layer: int, key: int
) -> dict[str, ValueHistogramView] | None:
    """The value's stored logit histograms, per readout; None where the run stores none."""
    stored = value_histograms.value_histogram(session=session, run_id=run.id, layer=layer, key=key)
    if stored is None:
        return None
    return {readout: ValueHistogramView(edges=h.edges, counts=h.counts) for readout, h in stored.items()}


def histogram_bin(edges: list[float], m: float) -> int:
    """The bin of the coefficient histogram (`edges`: mining's) that holds m: its negative bins by magnitude
    up to the middle one (+0 exactly), then its positive ones; a value on an edge goes to the larger
    magnitude."""
    middle = len(edges) // 2  # the +0 bin
    if m > 0:
        return middle + 1 + sum(0 < e <= m for e in edges)
    if m < 0:
        return middle - 1 - sum(m <= e < 0 for e in edges)
    return middle


def bin_labels(edges: list[float]) -> list[str]:
    """One label per histogram bin: negative bins, then exactly 0, then positive bins (see mining)."""
    negative, positive = edges[: len(edges) // 2 - 1], edges[len(edges) // 2 + 1 :]

    def power(x: float) -> str:
        return f"2^{round(math.log2(abs(x)))}"

    labels = [f"≤ −{power(negative[0])}"]
    labels += [f"(−{power(a)}, −{power(b)}]" for a, b in zip(negative, negative[1:], strict=False)]
    labels += [f"(−{power(negative[-1])}, −0]", "+0"]
    labels += [f"(0, {power(positive[0])})"]
    labels += [f"[{power(a)}, {power(b)})" for a, b in zip(positive, positive[1:], strict=False)]
    labels += [f"≥ {power(positive[-1])}"]
    return labels
