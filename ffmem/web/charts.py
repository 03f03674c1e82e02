"""Plotly figure specs as plain dicts (ffmem/web/static/charts.js draws them); no JavaScript here. The
browse pages' charts, and the colours, layout and labels every chart shares (the live view's charts:
ffmem/web/trace_charts.py).

Plotly reads a little HTML in labels, so every label from a corpus or a vocabulary is escaped
(&, <, >) and made visible (␣, ↵) first: it always shows as text.
"""

from __future__ import annotations

import html
import math
import textwrap

from ffmem.web.display import visible
from ffmem.web.pages.analysis import AnalysisFigure
from ffmem.web.pages.compare import LayerChange
from ffmem.web.pages.composition import WeightGraphView
from ffmem.web.pages.key import MARKED_TOKENS, Histogram, ValueHistogramView, ValueReadout, histogram_bin
from ffmem.web.pages.model import LayerSummary

POSITIVE, NEGATIVE, NEUTRAL = "#2b6cb0", "#c05621", "#4a5568"
LOG_COUNTS = {"type": "log", "dtick": 1}  # a log axis of counts: a tick and a label at each power of ten only
BASE_LAYOUT = {
    "margin": {"l": 60, "r": 20, "t": 36, "b": 48},
    "height": 320,
    "font": {"size": 12},
    "showlegend": False,
}


def label(text: str | None) -> str:
    return html.escape(visible(text), quote=False)


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


def value_bars(value: ValueReadout, readout: str, by: str = "logit") -> dict:
    """Horizontal bars: the value's top tokens (up) and bottom tokens (down) by logit."""
    top, bottom = value.top[:15], value.bottom[:15]
    rows = list(reversed(bottom)) + list(reversed(top))  # strongest top token drawn highest
    names = [f"{label(t.token)} #{t.token_id}" for t in rows]
    return {
        "data": [
            {
                "type": "bar",
                "orientation": "h",
                "y": names,
                "x": [getattr(t, by) for t in rows],
                "marker": {"color": [NEGATIVE] * len(bottom) + [POSITIVE] * len(top)},
                "customdata": [f"{t.prob:.3g}" for t in rows],
                "hovertemplate": "%{y}<br>logit %{x:.3f}<br>prob %{customdata}<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": f"value → vocabulary ({readout})"},
            "height": 120 + 16 * len(rows),
            "margin": {"l": 140, "r": 20, "t": 36, "b": 40},
            "xaxis": {"title": {"text": by}},
            "yaxis": {"type": "category", "automargin": True},
        },
    }


OCTAVE_TICKS = (-5, 0, 5, 10)  # the bin edges ±2^k named on the coefficient histogram's axis, and 0


