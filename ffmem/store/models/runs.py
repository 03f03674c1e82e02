"""Index runs and the corpora they mine: `RunStatus`, `Corpus` (one tokenization of a source), `Sentence`
(stored once a corpus, as token ids with each token's character span) and `Run` (with its provenance)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from ffmem.store.models.base import Base, stored_as_text

if TYPE_CHECKING:
    from ffmem.store.models.language_models import LanguageModel


class RunStatus(StrEnum):
    """Where an index run is: running (its job prepares, mines or stores it), done (stored in full),
    failed (its error says why; retrying its job runs it again)."""

    running = "running"
    done = "done"
    failed = "failed"


class Corpus(Base):
    """A corpus as tokenized for one tokenizer: same source, tokenizer and limits → same rows."""

    __tablename__ = "corpora"
    __table_args__ = (UniqueConstraint("fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))  # wiki-vital, or the file name
    source: Mapped[str] = mapped_column(Text)  # where it was read from
    source_sha256: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 of source hash, tokenizer, limits
    tokenizer: Mapped[str] = mapped_column(String(200))
    max_tokens: Mapped[int] = mapped_column(Integer)
    n_sentences: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)
    skipped: Mapped[dict] = mapped_column(JSON)  # {"invalid_utf8": n, "empty": n, ...}
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Sentence(Base):
    """One corpus sentence: its text, token ids, and each token's [start, end) character span."""

    __tablename__ = "sentences"

    corpus_id: Mapped[int] = mapped_column(ForeignKey("corpora.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(JSON)
    offsets: Mapped[list[list[int]]] = mapped_column(JSON)
    first_position: Mapped[int] = mapped_column(SmallInteger)  # first mined position (1 after a BOS)


class Run(Base):
    """One index run of a model over a corpus, with its provenance."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("language_models.id", ondelete="CASCADE"))
    corpus_id: Mapped[int] = mapped_column(ForeignKey("corpora.id"))
    status: Mapped[RunStatus] = mapped_column(stored_as_text(RunStatus, "status"))
    top_k: Mapped[int] = mapped_column(Integer)
    n_value_tokens: Mapped[int] = mapped_column(Integer)
    n_sentences: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)  # positions mined
    dtype: Mapped[str] = mapped_column(String(20))
    device: Mapped[str] = mapped_column(String(50))
    package_version: Mapped[str] = mapped_column(String(50))
    provenance: Mapped[dict] = mapped_column(JSON)  # model source/hash, corpus name/hash, versions …
    histogram_edges: Mapped[list[float]] = mapped_column(JSON)  # bin edges shared by every key
    error: Mapped[dict | None] = mapped_column(JSON)  # {type, message, traceback}
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    model: Mapped[LanguageModel] = relationship(back_populates="runs")
    corpus: Mapped[Corpus] = relationship()
