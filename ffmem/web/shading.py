"""Texts shaded token by token by one key's coefficient: the try-your-text answer and stored trigger
sentences. Torch-free; `shaded_html` renders the result (templates call it as `shaded`)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np
from markupsafe import Markup, escape

from ffmem.store.memory_lists import Trigger as TriggerRow
from ffmem.store.models import Sentence
from ffmem.web.views import ShadedText


def shade(
    texts: Sequence[str],
    coefficients: Sequence[float | None],
    *,
    peak: int | None = None,
    prefix_end: int | None = None,
    scale: float | None = None,
) -> ShadedText:
    """The tokens `texts` shaded by `coefficients` (one per token; None leaves a token unshaded).

    `peak`: the token to outline; `prefix_end`: the last token of the trigger prefix (later tokens are
    dimmed); `scale`: the |m| that shades fully — by default the largest |m| here, so that texts shaded
    apart are comparable only when given one scale (e.g. the key's max |m|)."""
    if len(texts) != len(coefficients):
        raise ValueError(f"{len(texts)} token texts but {len(coefficients)} coefficients")
    for name, index in (("peak", peak), ("prefix_end", prefix_end)):
        if index is not None and not 0 <= index < len(texts):
            raise ValueError(f"{name} {index} is outside the {len(texts)} tokens")
    known = [abs(c) for c in coefficients if c is not None]
    if scale is None:
        scale = max(known, default=0.0)
    if scale < 0:
        raise ValueError(f"scale {scale} is negative")
    return ShadedText(
        texts=list(texts),
        coefficients=[None if c is None else float(c) for c in coefficients],
        scale=float(scale),
        peak=peak,
        prefix_end=prefix_end,
    )


def intensity(coefficient: float | None, scale: float) -> float:
    """How strongly a token is shaded: |m| / scale, in 0–1 (0 when there is no m or no scale)."""
    if coefficient is None or scale <= 0:
        return 0.0
    return min(abs(coefficient) / scale, 1.0)


def shaded_html(text: ShadedText, id: str | None = None) -> Markup:
    """A shaded text as HTML: each token a span, blue for m > 0 and orange for m < 0, as strong as |m| /
    text.scale; its m on hover (title) and, for screen readers, after it; the peak token outlined (its
    leading space outside the outline); the tokens past the trigger prefix (after text.prefix_end) dimmed
    behind a boundary. Token texts escaped.

    Python rather than a Jinja macro: a key page shades ~1,500 tokens, and a macro's per-token work
    cost more than the rest of the page."""
    peak, end, last, scale = text.peak, text.prefix_end, len(text.texts) - 1, text.scale
    parts = [f'<span class="shaded" id="{escape(id)}">' if id else '<span class="shaded">']
    # What a value shows, formatted once a text: stored shading repeats values (int8 codes × a step).
    shown: dict[float | None, tuple[str, str, str]] = {}
    for i, (token, m) in enumerate(zip(text.texts, text.coefficients, strict=True)):
        if m not in shown:
            strength = intensity(m, scale)
            shown[m] = (
                ("stok m-pos" if m > 0 else "stok m-neg") if strength > 0 else "stok",
                "no coefficient" if m is None else f"m = {m:+.4g}",
                ("" if m is None else f' data-m="{m}"')
                + (f' style="--m: {strength:.3f}"' if strength > 0 else ""),
            )
        classes, value, attributes = shown[m]
        if i == peak:
            classes, value = classes + " peak", value + ", the peak"
            # Its leading space before its outline: a line may wrap after the space, which would leave an
            # empty box at the line's end (issue 26).
            lead = token[: len(token) - len(token.lstrip())]
            if lead != token:
                parts.append(html.escape(lead))
                token = token[len(lead) :]
        title = value
        if i == end:
            classes, title = classes + " prefix-end", value + ", the end of the trigger prefix"
        elif end is not None and i > end:
            classes += " past"
        parts.append(
            f'<span class="{classes}" data-index="{i}"{attributes} title="{title}">{html.escape(token)}'
            f'<span class="sr-only"> ({value})</span></span>'
        )
        if i == end and i != last:
            parts.append('<span class="sr-only"> (end of the trigger prefix) </span>')
    parts.append("</span>")
    return Markup("".join(parts))


def token_pieces(text: str, offsets: Sequence[tuple[int, int]], alone: Sequence[str]) -> list[str]:
    """Each token's part of `text`, such that the pieces put together are the text as typed: from where the
    token before it ended to where it ends (the space before a word goes with the word, as byte-level BPE
    puts it). A token with no characters of its own shows `alone` (its text decoded alone: a BOS); one
    that shares a character with the token before it (a character split into bytes) shows nothing."""
    pieces, done = [], 0
    for (start, end), own in zip(offsets, alone, strict=True):
        if end > done:
            pieces.append(text[done:end])
            done = end
        else:
            pieces.append(own if start == end else "")
    return pieces


def key_scale(positive: list[TriggerRow], negative: list[TriggerRow]) -> float:
    """The |m| that shades fully on a key's pages: that of its strongest trigger of either sign."""
    return max((abs(t.coefficient) for t in positive[:1] + negative[:1]), default=0.0)


def stored_shading(
    sentence: Sentence, values, position: int, texts: dict[int, str], scale: float
) -> ShadedText:
    """A stored sentence shaded by its stored coefficients (NaN: not mined, unshaded), trigger outlined."""
    alone = [texts.get(i, "") for i in sentence.token_ids]
    pieces = token_pieces(sentence.text, [tuple(o) for o in sentence.offsets], alone)
    coefficients = [None if math.isnan(v) else v for v in values.astype(np.float64).tolist()]
    return shade(pieces, coefficients, peak=position, prefix_end=position, scale=scale)
