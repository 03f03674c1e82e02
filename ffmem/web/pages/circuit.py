"""The live view's memory circuit: for the selected position and target, the memories that push the target
most and the earlier memories that fed their coefficients on this prompt (ffmem.engine.live.circuit, asked of
the live worker), each named with its value's own top token from the index and linked to its key page."""

from __future__ import annotations

from pydantic import Field

from ffmem.engine.live.interventions import format_interventions
from ffmem.engine.live.protocol import CircuitEdgeAnswer, CircuitNodeAnswer, CircuitOptions
from ffmem.store import memory_reads, vocabularies
from ffmem.store.db import Session
from ffmem.web import urls
from ffmem.web.charts import BASE_LAYOUT, NEGATIVE, NEUTRAL, POSITIVE, label
from ffmem.web.pages.trace import PromptToken, value_run
from ffmem.web.pages.trace_query import TraceQuery
from ffmem.web.views import ModelPage, TokenRef
from ffmem.web.worker_client import LiveWorker


class CircuitMemory(CircuitNodeAnswer):
    """A memory of the circuit at the selected position: the worker's node, named and linked."""

    top_token: TokenRef | None = Field(
        description="The top token of sign(m)·v under the readout (None: the index has none)."
    )
    url: str = Field(description="The key page.")


class CircuitContext(ModelPage):
    """A prompt's memory circuit for one position and target, asked of the live worker."""

    page: str = "circuit"
    text: str | None = Field(description="None: no prompt yet (the form only).")
    position: int | None
    readout: str
    target: str | None = Field(description="The target as the URL asks (`target=`; None: the prediction).")
    interventions: str = Field(description="The edits as the URL keeps them.")
    options: CircuitOptions
    max_tokens: int
    notice: str | None = Field(None, description="Why there is no circuit (worker down, loading or busy).")
    notice_field: str | None = Field(None, description="The form field the notice is about.")
    run: int | None = Field(None, description="The index run whose value tokens name the memories.")
    tokens: list[PromptToken] = Field([], description="The prompt; each token's URL selects its position.")
    attributed: TokenRef | None = Field(None, description="The token attributed.")
    logit: float | None = Field(None, description="Its logit after the position under the readout.")
    nodes: list[CircuitMemory] = []
    edges: list[CircuitEdgeAnswer] = Field(
        [], description="upstream → downstream: term = m_j·(v_j·ρ_i), coefficient = m_i; per hop, by |term|."
    )
    largest_terms: list[float] = Field([], description="Per hop, the largest |term| (the threshold's unit).")
    trace_url: str = Field(description="The live view of the same prompt, position and target.")
    link: str | None = Field(None, description="This circuit's URL, its share link.")


def circuit_form(q: TraceQuery, options: CircuitOptions, max_tokens: int, **shown) -> CircuitContext:
    """The circuit page without a circuit: its form (and `shown`: why there is none)."""
    query = dict(
        title=f"{q.model.slug}: memory circuit",
        model=q.model.slug,
        text=q.text,
        position=q.position,
        readout=q.readout,
        target=q.target,
        interventions=q.typed if q.error else format_interventions(q.interventions),
        options=options,
        max_tokens=max_tokens,
        trace_url=q.url(),
        link=q.circuit_url(**options.model_dump()),
    )
    return CircuitContext(**query | shown)


def circuit_page(
    session: Session, live: LiveWorker, q: TraceQuery, options: CircuitOptions, max_tokens: int
) -> CircuitContext:
    """The circuit `q` and `options` ask for (without a prompt: the form only)."""
    if q.text is None:
        return circuit_form(q, options, max_tokens)
    q.check(max_tokens)
    answer = live.circuit(q.circuit_request(options))
    run = value_run(session, q.model)
    signed = {(n.layer, n.key, 1 if n.coefficient >= 0 else -1) for n in answer.nodes}
    tops = {}
    if run is not None:
        tops = memory_reads.memory_value_tokens(
            session=session, run_id=run.id, readout=q.readout, memories=signed, n=1
        )
    wanted = set(answer.token_ids) | {answer.target} | {ids[0] for ids in tops.values() if ids}
    texts = vocabularies.token_texts(session=session, model_id=q.model.id, token_ids=wanted)

    def ref(token_id: int) -> TokenRef:
        return TokenRef(token_id=token_id, token=texts.get(token_id, ""))

    def top_token(layer: int, key: int, coefficient: float) -> TokenRef | None:
        ids = tops.get((layer, key, 1 if coefficient >= 0 else -1))
        return ref(ids[0]) if ids else None

    return circuit_form(
        q,
        options,
        max_tokens,
        position=answer.position,
        run=None if run is None else run.id,
        tokens=[
            PromptToken(
                position=i, url=q.circuit_url(position=i, **options.model_dump()), **ref(t).model_dump()
            )
            for i, t in enumerate(answer.token_ids)
        ],
        attributed=ref(answer.target),
        logit=answer.logit,
        nodes=[
            CircuitMemory(
                **n.model_dump(),
                top_token=top_token(n.layer, n.key, n.coefficient),
                url=urls.key_url(q.model.slug, n.layer, n.key),
            )
            for n in answer.nodes
        ],
        edges=answer.edges,
        largest_terms=answer.largest_terms,
    )


CIRCUIT_LABELS = 8  # the memories named on the circuit's chart, by |contribution|; the rest on hover
CIRCUIT_EDGES = 20  # the edges drawn per hop, by |term| (the table lists every edge)


