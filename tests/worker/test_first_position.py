"""The first-position policy end to end, on the tiny model with a planted attention sink: every
sentence's position 0 gets a huge coefficient on two keys. By default no trigger and no statistic
comes from position 0; with the run option on the spike is every top trigger, and the provenance
and the key page say so."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.engine.model.hooks import capture
from ffmem.store import memory_reads
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Job, JobKind, KeyStats, Run, Sentence
from ffmem.store.specs import RunSpec
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index

SPIKE = 1000.0
LAYER, KEY, NEGATIVE_KEY = 1, 5, 9
TOP_K = 4
# No two sentences alike (no exact ties); "Paris" is one token: without position 0 nothing of it is mined.
SENTENCES = [*TRAINING_TEXT, "Paris", "The museums of the city are famous.", "Mozart landed on the Moon."]


@contextmanager
def planted_sink(loaded):
    """Position 0 of every sentence gets m + SPIKE on KEY and m − SPIKE on NEGATIVE_KEY (layer LAYER)."""
    projection = loaded.adapter.value_projection(loaded.adapter.blocks(loaded.model)[LAYER])

    def hook(module, inputs):
        m = inputs[0].clone()  # [batch, pos, d_ff]
        m[:, 0, KEY] += SPIKE
        m[:, 0, NEGATIVE_KEY] -= SPIKE
        return (m, *inputs[1:])

    handle = projection.register_forward_pre_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def build(db_url, tiny, tiny_model_dir, tmp_path, **changes):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    settings = Settings(
        **{
            "model": str(tiny_model_dir),
            "corpus": str(corpus),
            "sentences": None,
            "top_k": TOP_K,
            "device": "cpu",
            "dtype": "float32",
            "batch_tokens": 64,
            "shard_sentences": 4,
            "value_tokens": 5,
            "cache_dir": tmp_path / "cache",
        }
        | changes
    )
    options = IndexOptions.from_settings(settings, progress=False)
    sessions = make_sessionmaker(make_engine(db_url))
    with planted_sink(tiny):
        summary = build_index(options, sessions, loaded=tiny)
    return sessions, summary.run_id


def recomputed(tiny, session, run) -> list[dict[int, torch.Tensor]]:
    """Every sentence of the run alone, with the planted sink: per layer its coefficients [pos, keys]."""
    sentences = session.scalars(
        select(Sentence).where(Sentence.corpus_id == run.corpus_id).order_by(Sentence.index)
    ).all()
    found = []
    with planted_sink(tiny), torch.inference_mode(), capture(tiny.model, tiny.adapter) as captured:
        for sentence in sentences:
            assert sentence.first_position == 0  # the tiny tokenizer puts no BOS first
            tiny.model(torch.tensor([sentence.token_ids]))
            found.append({layer: c[0].clone() for layer, c in captured.coefficients.items()})
    return found


def brute_force_top(per_sentence, layer: int, key: int, sign: int, start: int) -> list[tuple]:
    """Top-T (s·m, sentence, position) over positions ≥ `start`, by s·m desc then sentence asc."""
    rows = []
    for index, coefficients in enumerate(per_sentence):
        column = sign * coefficients[layer][start:, key]  # [positions]
        if len(column):
            rows.append((float(column.max()), index, int(column.argmax()) + start))
    return sorted(rows, key=lambda r: (-r[0], r[1]))[:TOP_K]


def assert_stored_equals_brute_force(session, run, per_sentence, start: int) -> None:
    for layer in range(3):
        for key in range(48):
            for sign in (1, -1):
                stored = memory_reads.get_triggers(
                    session=session, run_id=run.id, layer=layer, key=key, sign=sign
                )
                expected = brute_force_top(per_sentence, layer, key, sign, start)
                assert [(t.sentence_index, t.position) for t in stored] == [e[1:] for e in expected], (
                    f"layer {layer} key {key} sign {sign}"
                )
                assert [sign * t.coefficient for t in stored] == pytest.approx(
                    [e[0] for e in expected], rel=1e-5
                )
            stats = memory_reads.get_key_stats(session=session, run_id=run.id, layer=layer, key=key)
            every = torch.cat([c[layer][start:, key] for c in per_sentence])  # [mined positions]
            assert sum(stats.histogram) == len(every) == run.n_tokens
            assert stats.mean == pytest.approx(float(every.double().mean()), rel=1e-5, abs=1e-6)
            assert stats.positive_share == pytest.approx(float((every > 0).double().mean()))
            assert stats.max_coefficient == pytest.approx(float(every.max()), rel=1e-5)
            assert stats.min_coefficient == pytest.approx(float(every.min()), rel=1e-5)


def test_by_default_position_0_is_in_no_trigger_and_no_statistic(db_url, tiny, tiny_model_dir, tmp_path):
    sessions, run_id = build(db_url, tiny, tiny_model_dir, tmp_path)
    with sessions() as session:
        run = session.get(Run, run_id)
        assert run.provenance["first_position"] is False
        assert run.provenance["mined_positions"].startswith("from 1: the tokenizer puts no BOS first")
        per_sentence = recomputed(tiny, session, run)
        assert per_sentence[0][LAYER][0, KEY] > SPIKE / 2  # the sink is planted
        every = list(memory_reads.iter_triggers(session=session, run_id=run.id))
        assert min(t.position for t in every) == 1
        one_token = SENTENCES.index("Paris")
        assert not [t for t in every if t.sentence_index == one_token]
        assert_stored_equals_brute_force(session, run, per_sentence, start=1)
        spiked = memory_reads.get_key_stats(session=session, run_id=run.id, layer=LAYER, key=KEY)
        assert spiked.max_coefficient < SPIKE / 2  # the model page's max column never sees the sink


def test_with_the_option_the_spike_is_the_top_trigger_and_the_run_says_so(
    db_url, tiny, tiny_model_dir, tmp_path
):
    sessions, run_id = build(db_url, tiny, tiny_model_dir, tmp_path, first_position=True)
    with sessions() as session:
        run = session.get(Run, run_id)
        assert run.provenance["first_position"] is True
        assert run.provenance["mined_positions"].startswith("from 0: the tokenizer puts no BOS first")
        per_sentence = recomputed(tiny, session, run)
        assert_stored_equals_brute_force(session, run, per_sentence, start=0)
        for key, sign in ((KEY, 1), (NEGATIVE_KEY, -1)):
            stored = memory_reads.get_triggers(
                session=session, run_id=run.id, layer=LAYER, key=key, sign=sign
            )
            assert [t.position for t in stored] == [0] * TOP_K
            assert all(sign * t.coefficient > SPIKE / 2 for t in stored)
        stats = session.get(KeyStats, (run.id, LAYER, KEY))
        assert stats.max_coefficient > SPIKE / 2
        app = create_app(Settings(database_url=db_url))
        with TestClient(app) as client:
            slug = run.model.slug
            page = client.get(f"/m/{slug}/layers/{LAYER}/keys/{KEY}").text
            shown = client.get(f"/m/{slug}/layers/{LAYER}/keys/{KEY}.json").json()
            at_first = sum(t["position"] == 0 for t in shown["triggers"] + shown["negative_triggers"])
            assert at_first >= TOP_K and page.count('class="first-position"') == at_first
            other = client.get(f"/m/{slug}/layers/0/keys/0.json").json()
            badges = client.get(f"/m/{slug}/layers/0/keys/0").text.count('class="first-position"')
            assert badges == sum(t["position"] == 0 for t in other["triggers"] + other["negative_triggers"])
        app.state.engine.dispose()


def test_a_job_queued_before_the_option_existed_mines_position_0_as_it_did():
    spec = RunSpec.from_settings(Settings(_env_file=None))
    before = {name: value for name, value in spec.options().items() if name != "first_position"}
    job = Job(kind=JobKind.index, options=before)
    assert job.spec.first_position is True
    assert spec.first_position is Settings.model_fields["first_position"].default is False
