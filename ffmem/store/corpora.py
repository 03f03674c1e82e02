"""Corpora and their sentences in the database: stored by the worker when it tokenizes a corpus, read
by the mining stage (token ids, first positions) and by the explorer (sentences of triggers, text search).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from ffmem.store.bulk import bulk_insert, chunks
from ffmem.store.models import Corpus, Sentence, now
from ffmem.store.vocabularies import stored_text


def list_corpora(*, session: Session) -> list[Corpus]:
    """Every corpus the database holds (one per source and tokenization), the newest first."""
    return list(session.scalars(select(Corpus).order_by(Corpus.id.desc())))


def find_corpus(*, session: Session, fingerprint: str) -> Corpus | None:
    """The corpus tokenized with this fingerprint, if stored."""
    return session.scalars(select(Corpus).where(Corpus.fingerprint == fingerprint)).one_or_none()


def store_corpus(
    *,
    session: Session,
    name: str,
    source: str,
    source_sha256: str,
    fingerprint: str,
    tokenizer: str,
    max_tokens: int,
    skipped: dict,
    sentences: Iterable[tuple[str, list[int], list[tuple[int, int]], int]],
) -> Corpus:
    """Store a corpus and its sentences (text, token ids, offsets, first position), indexed 0..N-1."""
    corpus = Corpus(
        name=name,
        source=source,
        source_sha256=source_sha256,
        fingerprint=fingerprint,
        tokenizer=tokenizer,
        max_tokens=int(max_tokens),
        n_sentences=0,
        n_tokens=0,
        skipped=dict(skipped),
        created_at=now(),
    )
    session.add(corpus)
    session.flush()
    counts = {"sentences": 0, "tokens": 0}

    def rows() -> Iterator[tuple]:
        for index, (text, token_ids, offsets, first_position) in enumerate(sentences):
            counts["sentences"] += 1
            counts["tokens"] += len(token_ids)
            yield (
                corpus.id,
                index,
                stored_text(text),
                [int(t) for t in token_ids],
                [[int(start), int(end)] for start, end in offsets],
                int(first_position),
            )

    columns = ("corpus_id", "index", "text", "token_ids", "offsets", "first_position")
    bulk_insert(session, Sentence.__table__, columns, rows())
    corpus.n_sentences, corpus.n_tokens = counts["sentences"], counts["tokens"]
    session.flush()
    return corpus


def load_sentence_tokens(*, session: Session, corpus_id: int) -> list[list[int]]:
    """Token ids of every sentence of the corpus, by index."""
    query = select(Sentence.token_ids).where(Sentence.corpus_id == corpus_id).order_by(Sentence.index)
    return list(session.scalars(query))


def load_first_positions(*, session: Session, corpus_id: int) -> list[int]:
    """First mined position of every sentence of the corpus, by index."""
    query = select(Sentence.first_position).where(Sentence.corpus_id == corpus_id).order_by(Sentence.index)
    return list(session.scalars(query))


def get_sentences(*, session: Session, corpus_id: int, indices: Iterable[int]) -> dict[int, Row]:
    """These sentences of a corpus, by index: rows with Sentence's columns (read-only; no ORM objects,
    which cost more than the query on a key page)."""
    wanted = sorted({int(i) for i in indices})
    found: dict[int, Row] = {}
    columns = [getattr(Sentence, column.key) for column in Sentence.__table__.columns]
    for chunk in chunks(wanted, 900):
        query = select(*columns).where(Sentence.corpus_id == corpus_id, Sentence.index.in_(chunk))
        found.update((sentence.index, sentence) for sentence in session.execute(query))
    return found


def sentences_containing(*, session: Session, corpus_id: int, text: str, limit: int) -> list[Sentence]:
    """The first `limit` sentences of a corpus that contain `text`, ignoring case (LIKE wildcards escaped)."""
    text = stored_text(text)
    query = (
        select(Sentence)
        .where(
            Sentence.corpus_id == corpus_id, func.lower(Sentence.text).contains(text.lower(), autoescape=True)
        )
        .order_by(Sentence.index)
        .limit(limit)
    )
    return list(session.scalars(query))
