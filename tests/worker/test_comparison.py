"""Two runs side by side (ffmem.worker.comparison): the same corpus mined in other shard sizes compares as
identical, and a tiny model with one memory's key and value changed has that memory at the top."""

from __future__ import annotations

import shutil

import pytest
import torch
from explorer_index import EXPLORER_SENTENCES
from transformers import LlamaForCausalLM

from ffmem.config import Settings
from ffmem.engine.errors import FfmemError
from ffmem.engine.relations.comparison import overlap
from ffmem.store import comparison
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Comparison, Job, JobStatus, KeyChange, Run
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import Worker, build_index

CHANGED = (1, 7)  # the memory whose up row (key) and value are replaced in the perturbed model


def options(model: str, corpus, folder, shard_sentences: int, top_k: int = 6) -> IndexOptions:
    return IndexOptions.from_settings(
        Settings(
            model=model,
            corpus=str(corpus),
            sentences=None,
            top_k=top_k,
            device="cpu",
            dtype="float32",
            batch_tokens=128,
            shard_sentences=shard_sentences,
            value_tokens=8,
            cache_dir=folder / "cache",
        ),
        progress=False,
    )


@pytest.fixture(scope="module")
def perturbed_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with memory CHANGED's up row and value replaced by random directions."""
    folder = tmp_path_factory.mktemp("tiny-llama-perturbed")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    layer, key = CHANGED
    generator = torch.Generator().manual_seed(1)
    mlp = model.model.layers[layer].mlp
    with torch.no_grad():
        mlp.up_proj.weight[key] = torch.randn(mlp.up_proj.weight.shape[1], generator=generator)
        mlp.down_proj.weight[:, key] = torch.randn(mlp.down_proj.weight.shape[0], generator=generator)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def three_runs(request, tmp_path_factory, tiny, tiny_model_dir, perturbed_dir):
    """(sessions, [run of the tiny model in shards of 8, the same in shards of 3, the perturbed model's])."""
    from conftest import migrated_url

    folder = tmp_path_factory.mktemp("comparison")
    url = migrated_url(request, folder)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(EXPLORER_SENTENCES * 2) + "\n")
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    runs = [
        build_index(options(str(tiny_model_dir), corpus, folder, 8), sessions, loaded=tiny).run_id,
        build_index(options(str(tiny_model_dir), corpus, folder, 3), sessions, loaded=tiny).run_id,
        build_index(options(str(perturbed_dir), corpus, folder, 8, top_k=4), sessions).run_id,
    ]
    yield sessions, runs
    engine.dispose()


def compare(sessions, a: int, b: int, tmp_path) -> Comparison:
    """Queue the pair's job and let a fresh worker (no model held) do it."""
    with sessions() as session:
        job, _ = comparison.enqueue_comparison(session=session, run_a=a, run_b=b)
        session.commit()
        job_id = job.id
    worker = Worker(sessions, options("unused", "unused", tmp_path, 8))
    worker.work(job_id=job_id)
    with sessions() as session:
        assert session.get(Job, job_id).status == JobStatus.done
        found = comparison.get_comparison(session=session, run_a=a, run_b=b)
        session.expunge(found)
        return found


def changes(sessions, found: Comparison, sort: str = "change", limit: int = 10_000) -> list[KeyChange]:
    with sessions() as session:
        rows = comparison.key_changes(session=session, comparison_id=found.id, sort=sort, limit=limit)
        for row in rows:
            session.expunge(row)
        return rows