def octave_ticks(edges: list[float]) -> tuple[list[float], list[str]]:
    """The coefficient histogram's x-axis (x: a bin's index): a tick at each edge ±2^k, k in OCTAVE_TICKS
    (between the two bins it parts), and one at the +0 bin; "2<sup>5</sup>", "−1", "0"."""

    def power(edge: float) -> str:
        k = round(math.log2(abs(edge)))
        sign = "−" if edge < 0 else ""
        return f"{sign}1" if k == 0 else f"{sign}2<sup>{str(k).replace('-', '−')}</sup>"

    at = [(b + 0.5, power(e)) for b, e in enumerate(edges) if e and round(math.log2(abs(e))) in OCTAVE_TICKS]
    at.append((len(edges) // 2, "0"))  # the +0 bin (len(edges) + 1 bins: negative, +0, positive)
    at.sort()
    return [x for x, _ in at], [text for _, text in at]


def coefficient_histogram(histogram: Histogram, marker: float | None = None) -> dict:
    """Counts per octave bin of the coefficient, negative bins left, positive right (log counts); the axis
    names a few edges (`octave_ticks`, level and 11 px: readable on a phone), a bin's hover its range.
    `marker`: a coefficient (a text tried: its max m) marked by a line through its bin."""
    middle = len(histogram.counts) // 2
    colors = [NEGATIVE] * middle + [NEUTRAL] + [POSITIVE] * middle
    marked = {}
    if marker is not None:
        at = histogram_bin(histogram.edges, marker)  # x is the bin's index
        line = {"color": "#1a202c", "width": 2, "dash": "dash"}
        marked = {
            "shapes": [{"type": "line", "x0": at, "x1": at, "yref": "paper", "y0": 0, "y1": 1, "line": line}],
            "annotations": [
                {
                    "x": at,
                    "y": 1,
                    "yref": "paper",
                    "text": f"your text: max m {marker:.3g}",
                    "showarrow": False,
                    "yanchor": "bottom",
                }
            ],
        }
    tickvals, ticktext = octave_ticks(histogram.edges)
    return {
        "data": [
            {
                "type": "bar",
                "x": list(range(len(histogram.counts))),
                "y": histogram.counts,
                "marker": {"color": colors},
                "customdata": histogram.labels,
                "hovertemplate": "m in %{customdata}: %{y} positions<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": "coefficient histogram (octave bins)"},
            "yaxis": LOG_COUNTS | {"title": {"text": "positions"}},
            "xaxis": {
                "title": {"text": "m (a bar per octave)"},
                "tickvals": tickvals,
                "ticktext": ticktext,
                "tickangle": 0,
                "tickfont": {"size": 11},
                "range": [-0.5, len(histogram.counts) - 0.5],
                "zeroline": False,
            },
            "meta": {"declutter": True},
        }
        | marked,
    }


NAMED_TOKENS = 3  # of a value's marked tokens, the strongest named on its histogram, each way
NAME_LEVELS = (0.8, 2.4, 7.2)  # their names' heights (counts, on the log axis): the strongest lowest


def value_histogram(view: ValueHistogramView, tokens: ValueReadout, readout: str) -> dict:
    """A value's logits over the whole vocabulary: tokens per equal bin (log counts), its first
    MARKED_TOKENS bottom and top tokens (`tokens`) marked along the logit axis, the NAMED_TOKENS strongest
    each way named. Their logits lie close, so the names step up (NAME_LEVELS, one height per rank) and run
    inward, away from the chart's edges (a bottom token's name right of it, a top token's left of it);
    static/charts.js hides a name that would still cover another (`layout.meta.declutter`), the strongest
    kept first: every token is named on hover."""
    bins = list(zip(view.edges, view.edges[1:], strict=False))  # (from, to) per bin
    bottom, top = tokens.bottom[:MARKED_TOKENS], tokens.top[:MARKED_TOKENS]
    marked = [*bottom, *top]
    named = []  # (token, rank, where its name runs), the strongest first: top, bottom, second top, …
    for rank in range(NAMED_TOKENS):
        for side, inward in ((top, "top left"), (bottom, "top right")):
            if rank < len(side):
                named.append((side[rank], rank, inward))
    return {
        "data": [
            {
                "type": "bar",
                "x": [(a + b) / 2 for a, b in bins],
                "y": view.counts,
                "width": [b - a for a, b in bins],
                "marker": {"color": NEUTRAL},
                "customdata": bins,
                "hovertemplate": "logit %{customdata[0]:.3f} to %{customdata[1]:.3f}: %{y} tokens"
                "<extra></extra>",
            },
            {
                "type": "scatter",
                "mode": "markers",
                "x": [t.logit for t in marked],
                "y": [0.6] * len(marked),  # on the log axis, just above its floor: along the logit axis
                "marker": {
                    "symbol": "triangle-up",
                    "size": 9,
                    "color": [NEGATIVE] * len(bottom) + [POSITIVE] * len(top),
                },
                "customdata": [f"{label(t.token)} #{t.token_id}" for t in marked],
                "hovertemplate": "%{customdata}<br>logit %{x:.3f}<extra></extra>",
            },
            {
                "type": "scatter",
                "mode": "text",
                "x": [t.logit for t, _, _ in named],
                "y": [NAME_LEVELS[rank] for _, rank, _ in named],
                "text": [label(t.token) for t, _, _ in named],
                "textposition": [side for _, _, side in named],
                "textfont": {"size": 10, "shadow": "auto"},
                "hoverinfo": "skip",
            },
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": f"value → whole vocabulary ({readout})"},
            "xaxis": {"title": {"text": "logit"}},
            "yaxis": LOG_COUNTS
            | {
                "title": {"text": "tokens"},
                "range": [
                    math.log10(0.4),
                    math.log10(max(2 * max(view.counts, default=1), 3 * NAME_LEVELS[-1])),
                ],
            },
            "bargap": 0,
            "meta": {"declutter": True},
        },
    }


LAYER_SERIES = {
    "positive_share": "share of positive coefficients (m > 0)",
    "density": "density (|m| near each key's peak)",
    "max_prob": "max value probability",
    "agreement_rate": "agreement rate (value's top token = next token)",
}
SHARES = ("positive_share", "density", "agreement_rate")  # drawn as percentages


def layer_axis(n_layers: int) -> dict:
    """An x-axis over layers 0…n−1: no room wasted beyond them, a tick every 1, 2 or 5 layers."""
    step = 1 if n_layers <= 12 else 2 if n_layers <= 24 else 5
    return {
        "title": {"text": "layer (0-based)"},
        "range": [-0.5, n_layers - 0.5],
        "tick0": 0,
        "dtick": step,
        "zeroline": False,
    }


def layer_lines(layers: list[LayerSummary], field: str) -> dict:
    """One statistic across layers, as a line with markers, on an honest y-axis: from 0; the positive
    share over 0–100% with 50% marked, so a layer at 50.3% does not look far from one at 49.8%."""
    values = [getattr(s, field) for s in layers]
    top = max((v for v in values if v is not None), default=0.0)
    yaxis: dict = {"range": [0, 1.15 * top if top > 0 else 0.05 if field in SHARES else 1], "zeroline": True}
    shapes = []
    if field == "positive_share":
        yaxis["range"] = [0, 1]
        shapes = [
            {
                "type": "line",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": 0.5,
                "y1": 0.5,
                "line": {"color": NEUTRAL, "width": 1, "dash": "dot"},
            }
        ]
    if field in SHARES:
        yaxis["tickformat"] = ".0%" if field == "positive_share" else ".1%"
    hover = "%{y:.2%}" if field in SHARES else "%{y:.4g}"
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": [s.layer for s in layers],
                "y": values,
                "line": {"color": POSITIVE},
                "hovertemplate": "layer %{x}: " + hover + "<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": LAYER_SERIES[field]},
            "xaxis": layer_axis(len(layers)),
            "yaxis": yaxis,
            "shapes": shapes,
            "height": 280,
        },
    }


