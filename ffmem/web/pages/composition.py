"""What the key, related and search pages show of how memories work together (ffmem.store.composition): the
memory's links in its run's weight graph, its automatic explanation, and explanations matching a search."""

from __future__ import annotations

import html
import textwrap
from collections.abc import Mapping

from pydantic import BaseModel, Field

from ffmem.store import composition
from ffmem.store.db import Session
from ffmem.store.models import Explanation, Run
from ffmem.web import urls
from ffmem.web.charts import BASE_LAYOUT, NEGATIVE, NEUTRAL, POSITIVE
from ffmem.web.display import visible


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


class ProtocolView(BaseModel):
    """One side's scores by the scoring protocol (ffmem.engine.explanations.protocol), each beside its
    control: the same memory's records scored with another memory's pattern of its layer (chance)."""

    pooled: float | None = Field(
        description="Pearson r of the pattern's match with sign · m over held-out top and random records "
        "mixed 1:1 (OpenAI's and Transluce's score)."
    )
    pooled_control: float | None
    random: float | None = Field(description="The same over the random records alone.")
    random_control: float | None
    auroc: float | None = Field(
        description="The match telling apart the pooled positions where the side fires (past half its "
        "largest) from the rest; 0.5: chance."
    )
    auroc_control: float | None
    top_positions: int = Field(description="Positions of its top records.")
    random_positions: int = Field(description="Positions of the random records.")
    matches: int = Field(0, description="Positions of both whose token or pair the pattern weighs.")
    simulation: float | None = Field(
        None,
        description="Where the local explainer described this side: the Pearson r of its simulated "
        "coefficients with sign · m on some of the side's top and random records (OpenAI's score).",
    )


class PolarityView(BaseModel):
    """One side of a memory, described and scored on its own records."""

    sign: int = Field(description="+1: where m > 0; −1: where m < 0.")
    source: str = Field(description="heuristic | llm:<model>.")
    text: str = Field(description="Its one-line description.")
    scores: ProtocolView | None = Field(description="Its scores (null: the run has no held-out text).")


class QuadrantExplanationView(BaseModel):
    """One sign quadrant of a gated memory, described and scored on its own records."""

    quadrant: str = Field(description="pp, pn, np or nn: the gate's sign, then the input's (p: ≥ 0, n: < 0).")
    sign: int = Field(description="m's sign in it: +1 in pp and nn, −1 in pn and np.")
    text: str = Field(description="Its one-line description, its pattern fitted on the quadrant's examples.")
    scores: ProtocolView | None = Field(
        description="Its scores by the protocol over the held-out positions in the quadrant of its side's "
        "top records and the random records (null: the run has no held-out text)."
    )


class ExplanationView(BaseModel):
    """A memory's automatic description and how well its pattern predicts the key on held-out text."""

    text: str
    source: str = Field(description="heuristic | llm:<model>.")
    score: float | None = Field(
        description="Pearson r of the pattern's match with m (−m: a negative memory) on held-out positions: "
        "the protocol's pooled score of its dominant side (before the protocol: over random held-out text)."
    )
    auroc: float | None = Field(
        description="The match telling apart positions where the key fires (past half its largest)."
    )
    positions: int = Field(description="Held-out positions scored.")
    matches: int = Field(description="Positions whose token (or pair) the pattern weighs.")
    protocol: ProtocolView | None = Field(
        None, description="Its dominant side's scores by the protocol (null: explained before it)."
    )
    polarities: list[PolarityView] = Field(
        default_factory=list,
        description="Each side (m > 0, then m < 0) described and scored on its own records; empty: explained "
        "before sides were.",
    )
    quadrants: list[QuadrantExplanationView] = Field(
        default_factory=list,
        description="A gated memory's sign quadrants with examples (pp, pn, np, nn), each described and "
        "scored on its own records; empty: an ungated memory, or explained before quadrants were.",
    )


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
        protocol=composition.protocol_of(details),
        polarities=composition.explanation_sides(found),
        quadrants=composition.explanation_quadrants(found),
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


HOVER_WIDTH, HOVER_LINES = 60, 3  # a hover's prose: lines of at most 60 characters, at most 3 of them