def test_the_same_corpus_in_other_shard_sizes_compares_as_identical(three_runs, tmp_path):
    sessions, (eights, threes, _) = three_runs
    found = compare(sessions, threes, eights, tmp_path)  # either order: stored lower id first
    assert (found.run_a, found.run_b) == (eights, threes)
    assert found.basis == "sentences" and found.top_t == 6
    assert found.details["same_weights"] is True
    assert found.details["keys"].startswith("gate and up rows")
    rows = changes(sessions, found)
    assert len(rows) == 3 * 48
    for row in rows:
        assert row.overlap == 1.0 and row.negative_overlap == 1.0
        for cosine in (row.key_cosine, row.gate_cosine, row.up_cosine, row.value_cosine):
            assert cosine == pytest.approx(1.0, abs=1e-12)
        assert row.moved == pytest.approx(0.0, abs=1e-12)
        for name in comparison.STATISTICS:
            change = getattr(row, f"d_{name}")
            # float32 noise only: other shard sizes batch the sentences otherwise (coefficients ~1–10)
            assert change is None or change == pytest.approx(0.0, abs=1e-5), (name, change)
        assert row.d_mean is not None and row.d_max_coefficient is not None
    for summary in found.layers:
        assert summary["mean_overlap"] == 1.0 and summary["triggers_changed"] == 0
        assert summary["mean_key_cosine"] == pytest.approx(1.0)


def test_a_perturbed_memory_tops_the_list(three_runs, tmp_path, tiny_model_dir, perturbed_dir):
    sessions, (eights, _, perturbed) = three_runs
    found = compare(sessions, eights, perturbed, tmp_path)
    assert found.details["same_weights"] is False
    with sessions() as session:
        a, b = session.get(Run, eights), session.get(Run, perturbed)
        assert found.basis == ("sentences" if a.corpus_id == b.corpus_id else "texts")
    assert found.top_t == 4  # the smaller top-T
    for sort in ("change", "key", "value"):
        top = changes(sessions, found, sort=sort, limit=1)[0]
        assert (top.layer, top.key) == CHANGED, sort
    rows = {(row.layer, row.key): row for row in changes(sessions, found)}
    # A hand computation from the two saved models, apart from the engine.
    layer, key = CHANGED
    mlps = [
        LlamaForCausalLM.from_pretrained(d).model.layers[layer].mlp for d in (tiny_model_dir, perturbed_dir)
    ]

    def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.detach().double(), y.detach().double()
        return float(x @ y / (x.norm() * y.norm()))

    gate = cosine(mlps[0].gate_proj.weight[key], mlps[1].gate_proj.weight[key])
    up = cosine(mlps[0].up_proj.weight[key], mlps[1].up_proj.weight[key])
    value = cosine(mlps[0].down_proj.weight[:, key], mlps[1].down_proj.weight[:, key])
    changed = rows[CHANGED]
    assert changed.gate_cosine == pytest.approx(gate, abs=1e-6) and gate == pytest.approx(1.0)
    assert changed.up_cosine == pytest.approx(up, abs=1e-6)
    assert changed.key_cosine == pytest.approx(gate * up, abs=1e-6)
    assert changed.value_cosine == pytest.approx(value, abs=1e-6)
    assert changed.moved == pytest.approx(1 - min(gate * up, value), abs=1e-6)
    untouched = [row for place, row in rows.items() if place != CHANGED]
    assert all(row.moved == pytest.approx(0.0, abs=1e-6) for row in untouched)
    # Layer 0 comes before the change: its keys see the same inputs, so their triggers are the same.
    assert all(row.overlap == 1.0 for row in untouched if row.layer == 0)


def test_overlap_is_the_shared_share_of_the_larger_set():
    assert overlap([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5
    assert overlap([1, 2], [1, 2, 3, 4]) == 0.5
    assert overlap([], []) is None
    assert overlap(["a b"], ["a b"]) == 1.0


def test_runs_of_different_shapes_fail_the_job_with_the_reason(three_runs, tmp_path):
    sessions, (eights, _, perturbed) = three_runs
    with sessions() as session:
        run = session.get(Run, eights)
        model = run.model
        n_keys = model.n_keys
        model.n_keys = n_keys + 1  # as if another model's
        session.commit()
    try:
        with sessions() as session:
            job, _ = comparison.enqueue_comparison(session=session, run_a=eights, run_b=perturbed, again=True)
            session.commit()
            job_id = job.id
        worker = Worker(sessions, options("unused", "unused", tmp_path, 8))
        with pytest.raises(FfmemError, match="differ in shape"):
            worker.work(job_id=job_id)
        with sessions() as session:
            assert session.get(Job, job_id).status == JobStatus.failed
    finally:
        with sessions() as session:
            session.get(Run, eights).model.n_keys = n_keys
            session.commit()
