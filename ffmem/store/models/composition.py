"""How a run's memories relate and what they do, computed once per run: `Neighbours` (nearest by key and by
value) with `NeighbourBaseline` (what chance reaches), `MemoryLinks` (the weight graph) and `Explanation`."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, deferred, mapped_column

from ffmem.store.models.base import Base


class Neighbours(Base):
    """A memory's nearest memories across all layers by cosine, computed once per run (engine.neighbours):
    `by_key` compares keys (for gated FFs the gate and up rows together: the cosine of g·uᵀ, which is
    cos(g)·cos(u)), `by_value` compares values. Each holds memory_lists.SCORED_MEMORY records (layer int16,
    key int32, score = cosine float32: 10 B), the highest first. One row a memory (a row a memory and kind
    before revision 0025; JSON [[layer, key, cosine], …] before 0014)."""

    __tablename__ = "neighbours"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    by_key: Mapped[bytes | None] = mapped_column(LargeBinary)
    by_value: Mapped[bytes | None] = mapped_column(LargeBinary)


class NeighbourBaseline(Base):
    """What a random pair of memories reaches, per run, layer and kind (engine.neighbours.memory_baselines):
    over `pairs` fixed seeded pairs of a memory of the layer and any other memory, the mean and the 99th
    percentile of |similarity| (the neighbours' own); and `nearest`, the median over the layer's memories
    of each one's r-th nearest neighbour's similarity, r = 1 … k (engine.neighbours.nearest_baseline).
    Runs stored before revision 0016 have no row, those before 0026 no `nearest` (NULL)."""

    __tablename__ = "neighbour_baselines"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # key | value
    pairs: Mapped[int] = mapped_column(Integer)
    mean: Mapped[float] = mapped_column(Float)
    p99: Mapped[float] = mapped_column(Float)
    nearest: Mapped[list[float] | None] = mapped_column(JSON)  # [k], rank 1 first


class MemoryLinks(Base):
    """A memory's strongest links in its run's weight graph (ffmem.engine.relations.weight_graph), computed
    once per run from the weights: `inbound` lists the earlier memories whose values write most into its key,
    `outbound` the later keys that read its value most (NULL: none that way). Each holds
    memory_lists.SCORED_MEMORY records (layer int16, key int32, score float32: 10 B), the largest |score|
    first; score > 0: a positive coefficient of the writer raises the reader's coefficient. One row a
    memory (a row a memory and direction before revision 0025; JSON before 0015)."""

    __tablename__ = "memory_links"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    inbound: Mapped[bytes | None] = mapped_column(LargeBinary)
    outbound: Mapped[bytes | None] = mapped_column(LargeBinary)


class Explanation(Base):
    """A memory's automatic description, computed once per run (ffmem.worker.explanations): `text` built
    offline from the index (how its top triggers end, the words that set their prefixes apart from the
    corpus, its value's top tokens) or written by a local model (`source`); `score`, how well its
    pattern predicts the key's coefficient on held-out sentences (the correlation over their positions of
    "the pattern occurs here" with m; NULL when the run has no held-out sentences or it never occurs).
    `token_table`: the pattern, a table of token weights packed as bytes (ffmem.store.composition.TOKEN_TABLE;
    `composition.explanation_pattern` reads either column); `pattern`: the JSON of runs explained before
    revision 0023, {"final": [...], "ngram": [...], "context": [...]} (NULL since); `details`:
    {"positions", "matches", "auroc"} (ffmem.engine.explanations.scoring.PatternScore)."""

    __tablename__ = "explanations"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    source: Mapped[str] = mapped_column(String(100))  # heuristic | llm:<model name>
    text: Mapped[str] = mapped_column(Text)
    score: Mapped[float | None] = mapped_column(Float)
    pattern: Mapped[dict | None] = deferred(mapped_column(JSON))
    details: Mapped[dict] = mapped_column(JSON)
    token_table: Mapped[bytes | None] = deferred(mapped_column(LargeBinary))


class TokenChangeRow(Base):
    """What a sampled memory's value writes, measured (ffmem.engine.values.token_change, the run's
    token_change step): over `contexts` held-out positions where its key fires most, the tokens whose
    log-probability rises most with m amplified against m switched off (`promoted`, token ids, the largest
    first) and falls most (`suppressed`); the output score of its value's VocabProj (raw readout) against it
    (`overlap` of the top 10, `spearman` over the vocabulary) and the same of a control memory of the layer
    (`control_key`: ffmem.engine.values.token_change.control_key). Runs stored before revision 0030 have
    none."""

    __tablename__ = "token_changes"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    contexts: Mapped[int] = mapped_column(Integer)
    promoted: Mapped[list[int]] = mapped_column(JSON)
    suppressed: Mapped[list[int]] = mapped_column(JSON)
    overlap: Mapped[float] = mapped_column(Float)
    spearman: Mapped[float] = mapped_column(Float)
    control_key: Mapped[int] = mapped_column(Integer)
    control_overlap: Mapped[float] = mapped_column(Float)
    control_spearman: Mapped[float] = mapped_column(Float)