def hover_prose(text: str) -> str:
    """Prose (an explanation) for a hover: its spaces kept, wrapped into HOVER_LINES lines of HOVER_WIDTH
    characters at most (the last cut with "…"), each escaped, joined by <br>."""
    lines = textwrap.wrap(visible(text, spaces=False), HOVER_WIDTH)
    if len(lines) > HOVER_LINES:
        lines = lines[: HOVER_LINES - 1] + [
            textwrap.shorten(" ".join(lines[HOVER_LINES - 1 :]), HOVER_WIDTH, placeholder=" …")
        ]
    return "<br>".join(html.escape(line, quote=False) for line in lines)


NODE_LABEL_PX = 7  # the most a character of a node label ("L29 K1073", 11 px) takes, in pixels


def weight_graph(graph: WeightGraphView, layer: int, key: int, n_layers: int) -> dict:
    """The memory (centre) between the earlier memories whose values write into its key (left) and the
    later keys that read its value (right), each at its layer, the strongest highest; an edge's width is
    its |score|, its colour the sign (blue: a positive coefficient of the writer raises the reader's).
    A click on a node opens that memory (`layout.meta.links`: static/charts.js).

    Labels never overlap or leave the chart, whatever its width: each link has its own row (one writer and
    one reader a row), a writer's label sits left of it and a reader's right of it, away from the centre;
    labels may run past the axis into the side margins, which are as wide as the longest label there. The
    centre has no label (the page names it; its hover does) and the page heads the chart (a title wraps
    there, not in plotly)."""
    strongest = max([abs(link.score) for link in graph.inbound + graph.outbound] or [1.0]) or 1.0
    edges, nodes, hovers = [], [], []  # hovers: who feeds whom
    for links, side in ((graph.inbound, "middle left"), (graph.outbound, "middle right")):
        for rank, link in enumerate(links):
            y = (len(links) - 1) / 2 - rank
            color = POSITIVE if link.score > 0 else NEGATIVE
            width = 1 + 5 * abs(link.score) / strongest
            edges.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "x": [link.layer, layer],
                    "y": [y, 0],
                    "line": {"color": color, "width": width},
                    "hoverinfo": "skip",
                }
            )
            nodes.append((link, y, color, side))
            node = f"L{link.layer} K{link.key}"
            hovers.append((node, "this key") if side == "middle left" else ("this value", node))
    node_trace = {
        "type": "scatter",
        "mode": "markers+text",
        "x": [link.layer for link, *_ in nodes],
        "y": [y for _, y, *_ in nodes],
        "text": [f"L{link.layer} K{link.key}" for link, *_ in nodes],
        "textposition": [side for *_, side in nodes],
        "textfont": {"size": 11, "shadow": "auto"},  # a halo in the background colour over the edges
        "cliponaxis": False,  # a label may run into the margin beside the axis
        "marker": {"size": 11, "color": [color for _, _, color, _ in nodes]},
        "customdata": [
            [
                link.url,
                f"{name} → {to}",
                f"{link.score:+.3g}",
                hover_prose(link.explanation or "not explained"),
            ]
            for (link, *_), (name, to) in zip(nodes, hovers, strict=True)
        ],
        "hovertemplate": "%{customdata[1]}<br>score %{customdata[2]}<br>%{customdata[3]}<extra></extra>",
    }
    centre = {
        "type": "scatter",
        "mode": "markers",
        "x": [layer],
        "y": [0],
        "marker": {"size": 16, "color": NEUTRAL, "symbol": "diamond"},
        "hovertemplate": f"this memory: L{layer} K{key}<extra></extra>",
    }

    def margin(links: list) -> int:  # the widest label on that side, and the marker's half beside it
        return 20 + NODE_LABEL_PX * max([len(f"L{link.layer} K{link.key}") for link in links] or [0])

    return {
        "data": [*edges, node_trace, centre],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": ""},
            "height": 380,
            "margin": {"l": margin(graph.inbound), "r": margin(graph.outbound), "t": 16, "b": 48},
            "xaxis": {"title": {"text": "layer"}, "range": [-0.5, n_layers - 0.5]},
            "yaxis": {"visible": False},
            "meta": {"links": True},
        },
    }
