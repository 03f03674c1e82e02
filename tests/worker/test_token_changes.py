"""A run's TokenChange sample (the token_change step of finishing): stratified by layer, stored one row a
memory, each row against a recomputation written here from the held-out sentences — the key's coefficients
and the edited passes through Hugging Face's forward with plain hooks on the down projection — its output
score and its control's, and the analysis row's medians per depth third."""

from __future__ import annotations

import statistics

import pytest
import torch
from sqlalchemy import select
from tiny_models import scaled_log_p

from ffmem.config import Settings
from ffmem.store import token_changes
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Analysis, Run
from ffmem.worker.held_out import held_out
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index
from ffmem.worker.token_changes import sample_memories

SENTENCES = [
    "The capital of France is Paris.",
    "Water boils at one hundred degrees.",
    "Mozart wrote many symphonies in Vienna.",
    "The river flows through the old city.",
    "A cat sat quietly on the warm mat.",
    "Scientists measured the speed of light again.",
]


@pytest.fixture
def built(db_url, tiny, tiny_model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES * 3) + "\n")
    settings = Settings(
        model=str(tiny_model_dir),
        corpus=str(corpus),
        sentences=None,
        held_out_every=3,
        top_k=4,
        device="cpu",
        dtype="float32",
        batch_tokens=64,
        shard_sentences=8,
        value_tokens=5,
        cache_dir=tmp_path / "cache",
        token_change_memories=7,
        token_change_contexts=3,
    )
    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(IndexOptions.from_settings(settings, progress=False), sessions, loaded=tiny)
    return sessions, summary.run_id


def test_the_sample_is_stratified_and_seeded():
    sample = sample_memories(3, 48, 7)
    assert [layer for layer, _ in sample] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # ⌈7 / 3⌉ a layer
    assert sample == sample_memories(3, 48, 7) and len(set(sample)) == 9
    assert sample_memories(2, 4, 100) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def _coefficients(tiny, ids, layer, key) -> torch.Tensor:
    found = {}
    handle = tiny.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(
        lambda module, inputs: found.update(m=inputs[0][0, :, key].clone())
    )
    try:
        with torch.inference_mode():
            tiny.model(torch.tensor([ids]))
    finally:
        handle.remove()
    return found["m"]  # [pos]


def _spearman(a, b) -> float:
    ra, rb = (x.double().argsort().argsort().double() for x in (a, b))
    return float(1 - 6 * ((ra - rb) ** 2).sum() / (len(a) * (len(a) ** 2 - 1)))


def test_the_stored_sample_matches_a_recomputation(built, tiny):
    sessions, run_id = built
    with sessions() as session:
        rows = token_changes.token_changes(session=session, run_id=run_id)
        held = held_out(session, session.get(Run, run_id), 1000, tiny)
        analysis = session.scalars(
            select(Analysis).where(Analysis.run_id == run_id, Analysis.name == "token_change")
        ).one()
    assert [(r.layer, r.key) for r in rows] == [
        m for m in sample_memories(3, 48, 7) if m in {(r.layer, r.key) for r in rows}
    ]
    assert len(rows) >= 6 and held
    unembedding = tiny.model.lm_head.weight.detach()  # [vocab, d]
    for row in rows[:3] + rows[-2:]:
        places = []  # (m, sentence, position) over the held-out sentences, from the first mined position on
        for index, sentence in enumerate(held):
            m = _coefficients(tiny, sentence.token_ids, row.layer, row.key)
            places += [(float(m[p]), index, p) for p in range(max(sentence.first_position, 1), len(m))]
        top = [place for place in sorted(places, reverse=True)[:3] if place[0] > 0]
        assert row.contexts == len(top)
        change = sum(
            scaled_log_p(tiny, held[s].token_ids[: p + 1], row.layer, row.key, 2.0)
            - scaled_log_p(tiny, held[s].token_ids[: p + 1], row.layer, row.key, 0.0)
            for _, s, p in top
        ) / len(top)
        assert row.promoted == change.topk(10).indices.tolist()
        assert row.suppressed == change.topk(10, largest=False).indices.tolist()
        assert row.control_key == (row.key + 24) % 48
        for key, overlap, spearman in (
            (row.key, row.overlap, row.spearman),
            (row.control_key, row.control_overlap, row.control_spearman),
        ):
            v = tiny.model.model.layers[row.layer].mlp.down_proj.weight[:, key].detach()  # [d]
            logits = (unembedding @ v).float()  # [vocab]: VocabProj's raw readout
            assert overlap == len(set(row.promoted) & set(logits.topk(10).indices.tolist())) / 10
            assert spearman == pytest.approx(_spearman(change, logits), abs=1e-3)
    assert analysis.options == {
        "memories": 7, "contexts": 3, "factor": 2.0, "top": 10, "held_out_sentences": len(held), "seed": 0,
    }  # fmt: skip
    thirds = analysis.data["thirds"]
    upper = [r for r in rows if r.layer == 2]
    assert thirds["upper"] == {
        "memories": len(upper),
        "overlap": statistics.median(r.overlap for r in upper),
        "spearman": pytest.approx(statistics.median(r.spearman for r in upper)),
        "control_overlap": statistics.median(r.control_overlap for r in upper),
        "control_spearman": pytest.approx(statistics.median(r.control_spearman for r in upper)),
    }
    assert analysis.data["sampled"] == 9 and analysis.data["measured"] == len(rows)
