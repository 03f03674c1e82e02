"""Pattern hints for a key (the paper's manual annotation, automated a little): how many of its top
trigger prefixes end in the same token, and the commonest final n-gram (2–4 tokens) that several of
them share (the longer one on a tie)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel, Field

from ffmem.web.views import TokenRef

LONGEST = 4  # final n-grams of up to this many tokens


class PatternHints(BaseModel):
    """How a key's top triggers end: the commonest final token and the commonest shared final n-gram."""

    triggers: int = Field(description="The positive triggers looked at.")
    final_token: TokenRef = Field(description="The commonest trigger token.")
    final_token_share: float = Field(description="The share of those triggers that end in it.")
    final_ngram: list[TokenRef] | None = Field(
        description="The commonest shared final n-gram; null when no two triggers end alike beyond one token."
    )
    final_ngram_share: float = Field(description="The share of those triggers that end in it.")


def pattern_hints(endings: Sequence[Sequence[int]], texts: dict[int, str]) -> PatternHints | None:
    """`endings`: each trigger prefix's token ids, ending at its trigger token (the strongest first)."""
    endings = [list(ids) for ids in endings if ids]
    if not endings:
        return None
    (last, count), *_ = Counter(ids[-1] for ids in endings).most_common(1)
    ngram, ngram_count = None, 0
    for n in range(2, LONGEST + 1):  # the commonest final n-gram shared by two or more; longer on ties
        grams = Counter(tuple(ids[-n:]) for ids in endings if len(ids) >= n)
        if grams and (found := grams.most_common(1)[0])[1] >= max(2, ngram_count):
            ngram, ngram_count = found
    return PatternHints(
        triggers=len(endings),
        final_token=TokenRef(token_id=last, token=texts.get(last, "")),
        final_token_share=count / len(endings),
        final_ngram=None if ngram is None else [TokenRef(token_id=t, token=texts.get(t, "")) for t in ngram],
        final_ngram_share=ngram_count / len(endings),
    )
