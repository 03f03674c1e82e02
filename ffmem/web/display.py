"""How values show on a page: tokens made visible, compact numbers and percentages (Jinja filters); a
token and a coefficient bar as HTML (Jinja globals: Python rather than macros, a key page shows ~300
tokens and a macro call costs ten times a function's); and what every shown value loses, whoever wrote it
(`without_bidi_controls`, the templates' `finalize`)."""

from __future__ import annotations

import re

from markupsafe import Markup, escape

from ffmem.engine.values.token_display import visible as visible  # shared with the explanations' wording


def number(value: float | int | None, digits: int = 3) -> str:
    """Compact numbers for tables: `digits` significant digits, integers in full, — when missing."""
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def sentences(value: int | None) -> str:
    """The sentences a run reads, as its job's options say: a count, or "all" (none named: every one)."""
    return "all" if value is None else number(value)


def tok(text: str | None, id: int | None = None) -> Markup:
    """A token, made visible, in a `code.tok`; its id on hover when given."""
    title = "" if id is None else f' title="token id {int(id)}"'
    return Markup(f'<code class="tok"{title}>{escape(visible(text))}</code>')


def coefficient_bar(value: float, scale: float) -> Markup:
    """A coefficient as a bar as long as |value| / scale (blue for m ≥ 0, orange below) and its number."""
    width = 100 * abs(value) / scale if scale else 0
    sign = "neg" if value < 0 else "pos"
    return Markup(
        f'<span class="bar {sign}"><span style="width: {width:.1f}%"></span></span>\n'
        f'<span class="num">{number(value, 4)}</span>'
    )


def percent(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"


def signed(value: float, digits: int = 4) -> str:
    """A change with its sign, `digits` decimals; one too small for them in two significant digits
    (never "-0.0000"), and 0 as 0."""
    if value == 0:
        return "0"
    shown = f"{value:+.{digits}f}"
    return shown if float(shown) != 0 else f"{value:+.1e}"


def tail_words(text: str, limit: int) -> str:
    """The end of `text` in at most `limit` characters, cut at a word boundary, with … where it was cut."""
    if len(text) <= limit:
        return text
    tail = text[-(limit - 1) :]
    space = next((i for i, char in enumerate(tail) if char.isspace()), None)
    if space is not None and space < len(tail) - 1:  # drop the partial first word (not the whole tail)
        tail = tail[space:].lstrip()
    return "…" + tail


def duration(start, end) -> str:
    """The time from `start` to `end` (datetimes) as a person says it: 42 s, 4 min 12 s, 1 h 3 min."""
    seconds = max(0, round((end - start).total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


# Unicode's bidirectional embeddings, overrides, isolates and marks (U+202A–U+202E, U+2066–U+2069, U+200E,
# U+200F, U+061C): in a label or a corpus sentence they reorder what follows ("\u202eevil" reads "live").
BIDI_CONTROLS = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def without_bidi_controls(value):
    """`value` (shown by a template) without bidirectional controls, Markup kept Markup; other values as they
    are. The templates' `finalize` (ffmem.web.rendering): every `{{ … }}` of every page passes here, labels,
    corpus text, prompts and explanations alike; tokens already show such characters as ⟨U+202E⟩ (visible)."""
    if not isinstance(value, str) or not BIDI_CONTROLS.search(value):
        return value
    cleaned = BIDI_CONTROLS.sub("", value)
    return Markup(cleaned) if isinstance(value, Markup) else cleaned
