"""What the key, related and search pages show of how memories work together (ffmem.store.composition): the
memory's links in its run's weight graph, its automatic explanation, and explanations matching a search."""

from __future__ import annotations

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from ffmem.store import composition
from ffmem.store.models import Explanation, Run
from ffmem.web import urls


class LinkView(BaseModel):
    """Another memory linked to this one in the weight graph."""

    layer: int
    key: int
    score: float = Field(
        description="v_writer · r_reader (ffmem.engine.weight_graph): > 0, a positive writer raises "
        "the reader."
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


class ExplanationHit(ExplanationView):
    """A memory whose automatic explanation matches a search."""

    layer: int
    key: int
    url: str


def key_explanation(session: Session, run: Run, layer: int, key: int) -> ExplanationView | None:
    """The key page's automatic explanation (None where the run has none)."""
    found = composition.get_explanation(session=session, run_id=run.id, layer=layer, key=key)
    return None if found is None else explanation_view(found)


def weight_graph_view(session: Session, slug: str, run: Run, layer: int, key: int) -> WeightGraphView | None:
    """Who feeds the memory and whom it feeds, each with its explanation (None where the run has none)."""
    links = composition.get_links(session=session, run_id=run.id, layer=layer, key=key)
    if links is None:
        return None
    others = {(link.layer, link.key) for direction in links.values() for link in direction}
    texts = explanation_texts(session, run.id, others)

    def view(link) -> LinkView:
        return LinkView(
            layer=link.layer,
            key=link.key,
            score=link.score,
            url=urls.key_url(slug, link.layer, link.key),
            explanation=texts.get((link.layer, link.key)),
        )

    return WeightGraphView(inbound=[view(x) for x in links["in"]], outbound=[view(x) for x in links["out"]])


def explanation_texts(session: Session, run_id: int, memories: set[tuple[int, int]]) -> dict:
    """(layer, key) → explanation text, for those of `memories` the run explains."""
    if not memories:
        return {}
    # Layers IN and keys IN (then the pairs kept here): primary-key lookups, where a row-value IN makes
    # SQLite read the whole run's explanations.
    query = select(Explanation.layer, Explanation.key, Explanation.text).where(
        Explanation.run_id == run_id,
        Explanation.layer.in_(sorted({layer for layer, _ in memories})),
        Explanation.key.in_(sorted({key for _, key in memories})),
    )
    found = {(layer, key): text for layer, key, text in session.execute(query)}
    return {memory: text for memory, text in found.items() if memory in memories}


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
