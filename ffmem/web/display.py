"""How values show on a page: tokens made visible, compact numbers and percentages (Jinja filters)."""

from __future__ import annotations

import unicodedata

SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}  # ␣ ↵ ⇥ ␍
INVISIBLE = ("Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Cn")  # control, format, spaces, private, unassigned


def visible(text: str | None) -> str:
    """A token as a person can see it: spaces ␣, newlines ↵, tabs ⇥, other invisible characters as
    ⟨U+XXXX⟩, the empty string ∅, no token at all —."""
    if text is None:
        return "—"
    if text == "":
        return "∅"
    return "".join(
        SHOWN.get(char) or (f"⟨U+{ord(char):04X}⟩" if unicodedata.category(char) in INVISIBLE else char)
        for char in text
    )


def number(value: float | int | None, digits: int = 3) -> str:
    """Compact numbers for tables: `digits` significant digits, integers in full, — when missing."""
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def percent(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"
