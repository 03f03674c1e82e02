"""What a job computes, typed (ffmem/store/specs.py): the defaults are the settings, jobs queued before an
option existed read back as what they did, and every fingerprint equals the one computed before the
specs existed (the JSON of the options dict, as jobs.fingerprint hashed it), so existing databases find
their jobs."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from ffmem.config import Settings
from ffmem.store import jobs
from ffmem.store.models import Job, JobKind
from ffmem.store.specs import AnalysisSpec, ComparisonSpec, RunSpec

SETTINGS = Settings(_env_file=None)
RUN = {
    "model": "smollm2-135m",
    "corpus": "wiki-vital",
    "sentences": None,
    "held_out_every": 10,
    "top_k": 50,
    "shaded_triggers": 10,
    "dtype": "auto",
    "max_sentence_tokens": 128,
    "first_position": False,
    "batch_tokens": 4096,
    "shard_sentences": 0,
    "value_tokens": 30,
    "token_memories": 32,
    "explain_sentences": 1000,
    "explain_top_records": 20,
    "explain_random_records": 20,
    "explain_quadrants": False,
    "explainer_model": "",
    "token_change_memories": 2000,
    "token_change_contexts": 8,
}
# Older jobs lack these.
BEFORE = (
    "first_position", "shaded_triggers", "held_out_every", "token_memories", "explain_sentences",
    "explain_top_records", "explain_random_records", "explainer_model", "token_change_memories",
    "token_change_contexts", "explain_quadrants",
)  # fmt: skip


def by_hand(options: dict) -> str:
    """A fingerprint as it was computed before the specs: sha256 of the options' sorted JSON."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()


def test_a_run_spec_takes_the_settings_where_nothing_is_given():
    assert RunSpec.from_settings(SETTINGS).options() == RUN
    given = RunSpec.from_settings(SETTINGS, model="m", top_k=7, sentences=None, first_position=True)
    assert given.options() == RUN | {"model": "m", "top_k": 7, "first_position": True}
    assert list(given.options()) == list(RUN)  # the job page lists them in this order
    with pytest.raises(TypeError, match="RunSpec has no field device"):
        RunSpec.from_settings(SETTINGS, device="cpu")  # the worker's own, in no spec


def test_an_analysis_spec_takes_the_analysis_settings_and_seed_0():
    assert AnalysisSpec.from_settings(SETTINGS).options() == {
        "examples": SETTINGS.analysis_examples,
        "keys": SETTINGS.analysis_keys,
        "triggers": SETTINGS.analysis_triggers,
        "seed": 0,
    }
    assert AnalysisSpec.from_settings(SETTINGS, keys=3, seed=None).options()["keys"] == 3


def test_a_job_queued_before_an_option_existed_reads_back_as_what_it_did():
    old = {name: value for name, value in RUN.items() if name not in BEFORE}
    spec = Job(kind=JobKind.index, options=old).spec
    assert (spec.first_position, spec.shaded_triggers, spec.held_out_every, spec.token_memories) == (
        True,
        0,
        0,
        0,
    )
    assert spec.token_change_memories == 0  # measured no TokenChange
    # scored as before the protocol: every held-out sentence a random record, none a top record
    assert (spec.explain_top_records, spec.explain_random_records) == (0, 0)
    assert spec.options() == old  # what it stores, as stored
    with pytest.raises(ValidationError):
        RunSpec.stored({name: value for name, value in RUN.items() if name != "model"})


@pytest.mark.parametrize("run_id, after", [(4, None), (None, 9)])
def test_fingerprints_equal_those_computed_before_the_specs(run_id, after):
    run = RunSpec.from_settings(SETTINGS, model="tiny", sentences=12)
    assert jobs.job_fingerprint(run) == by_hand(RUN | {"model": "tiny", "sentences": 12})
    old = {name: value for name, value in RUN.items() if name not in BEFORE}
    assert jobs.job_fingerprint(RunSpec.stored(old)) == by_hand(old)
    analysis = {"examples": 10, "keys": 3, "triggers": 2, "seed": 0}
    target = {"run": run_id} if run_id is not None else {"after": after}
    assert jobs.job_fingerprint(AnalysisSpec(**analysis), run_id=run_id, after_job_id=after) == by_hand(
        {"kind": "analysis", **target, **analysis}
    )
    comparison = ComparisonSpec(runs=[2, 5])
    assert jobs.job_fingerprint(comparison, run_id=2) == by_hand(
        {"kind": "comparison", "run": 2, "runs": [2, 5]}
    )


def test_each_kind_of_job_reads_its_own_spec():
    assert isinstance(Job(kind=JobKind.index, options=RUN).spec, RunSpec)
    analysis = Job(kind=JobKind.analysis, options={"examples": 1, "keys": 2, "triggers": 3, "seed": 4}).spec
    assert analysis == AnalysisSpec(examples=1, keys=2, triggers=3, seed=4)
    assert Job(kind=JobKind.comparison, options={"runs": [1, 2]}).spec.runs == [1, 2]
