"""What every chart shares: the palette, the base layout, escaped labels and the layer axis. Plotly figure
specs are plain dicts (ffmem/web/static/charts.js draws them); no JavaScript here. Each page's own figures
live beside the page (ffmem/web/pages/: `model.layer_lines`, `key_charts`, `analysis.analysis_chart`, …).

Plotly reads a little HTML in labels, so every label from a corpus or a vocabulary is escaped
(&, <, >) and made visible (␣, ↵) first: it always shows as text.
"""

from __future__ import annotations

import html

from ffmem.web.display import visible

POSITIVE, NEGATIVE, NEUTRAL = "#2b6cb0", "#c05621", "#4a5568"
BASE_LAYOUT = {
    "margin": {"l": 60, "r": 20, "t": 36, "b": 48},
    "height": 320,
    "font": {"size": 12},
    "showlegend": False,
}


def label(text: str | None) -> str:
    return html.escape(visible(text), quote=False)


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
