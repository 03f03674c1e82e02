"""The key page's "try your own text": the live worker reads this key's coefficient at every token of a
text (POST /coefficients); the page shades the text with it and ranks its max and min among the key's
stored triggers. Only `?text=` asks the worker: the key page itself never depends on it."""

from __future__ import annotations

from sqlalchemy.orm import Session

from ffmem.store import queries
from ffmem.store.results import results_for
from ffmem.web import pages
from ffmem.web.contexts import CoefficientAt, KeyContext, TokenRef, TryText
from ffmem.web.errors import AppError
from ffmem.web.shading import shade, token_pieces
from ffmem.web.worker_client import LiveWorker, text_max_length


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


def answer(session: Session, live: LiveWorker, ctx: KeyContext, text: str, max_tokens: int) -> TryText:
    """This key's coefficient at every token of `text`, asked of the live worker, beside the key's stored
    triggers (those of the page's run)."""
    check(text, max_tokens)
    model = pages.model_or_404(session, ctx.model)
    run = queries.get_run(session=session, run_id=ctx.run.id)
    got = live.coefficients({"model": model.source, "text": text, "layer": ctx.layer, "key": ctx.key})
    m = got.coefficients
    # The positions the run mines (ffmem.engine.corpus.mined_from): never a BOS; position 0 only with
    # the run's first_position option (runs from before the option mined it).
    first = got.first_position if run.provenance.get("first_position", True) else max(got.first_position, 1)
    mined = range(first, len(m))
    high = max(mined, key=m.__getitem__, default=None)  # the first of equal maxima, as argmax
    low = min(mined, key=m.__getitem__, default=None)
    extremes = (ctx.stats.max_coefficient, ctx.stats.min_coefficient) if ctx.stats else ()
    scale = max((abs(c) for c in extremes if c is not None), default=0.0) or None
    results = results_for(session, run)
    positive = [t.coefficient for t in results.triggers(ctx.layer, ctx.key, 1, run.top_k)]  # strongest first
    negative = [t.coefficient for t in results.triggers(ctx.layer, ctx.key, -1, run.top_k)]  # lowest first

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