def circuit_edges(ctx: CircuitContext) -> list[CircuitEdgeAnswer]:
    """The edges the chart draws: per hop (an edge into a hop-h memory is of hop h + 1) the CIRCUIT_EDGES
    strongest by |term|, so that hops = 2 stays readable."""
    hops = {(n.layer, n.key): n.hop for n in ctx.nodes}
    per_hop: dict[int, list[CircuitEdgeAnswer]] = {}
    for e in sorted(ctx.edges, key=lambda e: -abs(e.term)):
        per_hop.setdefault(hops[e.downstream.layer, e.downstream.key], []).append(e)
    return [e for _, edges in sorted(per_hop.items()) for e in edges[:CIRCUIT_EDGES]]


def circuit_graph(ctx: CircuitContext) -> dict:
    """A prompt's memory circuit, layered: a column per layer present (the x-axis names only those, evenly
    spaced), the memories of a layer stacked (hop 0 first, then by |contribution|); a node's size is its
    |contribution| to the target, its colour the contribution's sign (blue promotes, orange suppresses), hop 0
    a diamond; an edge's width is its |term|, its colour the term's sign (blue: the upstream memory raised the
    downstream coefficient here). A click on a node opens its key page (static/charts.js).

    Drawn: the memories that push the target (hop 0) and those on a drawn edge (`circuit_edges`). Named: the
    CIRCUIT_LABELS that push most, above their node in even columns and below it in odd ones (so neighbouring
    columns' names do not meet); every node names itself on hover. static/charts.js hides a name that would
    still cover another (`layout.meta.declutter`), the strongest first, and so the layer names on a phone."""
    edges = circuit_edges(ctx)
    on_edges = {(m.layer, m.key) for e in edges for m in (e.upstream, e.downstream)}
    nodes = [n for n in ctx.nodes if n.hop == 0 or (n.layer, n.key) in on_edges]
    nodes.sort(key=lambda n: (n.hop, -abs(n.contribution)))  # the strongest first: named and kept first
    layers = sorted({n.layer for n in nodes})
    column = {layer: i for i, layer in enumerate(layers)}
    stacked: dict[int, list[CircuitMemory]] = {}
    for n in nodes:
        stacked.setdefault(n.layer, []).append(n)
    where = {
        (n.layer, n.key): (column[n.layer], (len(stack) - 1) / 2 - row)
        for stack in stacked.values()
        for row, n in enumerate(stack)
    }
    strongest = max([abs(e.term) for e in edges] or [1.0]) or 1.0
    edge_traces = [
        {
            "type": "scatter",
            "mode": "lines",
            "x": [where[e.upstream.layer, e.upstream.key][0], where[e.downstream.layer, e.downstream.key][0]],
            "y": [where[e.upstream.layer, e.upstream.key][1], where[e.downstream.layer, e.downstream.key][1]],
            "line": {"color": POSITIVE if e.term > 0 else NEGATIVE, "width": 1 + 6 * abs(e.term) / strongest},
            "hoverinfo": "skip",
        }
        for e in edges
    ]
    named = {id(n) for n in sorted(nodes, key=lambda n: -abs(n.contribution))[:CIRCUIT_LABELS]}
    largest = max([abs(n.contribution) for n in nodes] or [1.0]) or 1.0
    node_trace = {
        "type": "scatter",
        "mode": "markers+text",
        "x": [where[n.layer, n.key][0] for n in nodes],
        "y": [where[n.layer, n.key][1] for n in nodes],
        "text": [f"L{n.layer}K{n.key}" if id(n) in named else "" for n in nodes],
        "textposition": ["top center" if column[n.layer] % 2 == 0 else "bottom center" for n in nodes],
        "textfont": {"size": 10, "shadow": "auto"},
        "cliponaxis": False,
        "marker": {
            "size": [8 + 22 * abs(n.contribution) / largest for n in nodes],
            "color": [POSITIVE if n.contribution > 0 else NEGATIVE for n in nodes],
            "symbol": ["diamond" if n.hop == 0 else "circle" for n in nodes],
            "line": {"color": NEUTRAL, "width": 1},
        },
        "customdata": [
            [
                n.url,
                f"L{n.layer}K{n.key}",
                f"{n.coefficient:+.3g}",
                f"{n.contribution:+.3g}",
                n.hop,
                label(n.top_token.token) if n.top_token else "—",
            ]
            for n in nodes
        ],
        "hovertemplate": "%{customdata[1]} · hop %{customdata[4]}<br>m %{customdata[2]} · contribution "
        "%{customdata[3]}<br>own top: %{customdata[5]}<extra></extra>",
    }
    rows = max([len(stack) for stack in stacked.values()] or [1])
    half = (rows - 1) / 2 + 0.75  # room above the top node and below the bottom one for their names
    return {
        "data": [*edge_traces, node_trace],
        "layout": BASE_LAYOUT
        | {
            "height": 160 + 40 * rows,
            "margin": {"l": 40, "r": 40, "t": 24, "b": 48},
            "xaxis": {
                "title": {"text": "layer"},
                "tickvals": list(range(len(layers))),
                "ticktext": [f"L{layer}" for layer in layers],
                "range": [-0.6, len(layers) - 0.4],
                "zeroline": False,
                "showgrid": False,
            },
            "yaxis": {"visible": False, "range": [-half, half]},
            "meta": {"links": True, "declutter": True},
        },
    }
