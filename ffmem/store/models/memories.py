"""What a stored run holds per memory: its ranked lists (`MemoryList`), statistics (`KeyStats`) and its place
in each sort of the layer table (`KeyOrder`), examples
(`KeyExamples`) and value histogram (`ValueHistogram`); per token, its memories (`TokenMemoryList`); per
sentence, its triggers (`SentenceTriggers`)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    ForeignKey,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from ffmem.store.models.base import Base, Coded, Float32

# A memory list's kinds, sorted (ffmem.store.memory_lists.READOUTS and TRIGGERS), stored as 1, 2, 3.
LIST_KINDS = ("norm", "raw", "triggers")


class MemoryList(Base):
    """One ranked list of a memory, packed as bytes (ffmem.store.memory_lists encodes and decodes them):
    `kind` "triggers", its top-T trigger prefixes of one `sign` (+1: by maximum coefficient, −1: by
    minimum); `kind` "raw" or "norm", its value's top (`sign` +1) or bottom (−1) tokens under that readout
    (raw: v·Eᵀ, the paper's; norm: lm_head(final_norm(v))), with the log-normaliser of the readout, so a
    token's probability is exp(logit − log_z). Revision 0012 replaced the row-per-entry tables `triggers`
    and `value_tokens` with it."""

    __tablename__ = "memory_lists"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    # triggers | raw | norm, as 3 | 2 | 1 (revision 0032; text before)
    kind: Mapped[str] = mapped_column(Coded(*LIST_KINDS), primary_key=True)
    sign: Mapped[int] = mapped_column(SmallInteger, primary_key=True)  # +1 | −1
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


QUADRANT_COLUMNS = ("quadrant_pp", "quadrant_pn", "quadrant_np", "quadrant_nn")  # mined_layer.QUADRANTS


class KeyStats(Base):
    """Per-key statistics over every mined position of the run."""

    __tablename__ = "key_stats"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    mean: Mapped[float] = mapped_column(Float32)
    positive_share: Mapped[float] = mapped_column(Float32)  # share of positions with m_i > 0
    max_coefficient: Mapped[float | None] = mapped_column(Float32)
    min_coefficient: Mapped[float | None] = mapped_column(Float32)
    value_norm: Mapped[float] = mapped_column(Float32)  # ‖v_i‖
    histogram: Mapped[list[int]] = mapped_column(JSON)  # counts per bin of Run.histogram_edges
    # Added in 0002; NULL for runs stored before it.
    density: Mapped[float | None] = mapped_column(Float32)  # share of positions near the peak |m|
    max_prob: Mapped[float | None] = mapped_column(Float32)  # the value's top raw probability
    agreement: Mapped[int | None] = mapped_column(
        Integer
    )  # positive triggers whose next token is a top token
    next_token_rank: Mapped[int | None] = mapped_column(Integer)  # raw rank of the top trigger's next token
    # Added in 0004, set by `ffmem analyze` for the keys it samples (Fig. 3), else NULL: the mean relative
    # change of the coefficient on the top triggers without their first / last token, and the shallowness
    # (−last, clipped to 0–1: 1 = it all hinges on the last token).
    first_token_change: Mapped[float | None] = mapped_column(Float32)
    last_token_change: Mapped[float | None] = mapped_column(Float32)
    shallowness: Mapped[float | None] = mapped_column(Float32)
    # Added in 0022, gated FFs only (NULL otherwise): the share of mined positions in each sign quadrant of
    # (gate act(x·g), input x·u), p: ≥ 0, n: < 0, the gate's sign first; the largest's number (0 … 3).
    quadrant_pp: Mapped[float | None] = mapped_column(Float32)
    quadrant_pn: Mapped[float | None] = mapped_column(Float32)
    quadrant_np: Mapped[float | None] = mapped_column(Float32)
    quadrant_nn: Mapped[float | None] = mapped_column(Float32)
    dominant_quadrant: Mapped[int | None] = mapped_column(SmallInteger)


class KeyOrder(Base):
    """A layer's keys in the order of one of the layer table's sorts (ffmem.store.memory_reads.KEY_SORTS, but
    the key's own), descending or not, as the database sorts them (NULLs last, ties by key), written with
    the key statistics (revision 0031): a page of the table is a slice of `data` (memory_lists.pack_columns
    keys after a width byte), not a sort of the layer's every row. Runs stored before 0031 have none: their
    pages sort the statistics."""

    __tablename__ = "key_orders"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    sort: Mapped[str] = mapped_column(String(24), primary_key=True)
    descending: Mapped[bool] = mapped_column(Boolean, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class TokenMemoryList(Base):
    """One vocabulary token's memories under one readout: the memories whose value promotes it most and
    those that suppress it most, ranked by its logit and by its probability, packed as bytes
    (ffmem.store.memory_lists: TOKEN_LISTS of TOKEN_MEMORY). Written when the run's values are projected;
    token search reads a few rows per query (revision 0018; it replaced the value matrix in `run_arrays`)."""

    __tablename__ = "token_memories"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    readout: Mapped[str] = mapped_column(String(8), primary_key=True)  # raw | norm
    token_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class SentenceTriggers(Base):
    """The positive triggers of a run that lie in one corpus sentence, packed as bytes
    (ffmem.store.memory_lists: SENTENCE_TRIGGER records — the memory, the trigger's position, its
    coefficient): what free-text search reads for the sentences that contain a text, instead of every
    trigger list of the run (revision 0019)."""

    __tablename__ = "sentence_triggers"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    sentence_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)


class KeyExamples(Base):
    """What the key page shows of a key beyond its triggers (ffmem.store.key_examples encodes both blobs):
    its band samples (examples across the coefficient range: per histogram bin, up to MinedLayer's SAMPLES
    sentences whose extreme falls in it), `bands` = (bin, sentence index, position, coefficient) by bin
    then slot, packed as narrow as the layer needs (key_examples.layer_bands; key_examples.BAND, 12 B,
    before revision 0031); and `shading`: the key's coefficient at every token of
    its top `positive` and `negative` triggers (by rank) and then of each sample, one sentence after
    another (each as long as the sentence), as int8 codes with a float32 step per sentence (its largest
    |m| / 127: a value is stored to within half a step, the peak to float32's precision; code −128: NaN,
    where the run mines nothing), deflated with zlib. Revision 0013 packed `bands` (JSON before) and the
    int8 codes (float16 before)."""

    __tablename__ = "key_examples"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    bands: Mapped[bytes] = mapped_column(LargeBinary)
    positive: Mapped[int] = mapped_column(SmallInteger)  # shaded positive triggers (ranks 0 … n−1)
    negative: Mapped[int] = mapped_column(SmallInteger)  # shaded negative triggers
    shading: Mapped[bytes] = mapped_column(LargeBinary)
    # Added in 0022, gated FFs only: the top examples of each sign quadrant (key_examples.QUADRANT_EXAMPLE).
    quadrants: Mapped[bytes | None] = mapped_column(LargeBinary)


class ValueHistogram(Base):
    """A memory's value v_i read over the whole vocabulary: the histogram of its logits v_i·E under each
    readout (ffmem.store.value_histograms packs both; revision 0022), what the key page's statistics draw."""

    __tablename__ = "value_histograms"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    key: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
