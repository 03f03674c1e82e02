"""SQLAlchemy 2 tables: what an index run stores, and nothing that needs torch to read.

Layers and keys are 0-based, as in the engine. A run's triggers reference sentences by
(corpus, index); sentences are stored once per corpus tokenization, as token ids with the
character offsets of each token, so the web process can render prefixes without a tokenizer.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum
from typing import ClassVar

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import REAL
from sqlalchemy.orm import DeclarativeBase, Mapped, deferred, mapped_column, relationship

from ffmem.store.specs import AnalysisSpec, ComparisonSpec, CompositionSpec, RunSpec

# A statistic of a memory: 4 bytes on Postgres (real; double precision before revision 0024) where a table
# holds a row per memory; SQLite stores every REAL in 8 bytes whatever the declaration.
Float32 = Float().with_variant(REAL(), "postgresql")


def now() -> datetime:
    """The time every timestamp column stores: now, in UTC."""
    return datetime.now(timezone.utc)


class RunStatus(StrEnum):
    """Where an index run is: running (its job prepares, mines or stores it), done (stored in full),
    failed (its error says why; retrying its job runs it again)."""

    running = "running"
    done = "done"
    failed = "failed"


class JobKind(StrEnum):
    """What a job does: build an index run, compute the paper's analyses of a finished one, compare two
    finished runs (ffmem.worker.comparison), or compute a finished run's weight graph and explanations
    again (ffmem.worker.composition)."""

    index = "index"
    analysis = "analysis"
    comparison = "comparison"
    composition = "composition"


class JobStatus(StrEnum):
    """Where a job is: queued (nobody took it yet), running (a worker holds it, or its run's shards are
    open to every worker), done, failed (its error says why; it can be retried)."""

    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


ACTIVE = (JobStatus.queued, JobStatus.running)  # unfinished: at most one such job per fingerprint
SPECS = {
    JobKind.index: RunSpec,
    JobKind.analysis: AnalysisSpec,
    JobKind.comparison: ComparisonSpec,
    JobKind.composition: CompositionSpec,
}


class ShardStatus(StrEnum):
    """pending (nobody mined it yet), running (under a worker's lease, or its lease ran out), done
    (merged into its run's snapshot)."""

    pending = "pending"
    running = "running"
    done = "done"


def _stored_as_text(enum: type[StrEnum], name: str) -> Enum:
    """A column holding one of `enum`'s values as text (VARCHAR(20) and the CHECK constraint `name` on
    every backend, not a Postgres ENUM type), read back as the enum member."""
    return Enum(
        enum,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=20,
        values_callable=lambda members: [member.value for member in members],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    """Declarative base; constraints get stable names so Alembic (and SQLite batch mode) can alter them."""

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


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
    status: Mapped[RunStatus] = mapped_column(_stored_as_text(RunStatus, "status"))
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


class MemoryList(Base):
    """One ranked list of a memory, packed as bytes (ffmem.store.memory_lists encodes and decodes them):
    `kind` "triggers", its top-T trigger prefixes of one `sign` (+1: by maximum coefficient, −1: by
    minimum); `kind` "raw" or "norm", its value's top (`sign` +1) or bottom (−1) tokens under that readout
    (raw: v·Eᵀ, the paper's; norm: lm_head(final_norm(v))), with the log-normaliser of the readout, so a
    token's probability is exp(logit − log_z). Revision 0012 replaced the row-per-entry tables `triggers`
    and `value_tokens` with it."""

    __tablename__ = "memory_lists"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)  # triggers | raw | norm
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


class Job(Base):
    """A piece of work for the workers, queued until claimed: an index run (`JobKind.index`) or the paper's
    analyses of a finished run (`JobKind.analysis`; its `run_id` is set once that run is done; until
    then it waits for the index job `after_job_id` that builds it).

    The same options give the same `fingerprint`: running the same `ffmem index` again finds the
    unfinished job and resumes its run instead of starting over. At most one queued or running job has
    a fingerprint (a partial unique index), so two `ffmem index` started at once make one job.
    """

    __tablename__ = "jobs"
    __table_args__ = (
        Index(
            "uq_jobs_active_fingerprint",
            "fingerprint",
            unique=True,
            sqlite_where=text("status IN ('queued', 'running')"),
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[JobKind] = mapped_column(_stored_as_text(JobKind, "kind"))
    status: Mapped[JobStatus] = mapped_column(_stored_as_text(JobStatus, "status"), index=True)
    options: Mapped[dict] = mapped_column(JSON)  # what the job computes: its spec's fields (`spec`)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    # An analysis queued with its index run waits for that job (its run_id is set when the run is done).
    after_job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    worker: Mapped[str | None] = mapped_column(String(200))  # the id of who holds the job (jobs.worker_id)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Times a worker took up the job's current step (preparing, finishing, the analysis); past
    # Settings.max_attempts, the worker having died each time, the job fails.
    attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[dict | None] = mapped_column(JSON)  # {type, message, traceback}
    # The attempts that failed before this one, oldest first: {started_at, finished_at (ISO), error}
    # each (jobs.retry moves a failed attempt here); NULL: none (or stored before revision 0027).
    past_attempts: Mapped[list[dict] | None] = mapped_column(JSON)
    progress: Mapped[dict | None] = mapped_column(JSON)  # analyses: jobs.StageProgress as a dict
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    run: Mapped[Run | None] = relationship()

    @property
    def spec(self) -> RunSpec | AnalysisSpec | ComparisonSpec | CompositionSpec:
        """What the job computes, typed by its kind (ffmem.store.specs)."""
        return SPECS[self.kind].stored(self.options)

    @property
    def attempt(self) -> int:
        """The current attempt's number: 1, and one more for each failed attempt before it."""
        return 1 + len(self.past_attempts or [])


class Shard(Base):
    """Sentences [start, stop) of a run's corpus: the unit workers claim (with a lease), checkpoint and merge.

    Its checkpoint (MinedLayer rows under its index) holds the state after `batches_done` batches;
    when the shard is done it is merged into the run's snapshot (rows under `MinedLayerRow.SNAPSHOT`)
    and dropped.
    """

    __tablename__ = "shards"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(Integer)
    stop: Mapped[int] = mapped_column(Integer)
    status: Mapped[ShardStatus] = mapped_column(_stored_as_text(ShardStatus, "status"))
    worker: Mapped[str | None] = mapped_column(String(200))
    # Times a worker took the shard up; past Settings.max_attempts, the worker having died each time,
    # its job fails.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    batches_done: Mapped[int] = mapped_column(Integer)  # batches in the checkpoint
    sentences_done: Mapped[int] = mapped_column(Integer)  # progress, also past the checkpoint
    tokens_done: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # first claimed
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class MinedLayerRow(Base):
    """One layer of a mining state (ffmem.engine.mining.mined_layer.MinedLayer as bytes), in one of two roles:
    a running shard's checkpoint (`shard` = the shard's index, ≥ 0), or the run's snapshot, the merge
    of its finished shards (`shard` = `SNAPSHOT`, −1: no shard has that index). The web reads both for
    provisional results while a run is mining; they are dropped once the run is stored."""

    __tablename__ = "mined_layers"

    SNAPSHOT: ClassVar[int] = -1  # the `shard` of a run's snapshot rows

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)  # a shard's index, or SNAPSHOT
    layer: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    data: Mapped[bytes] = deferred(mapped_column(LargeBinary, nullable=False))


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
    sentences whose extreme falls in it), `bands` = key_examples.BAND records (bin, sentence index,
    position, coefficient: 12 B) by bin then slot; and `shading`: the key's coefficient at every token of
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
    {"positions", "matches", "auroc"} (ffmem.engine.explanations.PatternScore)."""

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