SERIES_COLORS = ("#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b7791f")


def log_ticks(low: float, high: float) -> list[int]:
    """1, 2 and 5 times the powers of ten from below `low` to above `high`."""
    ticks, power = [], 1
    while power <= 10 * high:
        ticks += [step * power for step in (1, 2, 5)]
        power *= 10
    below = max([tick for tick in ticks if tick <= low], default=1)
    above = min([tick for tick in ticks if tick >= high], default=ticks[-1])
    return [tick for tick in ticks if below <= tick <= above]


PAPER_LINE = {"color": "rgba(113, 128, 150, 0.55)", "width": 5, "dash": "dash"}
PAPER_BAND = "rgba(113, 128, 150, 0.15)"


def analysis_chart(figure: AnalysisFigure) -> dict:
    """Our per-layer series (solid, by relative depth) and the paper's values (dashed, approximate).

    The paper's lines are drawn first, wide and translucent, so where ours runs on top of one both stay
    visible; a paper range (a "low end" and a "high end", Fig. 7) is a shaded band between them."""
    paper = []
    for name, points in figure.paper.items():
        band = name.endswith("high end") and paper and paper[-1]["name"].endswith("low end")
        paper.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": html.escape(name, quote=False),
                "x": [x for x, _ in points],
                "y": [y for _, y in points],
                "line": PAPER_LINE,
                **({"fill": "tonexty", "fillcolor": PAPER_BAND} if band else {}),
                "hovertemplate": "paper: %{y:.3g}<extra></extra>",
            }
        )
    data = paper + [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": html.escape(name, quote=False),
            "x": figure.depth,
            "y": values,
            "customdata": figure.layers,
            "line": {"color": SERIES_COLORS[i % len(SERIES_COLORS)]},
            "hovertemplate": "layer %{customdata}<br>%{y:.3g}<extra>"
            + html.escape(name, quote=False)
            + "</extra>",
        }
        for i, (name, values) in enumerate(figure.series.items())
    ]
    if figure.unit == "rank":  # log scale, every tick written out in full: 1, 2, 5, 10, 20, …, 20,000
        ranks = [v for values in figure.series.values() for v in values if v is not None and v > 0]
        ticks = log_ticks(min(ranks, default=1), max(ranks, default=10))
        yaxis = {"title": {"text": "rank (0 = top; log scale)"}, "type": "log"}
        yaxis |= {"tickvals": ticks, "ticktext": [f"{tick:,}" for tick in ticks]}
        yaxis["range"] = [math.log10(ticks[0]), math.log10(ticks[-1])]  # from the tick below to the one above
    elif figure.unit in ("share", "probability"):
        yaxis = {"title": {"text": figure.unit}, "rangemode": "tozero"}
        if figure.unit == "share":
            yaxis["tickformat"] = ".0%"
    else:
        yaxis = {"title": {"text": figure.unit}}
    return {
        "data": data,
        "layout": BASE_LAYOUT
        | {
            "title": {"text": ""},  # the page heads the chart with its title (it wraps there)
            "margin": {"l": 60, "r": 20, "t": 16, "b": 48},
            "showlegend": True,
            "legend": {"orientation": "h", "y": -0.3},
            "height": 360,
            "xaxis": {"title": {"text": "relative depth (layer / last layer)"}, "range": [-0.02, 1.02]},
            "yaxis": yaxis,
        },
    }


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


