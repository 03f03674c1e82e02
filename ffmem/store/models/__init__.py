"""SQLAlchemy 2 tables: what an index run stores, and nothing that needs torch to read. A module a group of
tables (`base` what they share, `language_models`, `runs`, `jobs`, `memories`, `composition`, `analyses`);
every name is importable from here, and importing it registers every table with `Base.metadata`.

Layers and keys are 0-based, as in the engine. A run's triggers reference sentences by
(corpus, index); sentences are stored once per corpus tokenization, as token ids with the
character offsets of each token, so the web process can render prefixes without a tokenizer.
"""

from ffmem.store.models.analyses import Analysis, Comparison, KeyChange, Label
from ffmem.store.models.base import Base, Coded, Float32, now
from ffmem.store.models.composition import (
    Explanation,
    MemoryLinks,
    NeighbourBaseline,
    Neighbours,
    TokenChangeRow,
)
from ffmem.store.models.jobs import ACTIVE, SPECS, Job, JobKind, JobStatus, MinedLayerRow, Shard, ShardStatus
from ffmem.store.models.language_models import LanguageModel, Token
from ffmem.store.models.memories import (
    QUADRANT_COLUMNS,
    KeyExamples,
    KeyOrder,
    KeyStats,
    MemoryList,
    SentenceTriggers,
    TokenMemoryList,
    ValueHistogram,
)
from ffmem.store.models.runs import Corpus, Run, RunStatus, Sentence

__all__ = [
    "ACTIVE",
    "QUADRANT_COLUMNS",
    "SPECS",
    "Analysis",
    "Base",
    "Coded",
    "Comparison",
    "Corpus",
    "Explanation",
    "Float32",
    "Job",
    "JobKind",
    "JobStatus",
    "KeyChange",
    "KeyExamples",
    "KeyOrder",
    "KeyStats",
    "Label",
    "LanguageModel",
    "MemoryLinks",
    "MemoryList",
    "MinedLayerRow",
    "NeighbourBaseline",
    "Neighbours",
    "Run",
    "RunStatus",
    "Sentence",
    "SentenceTriggers",
    "Shard",
    "ShardStatus",
    "Token",
    "TokenChangeRow",
    "TokenMemoryList",
    "ValueHistogram",
    "now",
]
