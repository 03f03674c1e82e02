"""Plotly figure specs as plain dicts (static/charts.js draws them); no JavaScript here.

Plotly reads a little HTML in labels, so every label from a corpus or a vocabulary is escaped
(&, <, >) and made visible (␣, ↵) first: it always shows as text.
"""

from __future__ import annotations

import html

from app.contexts import Histogram, LayerSummary, ValueReadout
from app.display import visible

POSITIVE, NEGATIVE, NEUTRAL = "#2b6cb0", "#c05621", "#4a5568"
BASE_LAYOUT = {
    "margin": {"l": 60, "r": 20, "t": 36, "b": 48},
    "height": 320,
    "font": {"size": 12},
    "showlegend": False,
}


def label(text: str | None) -> str:
    return html.escape(visible(text), quote=False)


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


def coefficient_histogram(histogram: Histogram) -> dict:
    """Counts per octave bin of the coefficient, negative bins left, positive right (log counts)."""
    middle = len(histogram.counts) // 2
    colors = [NEGATIVE] * middle + [NEUTRAL] + [POSITIVE] * middle
    return {
        "data": [
            {
                "type": "bar",
                "x": histogram.labels,
                "y": histogram.counts,
                "marker": {"color": colors},
                "hovertemplate": "%{x}: %{y} positions<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": "coefficient histogram (octave bins)"},
            "yaxis": {"type": "log", "title": {"text": "positions"}},
            "xaxis": {"type": "category", "tickangle": -60, "tickfont": {"size": 9}},
            "margin": {"l": 60, "r": 20, "t": 36, "b": 110},
            "height": 360,
        },
    }


LAYER_SERIES = {
    "positive_share": "share of positive coefficients",
    "density": "density (|m| near each key's peak)",
    "max_prob": "max value probability",
    "agreement_rate": "key–value agreement (top token = next token)",
}


def layer_lines(layers: list[LayerSummary], field: str) -> dict:
    """One statistic across layers, as a line with markers."""
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": [s.layer for s in layers],
                "y": [getattr(s, field) for s in layers],
                "line": {"color": POSITIVE},
                "hovertemplate": "layer %{x}: %{y:.4g}<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": LAYER_SERIES[field]},
            "xaxis": {"title": {"text": "layer (0-based)"}, "dtick": 1 if len(layers) <= 32 else None},
            "height": 280,
        },
    }