COMPARISON_SERIES = {  # LayerChange field → legend, colour
    "mean_overlap": ("mean trigger overlap (positive)", POSITIVE),
    "mean_key_cosine": ("mean key cosine", NEGATIVE),
    "mean_value_cosine": ("mean value cosine", NEUTRAL),
}


def comparison_layers(layers: list[LayerChange]) -> dict:
    """Two runs side by side, per layer: the mean overlap of the memories' top triggers and the mean
    cosine of their keys and values between the two models (1: unchanged), on one axis up to 1."""
    lowest = min(
        [getattr(s, field) for s in layers for field in COMPARISON_SERIES if getattr(s, field) is not None]
        or [0.0]
    )
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": name,
                "x": [s.layer for s in layers],
                "y": [getattr(s, field) for s in layers],
                "line": {"color": color},
                "hovertemplate": f"layer %{{x}}: %{{y:.4f}}<extra>{name}</extra>",
            }
            for field, (name, color) in COMPARISON_SERIES.items()
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": "per layer: trigger overlap and weight cosines (1 = unchanged)"},
            "xaxis": layer_axis(len(layers)),
            "yaxis": {"range": [min(0.0, lowest) - 0.02, 1.05], "zeroline": True},
            "showlegend": True,
            "legend": {"orientation": "h", "y": -0.25},
            "height": 340,
            "margin": BASE_LAYOUT["margin"] | {"b": 90},
        },
    }
