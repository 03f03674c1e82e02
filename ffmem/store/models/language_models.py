"""The models indexed and their vocabularies: `LanguageModel` (one row a model, its URL slug) and `Token`."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import (
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from ffmem.store.models.base import Base

if TYPE_CHECKING:
    from ffmem.store.models.runs import Run


class LanguageModel(Base):
    """A causal LM whose FF memories were indexed; `slug` is its URL name (e.g. smollm2-135m)."""

    __tablename__ = "language_models"

    id: Mapped[int] = mapped_column(primary_key=True)
    slug: Mapped[str] = mapped_column(String(200), unique=True)
    source: Mapped[str] = mapped_column(Text)  # HF id, local folder or .gguf path as given
    revision: Mapped[str | None] = mapped_column(String(200))  # commit hash or file sha256
    architecture: Mapped[str] = mapped_column(String(200))  # HF class name
    family: Mapped[str] = mapped_column(String(50))  # adapter family
    n_layers: Mapped[int] = mapped_column(Integer)
    n_keys: Mapped[int] = mapped_column(Integer)  # memories per layer (d_ff)
    d_model: Mapped[int] = mapped_column(Integer)
    vocab_size: Mapped[int] = mapped_column(Integer)
    activation: Mapped[str] = mapped_column(String(50))
    gated: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    # The database cascades the delete (ON DELETE CASCADE); the ORM must not null model_id first.
    runs: Mapped[list[Run]] = relationship(
        back_populates="model", order_by="Run.id", cascade="all, delete-orphan", passive_deletes=True
    )


class Token(Base):
    """One vocabulary entry: `text` is the decoded string, `piece` the tokenizer's raw piece."""

    __tablename__ = "tokens"
    # A token found by its text (search, the layer page's token filter): not a scan of the vocabulary.
    __table_args__ = (Index("ix_tokens_text", "model_id", "text"),)

    model_id: Mapped[int] = mapped_column(
        ForeignKey("language_models.id", ondelete="CASCADE"), primary_key=True
    )
    token_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    piece: Mapped[str] = mapped_column(Text)
