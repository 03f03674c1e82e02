"""What a job computes, typed (no torch): an index run (`RunSpec`), the paper's analyses of a finished
run (`AnalysisSpec`), two finished runs side by side (`ComparisonSpec`), a finished run's weight graph and
explanations again (`CompositionSpec`).

A job stores its spec's fields as its options (`Job.options`, JSON) and reads them back as `Job.spec`;
the same spec gives the same `fingerprint`, so queueing the same work again finds its job
(ffmem.store.jobs). A spec's defaults are the settings of the same names (`from_settings`); device,
cache and progress are each worker's own and in no spec.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict
from typing_extensions import Self  # typing.Self from Python 3.11

from ffmem.config import Settings


def fingerprint(data: dict) -> str:
    """The same data → the same fingerprint (order-independent): what finds a job again by its options
    (and a stored corpus by its text and tokenization)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


class Spec(BaseModel):
    """What one job computes: its fields are the job's options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def options(self) -> dict[str, Any]:
        """What the job stores (`Job.options`) and its fingerprint hashes: the fields given (a field a
        job queued before it existed lacks stays out, as it was then)."""
        return self.model_dump(exclude_unset=True)

    @classmethod
    def stored(cls, options: dict[str, Any]) -> Self:
        """The spec a job's stored options give."""
        return cls.model_validate(options)

    @classmethod
    def from_settings(cls, settings: Settings, **given) -> Self:
        """The spec `given` names (None: the setting of the field's name)."""
        _known(cls, given)
        return cls(**{name: _chosen(given, name, getattr(settings, name)) for name in cls.model_fields})


class RunSpec(Spec):
    """What defines an index run, its explanations included. The fields with a default are those jobs
    queued before they existed lack; the default is what such a job did (mined position 0, held nothing
    out, shaded nothing, built no token → memories table, scored explanations on the setting's default of
    held-out sentences — every one a random record of the scoring protocol, none a top record — with no
    explainer model named, no quadrant explained, measured no TokenChange). A new run's spec gives every
    field (`from_settings`). Where the explainer is served (`explainer_url`) is each worker's own."""

    model: str
    corpus: str
    sentences: int | None
    held_out_every: int = 0
    top_k: int
    shaded_triggers: int = 0
    dtype: str
    max_sentence_tokens: int
    first_position: bool = True
    batch_tokens: int
    shard_sentences: int
    value_tokens: int
    token_memories: int = 0
    explain_sentences: int = 1000
    explain_top_records: int = 0
    explain_random_records: int = 0
    explain_quadrants: bool = False
    explainer_model: str = ""
    token_change_memories: int = 0
    token_change_contexts: int = 8


class AnalysisSpec(Spec):
    """What an analysis job computes (ffmem.worker.analysis_jobs): held-out prefixes (Figs. 7–11), keys
    sampled per layer and top triggers per sampled key (Fig. 3), and the seed of its samples."""

    examples: int
    keys: int
    triggers: int
    seed: int

    @classmethod
    def from_settings(cls, settings: Settings, **given) -> AnalysisSpec:
        """The analyses `given` names (None: the setting `analysis_<name>`; the seed 0)."""
        _known(cls, given)
        sizes = {name: _chosen(given, name, getattr(settings, f"analysis_{name}")) for name in ANALYSIS_SIZES}
        return cls(**sizes, seed=_chosen(given, "seed", 0))


ANALYSIS_SIZES = ("examples", "keys", "triggers")  # the AnalysisSpec fields with a setting `analysis_<name>`


class CompositionSpec(Spec):
    """What a composition job computes again for a finished run (ffmem.worker.composition): its weight
    graph, and its explanations scored on `explain_sentences` held-out sentences (the protocol's
    `explain_top_records` and `explain_random_records` of them; in batches of `batch_tokens`), written by
    the explainer model `explainer_model` where a worker reaches one."""

    explain_sentences: int
    explainer_model: str
    batch_tokens: int
    explain_top_records: int = 0
    explain_random_records: int = 0
    explain_quadrants: bool = False


class ComparisonSpec(Spec):
    """What a comparison job compares (ffmem.worker.comparison): two finished runs, the lower id first
    (ffmem.store.comparison.pair: a pair is compared once)."""

    runs: list[int]


def _known(spec: type[Spec], given: dict) -> None:
    unknown = set(given) - set(spec.model_fields)
    if unknown:
        raise TypeError(f"{spec.__name__} has no field {', '.join(sorted(unknown))}")


def _chosen(given: dict, name: str, setting):
    """`given[name]` unless it is None or absent: then the setting."""
    value = given.get(name)
    return setting if value is None else value
