"""What the key, related and search pages show of how memories work together (ffmem.store.composition): the
memory's links in its run's weight graph, its automatic explanation, and explanations matching a search."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, Field

from ffmem.store import composition
from ffmem.store.db import Session
from ffmem.store.models import Explanation, Run
from ffmem.web import urls


class LinkView(BaseModel):
    """Another memory linked to this one in the weight graph."""

    layer: int
    key: int
    score: float = Field(
        description="v_writer · r_reader (ffmem.engine.relations.weight_graph): > 0, a positive writer "
        "raises the reader."
    )
    url: str
    explanation: str | None = Field(
        description="The other memory's automatic explanation, when the run has one."
    )


class WeightGraphView(BaseModel):
    """A memory's strongest links both ways, the largest |score| first."""

    inbound: list[LinkView] = Field(description="Earlier memories whose values write most into this key.")
    outbound: list[LinkView] = Field(description="Later keys that read this memory's value most.")


class ExplanationView(BaseModel):
    """A memory's automatic description and how well its pattern predicts the key on held-out text."""

    text: str
    source: str = Field(description="heuristic | llm:<model>.")
    score: float | None = Field(
        description="Pearson r of the pattern's match with m (−m: a negative memory) on held-out positions."
    )
    auroc: float | None = Field(
        description="The match telling apart positions where the key fires (past half its largest)."
    )
    positions: int = Field(description="Held-out positions scored.")
    matches: int = Field(description="Positions whose token (or pair) the pattern weighs.")


class WeightedToken(BaseModel):
    """A token (or a pair: the token after `previous`) the explanation's pattern weighs."""

    token_id: int
    token: str
    previous_id: int | None = Field(None, description="A pair's previous token (−1: the sentence's start).")
    previous: str | None = Field(None, description="Its text (empty at the sentence's start).")
    weight: float = Field(
        description="What the pattern expects of m at a position with this token (or pair), above the "
        "memory's typical value, in units of m as the description says it (sign · the stored weight)."
    )


class TokenTable(BaseModel):
    """The pattern the score measures: a position's match is its pair's weight where listed, else its
    token's, else 0 (ffmem.engine.explanations); each list by |weight|, the largest first."""

    sign: int = Field(
        description="The memory's strong side: +1, m > 0; −1, m < 0 (the score correlates sign · the match "
        "with sign · m)."
    )
    tokens: list[WeightedToken]
    pairs: list[WeightedToken]


class KeyExplanation(ExplanationView):
    """The key page's explanation, with the whole pattern it was scored by."""

    table: TokenTable | None = Field(
        None, description="Its token table (null: an explanation stored before patterns were tables)."
    )


class ExplanationHit(ExplanationView):
    """A memory whose automatic explanation matches a search."""

    layer: int
    key: int
    url: str


def key_explanation(
    session: Session, run: Run, layer: int, key: int, texts: Mapping[int, str]
) -> KeyExplanation | None:
    """The key page's automatic explanation with its token table (None where the run has none), its tokens
    named from `texts` (the model's vocabulary, read once by the key page)."""
    found = composition.get_explanation(session=session, run_id=run.id, layer=layer, key=key)
    if found is None:
        return None
    view = KeyExplanation(**explanation_view(found).model_dump())
    pattern = composition.explanation_pattern(found)
    if pattern and "weights" in pattern:
        view.table = token_table(pattern, texts)
    return view


def token_table(pattern: dict, texts: Mapping[int, str]) -> TokenTable:
    """A stored token table with its tokens' texts (from `texts`, token id → text), its weights in m's units
    as the description gives them (the stored ones are in units of sign · m), each list by |weight|, the
    largest first."""
    sign = pattern["sign"]
    tokens = [
        WeightedToken(token_id=t, token=texts.get(t, ""), weight=sign * w)
        for t, w in zip(pattern["final"], pattern["weights"], strict=True)
    ]
    pairs = [
        WeightedToken(
            token_id=t, token=texts.get(t, ""), previous_id=p, previous=texts.get(p, ""), weight=sign * w
        )
        for (p, t), w in zip(pattern["pairs"], pattern["pair_weights"], strict=True)
    ]
    return TokenTable(sign=sign, tokens=by_strength(tokens), pairs=by_strength(pairs))


def by_strength(weighted: list[WeightedToken]) -> list[WeightedToken]:
    """`weighted` by |weight|, the largest first (ties in the stored order)."""
    return sorted(weighted, key=lambda w: -abs(w.weight))


def weight_graph_view(session: Session, slug: str, run: Run, layer: int, key: int) -> WeightGraphView | None:
    """Who feeds the memory and whom it feeds, each with its explanation (None where the run has none)."""
    links = composition.get_links(session=session, run_id=run.id, layer=layer, key=key)
    if links is None:
        return None
    others = {(link.layer, link.key) for direction in links.values() for link in direction}
    texts = composition.explanation_texts(session=session, run_id=run.id, memories=others)

    def view(link) -> LinkView:
        return LinkView(
            layer=link.layer,
            key=link.key,
            score=link.score,
            url=urls.key_url(slug, link.layer, link.key),
            explanation=texts.get((link.layer, link.key)),
        )

    return WeightGraphView(inbound=[view(x) for x in links["in"]], outbound=[view(x) for x in links["out"]])


def explanation_view(found: Explanation) -> ExplanationView:
    details = found.details or {}
    return ExplanationView(
        text=found.text,
        source=found.source,
        score=found.score,
        auroc=details.get("auroc"),
        positions=details.get("positions", 0),
        matches=details.get("matches", 0),
    )


def explanation_hits(session: Session, slug: str, run: Run, q: str, limit: int) -> list[ExplanationHit]:
    """Memories whose automatic explanation contains `q` (any case), the best scored first."""
    if len(q.strip()) < 2:
        return []
    found = composition.search_explanations(session=session, run_id=run.id, text=q.strip(), limit=limit)
    return [
        ExplanationHit(
            layer=e.layer,
            key=e.key,
            url=urls.key_url(slug, e.layer, e.key),
            **explanation_view(e).model_dump(),
        )
        for e in found
    ]
