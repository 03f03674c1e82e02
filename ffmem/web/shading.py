"""Texts shaded token by token by one key's coefficient: the try-your-text answer and stored trigger
sentences. Torch-free; templates/_shading.html renders the result."""

from __future__ import annotations

from collections.abc import Sequence

from ffmem.web.contexts import ShadedText


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
    # One validation of the whole text (pydantic's core walks the list): a key page shades ~1,500 tokens.
    return ShadedText.model_validate(
        {
            "tokens": [
                {"text": text, "coefficient": None if c is None else float(c)}
                for text, c in zip(texts, coefficients, strict=True)
            ],
            "scale": float(scale),
            "peak": peak,
            "prefix_end": prefix_end,
        }
    )


def intensity(coefficient: float | None, scale: float) -> float:
    """How strongly a token is shaded: |m| / scale, in 0–1 (0 when there is no m or no scale)."""
    if coefficient is None or scale <= 0:
        return 0.0
    return min(abs(coefficient) / scale, 1.0)


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
