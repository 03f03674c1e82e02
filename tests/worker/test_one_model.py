"""A worker process holds one model: its index work and its live traces share the copy (one forward pass
at a time); a model that fails its checks fails the job with the message; the run records the checksum."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from sqlalchemy import select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.engine.model.loaded import ModelLoadError
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Job, Run
from ffmem.worker.index import IndexOptions
from ffmem.worker.live_executor import Live
from ffmem.worker.loop import Worker, build_index


def _options(model, tmp_path, **changes) -> IndexOptions:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
    base = dict(
        model=str(model),
        corpus=str(corpus),
        sentences=None,
        top_k=2,
        device="cpu",
        dtype="auto",
        batch_tokens=64,
        shard_sentences=8,
        value_tokens=3,
        cache_dir=tmp_path / "cache",
    )
    return IndexOptions.from_settings(Settings(**(base | changes)), progress=False)


def test_the_index_work_and_the_live_traces_share_one_model(tiny_model_dir, tmp_path):
    options = _options(tiny_model_dir, tmp_path)
    live = Live(device="cpu", cache_dir=options.cache_dir)
    loaded = Worker(sessions=None, options=options).model(options.spec)
    assert live.model(str(tiny_model_dir)) is loaded  # one copy in the process

    traced = []

    def trace() -> None:
        asyncio.run(live.run(str(tiny_model_dir), lambda model: traced.append(model is loaded)))

    with loaded.lock:  # the worker is running a batch through the model
        thread = threading.Thread(target=trace)
        thread.start()
        time.sleep(0.3)
        assert traced == []  # the trace waits for it
    thread.join(timeout=10)
    assert traced == [True]


def test_the_run_records_the_checksum_of_the_weights_it_used(db_url, tiny, tiny_model_dir, tmp_path):
    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(_options(tiny_model_dir, tmp_path), sessions)
    with sessions() as session:
        provenance = session.get(Run, summary.run_id).provenance
    assert provenance["weights_sha256"] == tiny.weights_sha256


def test_a_model_that_fails_its_checks_fails_the_job_with_the_message(db_url, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    with safe_open(broken / "model.safetensors", "pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys() if name != "model.norm.weight"}
    save_file(tensors, str(broken / "model.safetensors"), metadata=metadata)
    sessions = make_sessionmaker(make_engine(db_url))
    with pytest.raises(
        ModelLoadError, match=r"did not load cleanly: 1 weights missing .*: model\.norm\.weight"
    ):
        build_index(_options(broken, tmp_path), sessions)
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.kind == "index")).one()
        assert job.status == "failed" and job.run_id is None
        assert job.error["type"] == "ModelLoadError" and "model.norm.weight" in job.error["message"]
