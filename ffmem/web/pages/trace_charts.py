"""The live view's figures (Plotly specs, ffmem/web/static/charts.js draws them): the layers × positions
heatmap of a trace and the residual's confidence in the final prediction by layer.
"""

from __future__ import annotations

from ffmem.web.charts import BASE_LAYOUT, NEUTRAL, POSITIVE, label
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
