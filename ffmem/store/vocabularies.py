"""A model's vocabulary in the database: stored once with the model (the worker), read as token texts by
the explorer (each process reads a vocabulary once). Postgres text cannot hold NUL characters, so every
stored text has "\\x00" replaced by "␀" (U+2400), on every backend alike (`stored_text`); the replacement
keeps lengths, so character offsets stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from ffmem.engine.values.token_display import byte_form
from ffmem.store.bulk import bulk_insert
from ffmem.store.cache import ProcessCache, database_of
from ffmem.store.models import LanguageModel, Token

NUL_SHOWN_AS = "\u2400"


def stored_text(text: str) -> str:
    return text.replace("\x00", NUL_SHOWN_AS)


def store_vocabulary(*, session: Session, model_id: int, texts: list[str], pieces: list[str]) -> None:
    """Store the model's vocabulary (token id = list index); a no-op if it is already stored."""
    if len(texts) != len(pieces):
        raise ValueError(f"{len(texts)} texts but {len(pieces)} pieces")
    if session.scalar(select(exists().where(Token.model_id == model_id))):
        return
    pairs = enumerate(zip(texts, pieces, strict=True))
    rows = ((model_id, token_id, stored_text(text), stored_text(piece)) for token_id, (text, piece) in pairs)
    bulk_insert(session, Token.__table__, ("model_id", "token_id", "text", "piece"), rows)


def token_texts(*, session: Session, model_id: int, token_ids: Iterable[int]) -> dict[int, str]:
    """Decoded text of each of these vocabulary ids (those the model's vocabulary holds)."""
    texts = vocabulary(session=session, model_id=model_id)
    return {t: texts[t] for t in {int(i) for i in token_ids} if t in texts}


def stored_texts(*, session: Session, model_id: int) -> dict[int, str]:
    """Every token text of a model by token id as stored: what decoding the token gives, so a byte-level
    token that is no whole character reads "�" (`vocabulary` names it by its bytes instead); not kept."""
    query = select(Token.token_id, Token.text).where(Token.model_id == model_id)
    return dict(session.execute(query).all())


# A model's vocabulary never changes once stored (store_vocabulary writes it once, with the model row),
# so each process reads it once: a key page looks up ~1,500 token texts. Keyed by the database, the
# model's id and its creation time (an id reused by a new model row is another entry); a vocabulary
# not yet complete (the model row's vocab_size) is read again next time.
VOCABULARIES_KEPT = 4


_VOCABULARIES = ProcessCache(VOCABULARIES_KEPT)  # (database, model id, created_at) -> token texts


def vocabulary(*, session: Session, model_id: int) -> dict[int, str]:
    """Every stored token text of a model by token id, read once per process; a byte-level token that
    is no whole character as its bytes, ⟨0x80⟩ (ffmem.engine.values.token_display.byte_form), not "�"."""
    model = session.get(LanguageModel, model_id)
    if model is None:
        return {}
    cache_key = (database_of(session), model_id, model.created_at)
    found = _VOCABULARIES.get(cache_key)
    if found is None:
        query = select(Token.token_id, Token.text, Token.piece).where(Token.model_id == model_id)
        found = {token_id: byte_form(text, piece) for token_id, text, piece in session.execute(query)}
        _VOCABULARIES.put(cache_key, found, final=len(found) == model.vocab_size)
    return found


def find_tokens(*, session: Session, model_id: int, texts: Iterable[str]) -> list[int]:
    """Ids of the vocabulary entries whose decoded text is exactly one of `texts`."""
    query = select(Token.token_id).where(
        Token.model_id == model_id, Token.text.in_([stored_text(t) for t in texts])
    )
    return sorted(session.scalars(query))
