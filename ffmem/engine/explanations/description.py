"""A memory's description: one side's pattern in words a person would write (ffmem.engine.explanations).

**The description** (`describe`) of one side of a memory (its pattern's sign: +1, where m > 0; −1, where
m < 0) names the tokens that move it furthest that way, each with the token before it where a pair of
the pattern outweighs the token alone ("fires on “ Paris” after “ in”, “ London” and “ Rome”"), the
tokens that hold it back ("not on “ the”"), what its value writes when that side fires (the value's top
tokens for m > 0, its bottom ones for m < 0: −m · v promotes them) and its shallowness where the analyses
measured it. The numbers stay in the pattern's table, which the key page shows beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ffmem.engine.explanations.fitting import START, Pattern
from ffmem.engine.values.token_display import visible

SHOWN_RAISE, SHOWN_LOWER, SHOWN_PAIRS = 4, 2, 2  # tokens, held-back tokens and lone pairs named
VALUE_TOKENS = 3  # tokens the value writes, named


@dataclass
class Description:
    text: str
    pattern: Pattern


@functools.lru_cache(maxsize=2**16)
def quoted(text: str) -> str:
    """A token as the description names it: in quotes, made visible as on every page (↵, ⇥, ⟨U+200B⟩,
    ∅; ffmem.engine.values.token_display) but for its spaces, which the quotes show."""
    return "“" + visible(text, spaces=False) + "”"


def listed(items: Sequence[str]) -> str:
    """“a”, “b” and “c”."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def describe(
    pattern: Pattern, value_tokens: Sequence[int], shallowness: float | None, texts: Sequence[str]
) -> Description:
    """One side's description: its pattern, the tokens its value writes on that side (strongest first) and
    the memory's shallowness (or None); `texts` names every token id (as the pages do: a byte-level token
    as its bytes, ⟨0x80⟩)."""
    weighed = sorted((-weight, token) for weight, token in zip(pattern.weights, pattern.final, strict=True))
    raise_ = [token for minus, token in weighed if minus < 0][:SHOWN_RAISE]  # the largest weight first
    lower = [token for minus, token in weighed[::-1] if minus > 0][:SHOWN_LOWER]
    pairs = sorted(
        ((w, pair) for w, pair in zip(pattern.pair_weights, pattern.pairs, strict=True) if w > 0),
        key=lambda item: (-item[0], item[1]),
    )
    after = {}  # token → the previous token of its strongest raising pair
    for _, (before, token) in pairs:
        after.setdefault(token, before)

    def named(token: int) -> str:
        if token not in after:
            return quoted(texts[token])
        before = after[token]
        return f"{quoted(texts[token])} after {'the start' if before == START else quoted(texts[before])}"

    shown = [named(token) for token in raise_]
    shown += [named(token) for token in [t for _, (_, t) in pairs if t not in raise_][:SHOWN_PAIRS]]
    side = "fires on" if pattern.sign > 0 else "goes negative on"
    sentence = f"{side.capitalize()} {listed(shown)}" if shown else "No token sets it apart in its records"
    if shown and lower:
        sentence += ", not on " + listed([quoted(texts[t]) for t in lower])
    parts = [sentence]
    if value_tokens:
        written = [quoted(texts[t]) for t in list(value_tokens)[:VALUE_TOKENS]]
        parts.append(("then writes " if shown else "it writes ") + listed(written))
    text = "; ".join(parts) + "."
    if shallowness is not None:
        text += " " + (
            "Shallow: it hinges on the last token."
            if shallowness >= 0.5
            else "Semantic: it reads more than the last token."
        )
    return Description(text=text, pattern=pattern)
