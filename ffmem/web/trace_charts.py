"""The live view's charts, Plotly figure specs as plain dicts (ffmem/web/static/charts.js draws them): the
layers × positions heatmap of a trace and the residual's confidence in the final prediction by layer.
"""

from __future__ import annotations

from ffmem.engine.live.protocol import CircuitEdgeAnswer
from ffmem.web.charts import BASE_LAYOUT, NEGATIVE, NEUTRAL, POSITIVE, label
from ffmem.web.pages.circuit import CircuitContext, CircuitMemory
from ffmem.web.pages.trace import TraceContext

# The live view's heatmap modes, in the order of its buttons (the unedited ones only with edits).
HEATMAP_MODES = ("ff_logit", "active", "ff_logit_unedited", "active_unedited")


def trace_heatmap(ctx: TraceContext) -> dict:
    """Layers × positions: the FF's change to each position's predicted-token logit, or the number of
    active memories (a button switches); with edits, of the edited pass and, a button away, of the
    unedited one; the selected position is outlined."""
    x = [f"{t.position}: {label(t.token)}" for t in ctx.tokens]
    y = list(range(len(ctx.layers)))
    edited = " (edited)" if ctx.unedited else ""
    maps = [
        ("FF → logit of the prediction" + edited, ctx.heatmap["ff_logit"], "RdBu", 0),
        ("active memories" + edited, ctx.heatmap["active"], "Viridis", None),
    ]
    if ctx.unedited:
        maps += [
            ("FF → logit, unedited", ctx.unedited.heatmap["ff_logit"], "RdBu", 0),
            ("active, unedited", ctx.unedited.heatmap["active"], "Viridis", None),
        ]
    modes = HEATMAP_MODES[: len(maps)]
    shown = modes.index(ctx.heatmap_mode) if ctx.heatmap_mode in modes else 0  # the URL's `heatmap=`
    data = [
        {
            "type": "heatmap",
            "x": x,
            "y": y,
            "z": z,
            "colorscale": scale,
            **({"zmid": mid} if mid is not None else {}),
            "visible": i == shown,
            "name": title,
            "hovertemplate": "layer %{y}<br>position %{x}<br>" + title + " %{z:.3g}<extra></extra>",
        }
        for i, (title, z, scale, mid) in enumerate(maps)
    ]
    buttons = [
        {"label": title, "method": "update", "args": [{"visible": [j == i for j in range(len(maps))]}]}
        for i, (title, *_rest) in enumerate(maps)
    ]
    return {
        "data": data,
        "layout": BASE_LAYOUT
        | {
            "height": 200 + 14 * len(y),
            "margin": {"l": 50, "r": 20, "t": 40, "b": 110},
            "xaxis": {"type": "category", "tickangle": -50, "title": {"text": "position (click to select)"}},
            "yaxis": {"title": {"text": "layer"}, "autorange": True},
            "meta": {"modes": list(modes)},  # static/charts.js keeps the chosen one in the URL
            "updatemenus": [
                {
                    "type": "buttons",
                    "active": shown,
                    "direction": "right",
                    "x": 0,
                    "y": 1.12,
                    "xanchor": "left",
                    "buttons": buttons,
                }
            ],
            "shapes": [
                {
                    "type": "rect",
                    "xref": "x",
                    "yref": "paper",
                    "x0": ctx.position - 0.5,
                    "x1": ctx.position + 0.5,
                    "y0": 0,
                    "y1": 1,
                    "line": {"color": "#1a202c", "width": 2},
                }
            ],
        },
    }


def residual_confidence(ctx: TraceContext) -> dict:
    """The probability of the final prediction under the residual (the paper's Fig. 10): a point per layer
    for the residual entering its FF, and one after the last layer (the model's own probability of its
    prediction, so the last FF's jump shows); with edits, that of the edited pass and, dashed, the unedited
    pass's (each of its own final prediction)."""
    n = len(ctx.layers)
    x = [*(layer.layer for layer in ctx.layers), n]  # n: after the last layer
    where = [f"entering layer {layer.layer}'s FF" for layer in ctx.layers] + ["after the last layer"]

    def points(figures: list, final: float | None) -> list:
        return [*(f.final_prob for f in figures), final]

    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": "edited" if ctx.unedited else "p(final | r)",
            "x": x,
            "y": points(ctx.layers, ctx.prediction_prob),
            "text": where,
            "marker": {
                "color": [POSITIVE if layer.settled else NEUTRAL for layer in ctx.layers] + [POSITIVE]
            },
            "line": {"color": POSITIVE},
            "hovertemplate": "%{text}<br>p(final | r) %{y:.3f}<extra></extra>",
        }
    ]
    if ctx.unedited:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": "unedited",
                "x": x,
                "y": points([layer.unedited for layer in ctx.layers], ctx.unedited.prediction_prob),
                "text": where,
                "line": {"color": NEUTRAL, "dash": "dash"},
                "hovertemplate": "%{text}<br>unedited p(final | r) %{y:.3f}<extra></extra>",
            }
        )
    title = f"p({label(ctx.prediction.token if ctx.prediction else '')} | residual) by layer"
    if ctx.unedited:
        title = f"p(final | residual) by layer; final {label(ctx.prediction.token)} edited, "
        title += f"{label(ctx.unedited.prediction.token)} unedited"
    step = 1 if n <= 16 else 2 if n <= 32 else 4
    ticks = list(range(0, n, step))
    return {
        "data": data,
        "layout": BASE_LAYOUT
        | {
            "title": {"text": title},
            "showlegend": ctx.unedited is not None,
            "height": 280,
            "xaxis": {
                "title": {"text": "entering layer ℓ's FF · out: after the last layer"},
                "tickvals": [*ticks, n],
                "ticktext": [*map(str, ticks), "out"],
            },
            "yaxis": {"title": {"text": "probability"}, "range": [0, 1]},
        },
    }


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
