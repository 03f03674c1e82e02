"""The key page's "try your own text": the live worker reads this key's coefficient at every token of a
text (POST /coefficients); the page shades the text with it and ranks its max and min among the key's
stored triggers. Only `?text=` asks the worker: the key page itself never depends on it."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from ffmem.engine.live.protocol import CoefficientsRequest, text_max_length
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import results_for
from ffmem.web.errors import AppError
from ffmem.web.shading import shade, token_pieces
from ffmem.web.views import ShadedText, TokenRef
from ffmem.web.worker_client import LiveWorker


class CoefficientAt(BaseModel):
    """One memory's coefficient at one token of a text."""

    position: int = Field(description="The token's position in the text, 0-based.")
    token: str
    coefficient: float = Field(description="The key's coefficient m there (signed).")


class TryText(BaseModel):
    """The key page's "try your own text" (`?text=`): this key's coefficient at every token of the text,
    from the live worker, and how its max and min compare with the stored triggers."""

    text: str | None = Field(description="The text tried; null: the box only.")
    max_length: int = Field(description="The longest text the box accepts, in characters.")
    notice: str | None = Field(
        None, description="Why there is no answer: a bad text, or the worker down, busy or loading."
    )
    notice_field: str | None = Field(None, description='The form field the notice is about ("text").')
    tokens: list[TokenRef] = Field(
        [], description="The text's tokens (texts as the tokenizer decodes each alone)."
    )
    shaded: ShadedText | None = Field(
        None, description="The text, every token shaded; scale: the key's largest stored |m|."
    )
    first_mined: int | None = Field(
        None, description="Max, min and their ranks cover positions from here, as the run mines."
    )
    max: CoefficientAt | None = Field(
        None, description="The largest m there (null: no position the run would mine)."
    )
    min: CoefficientAt | None = Field(None, description="The smallest m there.")
    max_rank: int | None = Field(
        None,
        description="Where max would rank among the run's stored positive triggers (each a sentence's"
        " max; 1: "
        "above them all, positive_of + 1: below them all); ties rank with the stored.",
    )
    min_rank: int | None = Field(None, description="Where min would rank among the stored negative triggers.")
    positive_of: int = Field(0, description="Stored positive triggers compared with (at most top-T).")
    negative_of: int = Field(0, description="Stored negative triggers compared with (at most top-T).")
    top_k: int = Field(0, description="The run's top-T.")


def form(
    text: str | None, max_tokens: int, *, notice: str | None = None, field: str | None = None
) -> TryText:
    """The box without an answer: the text as typed and, when there is one, why there is no answer."""
    return TryText(text=text, max_length=text_max_length(max_tokens), notice=notice, notice_field=field)


def check(text: str, max_tokens: int) -> None:
    """Refuse an empty text, or one too long to be within `max_tokens`, before asking the worker (400)."""
    if not text.strip():
        raise AppError(400, "Empty text", "The text is empty: type some text.", field="text")
    if len(text) > text_max_length(max_tokens):
        raise AppError(400, "Text too long", f"Texts are limited to {max_tokens} tokens.", field="text")


def answer(
    session: Session,
    live: LiveWorker,
    model: LanguageModel,
    run: Run,
    memory: tuple[int, int],
    extremes: Sequence[float | None],
    text: str,
    max_tokens: int,
) -> TryText:
    """Memory (layer, key)'s coefficient at every token of `text`, asked of the live worker, beside its
    stored triggers in `run` (the key page's); `extremes`: its stored max and min m (none: no statistics)."""
    check(text, max_tokens)
    layer, key = memory
    got = live.coefficients(CoefficientsRequest(model=model.source, text=text, layer=layer, key=key))
    m = got.coefficients
    # The positions the run mines (ffmem.engine.mining.corpus.mined_from): never a BOS; position 0 only with
    # the run's first_position option (runs from before the option mined it).
    first = got.first_position if run.provenance.get("first_position", True) else max(got.first_position, 1)
    mined = range(first, len(m))
    high = max(mined, key=m.__getitem__, default=None)  # the first of equal maxima, as argmax
    low = min(mined, key=m.__getitem__, default=None)
    scale = max((abs(c) for c in extremes if c is not None), default=0.0) or None
    results = results_for(session, run)
    positive = [t.coefficient for t in results.triggers(layer, key, 1, run.top_k)]  # strongest first
    negative = [t.coefficient for t in results.triggers(layer, key, -1, run.top_k)]  # lowest first

    def at(position: int | None) -> CoefficientAt | None:
        if position is None:
            return None
        return CoefficientAt(position=position, token=got.tokens[position], coefficient=m[position])

    return TryText(
        text=text,
        max_length=text_max_length(max_tokens),
        tokens=[TokenRef(token_id=i, token=t) for i, t in zip(got.token_ids, got.tokens, strict=True)],
        shaded=shade(
            token_pieces(text, got.offsets, got.tokens),
            m,
            peak=high,
            scale=scale,  # the key's largest |m| in the run (else the text's own): texts compare
        ),
        first_mined=first,
        max=at(high),
        min=at(low),
        max_rank=None if high is None else 1 + sum(c > m[high] for c in positive),
        min_rank=None if low is None else 1 + sum(c < m[low] for c in negative),
        positive_of=len(positive),
        negative_of=len(negative),
        top_k=run.top_k,
    )
