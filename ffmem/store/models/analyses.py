"""What is computed or written about runs and memories: the paper's analyses of a run (`Analysis`), two
runs compared (`Comparison`, a `KeyChange` per memory) and people's labels of memories (`Label`)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from ffmem.store.models.base import Base


class Analysis(Base):
    """One of the paper's analyses computed on an index run (ffmem.engine.paper.analyses): its per-layer
    numbers (and per-key ones where it has them) as JSON, with the options it ran with and its cost."""

    __tablename__ = "analyses"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(40), primary_key=True)  # census | token_removal
    options: Mapped[dict] = mapped_column(JSON)
    data: Mapped[dict] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Comparison(Base):
    """Two finished runs side by side (ffmem.worker.comparison), computed once per pair and stored with the
    lower run id as `run_a` (the pages show either order). `basis`: what the trigger overlap compares,
    "sentences" (the same corpus: sentence indices) or "texts" (different corpora: trigger texts, each
    prefix up to and including its trigger token); `top_t`: the triggers compared per key and sign (the
    smaller top-T of the two). `layers`: per layer the means of `KeyChange`'s figures; `details`: what was
    compared (the key: "gate·up" or "key"), both models' weight checksums and the seconds of each step."""

    __tablename__ = "comparisons"
    __table_args__ = (UniqueConstraint("run_a", "run_b"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_a: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    run_b: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    basis: Mapped[str] = mapped_column(String(20))  # sentences | texts
    top_t: Mapped[int] = mapped_column(Integer)
    layers: Mapped[list[dict]] = mapped_column(JSON)
    details: Mapped[dict] = mapped_column(JSON)
    seconds: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class KeyChange(Base):
    """One memory in a comparison of two runs (b against a). `overlap`: |A ∩ B| / max(|A|, |B|) of its top-T
    positive trigger sets (NULL when both are empty), `negative_overlap` the same for the negative ones;
    `key_cosine`: the cosine of its key between the two models (gated FFs: cos(g)·cos(u), the cosine of the
    rank-one form g·uᵀ, with `gate_cosine` and `up_cosine` apart; NULL for plain FFs), `value_cosine` the
    cosine of its value; `moved` = 1 − min(key_cosine, value_cosine) (0: the weights did not move);
    `d_*`: b's statistic minus a's (ffmem.store.models.KeyStats)."""

    __tablename__ = "key_changes"
    # Each sort of the page (ffmem.store.comparison.SORTS) is a rank stored with the row, read off an index.
    __table_args__ = tuple(
        Index(f"ix_key_changes_rank_{name}", "comparison_id", f"rank_{name}")
        for name in (
            "change", "overlap", "key", "value", "mean", "positive_share", "max_coefficient",
            "min_coefficient", "density",
        )
    )  # fmt: skip

    comparison_id: Mapped[int] = mapped_column(
        ForeignKey("comparisons.id", ondelete="CASCADE"), primary_key=True
    )
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    overlap: Mapped[float | None] = mapped_column(Float)
    negative_overlap: Mapped[float | None] = mapped_column(Float)
    key_cosine: Mapped[float] = mapped_column(Float)
    gate_cosine: Mapped[float | None] = mapped_column(Float)
    up_cosine: Mapped[float | None] = mapped_column(Float)
    value_cosine: Mapped[float] = mapped_column(Float)
    moved: Mapped[float] = mapped_column(Float)
    d_mean: Mapped[float | None] = mapped_column(Float)
    d_positive_share: Mapped[float | None] = mapped_column(Float)
    d_max_coefficient: Mapped[float | None] = mapped_column(Float)
    d_min_coefficient: Mapped[float | None] = mapped_column(Float)
    d_density: Mapped[float | None] = mapped_column(Float)
    # The row's place (0 first) in each sort of the page: its biggest change first, ties by layer and key.
    rank_change: Mapped[int] = mapped_column(Integer)  # moved (desc), then overlap
    rank_overlap: Mapped[int] = mapped_column(Integer)  # overlap (asc, none last), then moved
    rank_key: Mapped[int] = mapped_column(Integer)  # key_cosine (asc)
    rank_value: Mapped[int] = mapped_column(Integer)  # value_cosine (asc)
    rank_mean: Mapped[int] = mapped_column(Integer)  # |d_mean| (desc, none last); and so on
    rank_positive_share: Mapped[int] = mapped_column(Integer)
    rank_max_coefficient: Mapped[int] = mapped_column(Integer)
    rank_min_coefficient: Mapped[int] = mapped_column(Integer)
    rank_density: Mapped[int] = mapped_column(Integer)


class Label(Base):
    """A person's annotation of one memory (the paper's manual annotation): a pattern description and a
    shallow / semantic tag. Editing adds a row: a key's newest row is its label, the older ones its
    history. Labels belong to the model, so they outlive any one index run."""

    __tablename__ = "labels"
    __table_args__ = (Index("ix_labels_memory", "model_id", "layer", "key", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("language_models.id", ondelete="CASCADE"))
    layer: Mapped[int] = mapped_column(SmallInteger)
    key: Mapped[int] = mapped_column(Integer)
    pattern: Mapped[str] = mapped_column(Text)  # e.g. "ends with a year"
    tag: Mapped[str] = mapped_column(String(16))  # shallow | semantic | "" (untagged)
    author: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
