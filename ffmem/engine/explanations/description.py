"""A memory's description: its pattern in words (ffmem.engine.explanations).

**The description** (`describe`) names the pattern, each weight in m's units (sign · weight, to three
significant digits as stored): where the memory is strongest (m > 0, or m < 0 for sign −1: the tokens
that move it furthest that way), the pairs ("after “ of”: “ Paris” +1.2"), the tokens that move it the
opposite way, how many more it weighs; then its value's top tokens (what it promotes) and its
shallowness where the analyses measured it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ffmem.engine.explanations.fitting import START, Pattern
from ffmem.engine.values.token_display import visible

SHOWN_RAISE, SHOWN_LOWER, SHOWN_PAIRS = 6, 3, 3  # tokens and pairs the description names
VALUE_TOKENS = 3  # promoted tokens named in the description


@dataclass
class Description:
    text: str
    pattern: Pattern


def quoted(text: str) -> str:
    """A token as the description names it: in quotes, made visible as on every page (↵, ⇥, ⟨U+200B⟩,
    ∅; ffmem.engine.values.token_display) but for its spaces, which the quotes show."""
    return "“" + visible(text, spaces=False) + "”"


def describe(
    pattern: Pattern, value_tokens: Sequence[int], shallowness: float | None, texts: Sequence[str]
) -> Description:
    """A memory's description: its pattern, its value's top tokens (strongest first) and its shallowness
    (or None); `texts` names every token id (as the pages do: a byte-level token as its bytes, ⟨0x80⟩)."""
    weighed = sorted(zip(pattern.weights, pattern.final, strict=True), key=lambda item: (-item[0], item[1]))
    raise_, lower = [i for i in weighed if i[0] > 0], [i for i in weighed[::-1] if i[0] < 0]
    pairs = sorted(
        zip(pattern.pair_weights, pattern.pairs, strict=True), key=lambda item: (-abs(item[0]), item[1])
    )

    def named(items) -> str:  # each weight in m's units: sign · weight
        return ", ".join(f"{quoted(texts[t])} {pattern.sign * w:+.3g}" for w, t in items)

    parts = []
    if raise_:
        parts.append(f"strongest (m {'>' if pattern.sign > 0 else '<'} 0) at " + named(raise_[:SHOWN_RAISE]))
    for weight, (before, token) in pairs[:SHOWN_PAIRS]:
        after = "the start" if before == START else quoted(texts[before])
        parts.append(f"after {after}: {named([(weight, token)])}")
    if lower:
        parts.append("opposite at " + named(lower[:SHOWN_LOWER]))
    more = sum(
        max(0, len(items) - shown)
        for items, shown in ((raise_, SHOWN_RAISE), (lower, SHOWN_LOWER), (pairs, SHOWN_PAIRS))
    )
    if more:
        parts.append(f"{more} more weighed")
    if not parts:
        parts.append("no token sets it apart in its shaded sentences")
    if value_tokens:
        parts.append("promotes " + ", ".join(quoted(texts[t]) for t in list(value_tokens)[:VALUE_TOKENS]))
    if shallowness is not None:
        parts.append(f"{'shallow' if shallowness >= 0.5 else 'semantic'} (shallowness {shallowness:.2f})")
    return Description(text="; ".join(parts), pattern=pattern)
