"""The key page's figures (Plotly specs, ffmem/web/static/charts.js draws them): the value's top and
bottom tokens, the coefficient histogram (with a tried text's max m marked) and the value's logits over
the whole vocabulary."""

from __future__ import annotations

import math

from ffmem.web.charts import BASE_LAYOUT, NEGATIVE, NEUTRAL, POSITIVE, label
from ffmem.web.pages.key import MARKED_TOKENS, Histogram, ValueHistogramView, ValueReadout, histogram_bin

LOG_COUNTS = {"type": "log", "dtick": 1}  # a log axis of counts: a tick and a label at each power of ten only


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
