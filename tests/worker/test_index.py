"""An index run end to end on a tiny model: what is stored equals a direct recomputation."""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta

import pytest
import torch
from sqlalchemy import func, select
from transformers import LlamaConfig, LlamaForCausalLM

from bench.tiny_tokenizer import TRAINING_TEXT, tiny_tokenizer
from ffmem.config import Settings
from ffmem.engine.mining import batches as mining
from ffmem.engine.mining.corpus import mined_from
from ffmem.engine.model.hooks import capture
from ffmem.engine.values.projection import value_logits
from ffmem.store import corpora, memory_reads, memory_search, runs, vocabularies
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Job, KeyStats, MemoryList, MinedLayerRow, Run, RunStatus, Sentence, Shard
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index

SENTENCES = [*TRAINING_TEXT, "Café culture <script>alert(1)</script> spread across Europe."]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(SENTENCES * 3) + "\n\n")
    return path


def options(tiny_model_dir, corpus_file, tmp_path, **changes) -> IndexOptions:
    base = dict(
        model=str(tiny_model_dir),
        corpus=str(corpus_file),
        sentences=None,
        held_out_every=0,  # every sentence mined, as the recomputations here assume
        top_k=4,
        device="cpu",
        dtype="float32",
        batch_tokens=64,
        shard_sentences=8,
        value_tokens=5,
        cache_dir=tmp_path / "cache",
    )
    return IndexOptions.from_settings(Settings(**(base | changes)), progress=False)


def test_index_stores_what_a_direct_recomputation_gives(db_url, tiny, tiny_model_dir, corpus_file, tmp_path):
    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(options(tiny_model_dir, corpus_file, tmp_path), sessions, loaded=tiny)
    assert summary.sentences == 21 and summary.layers == 3 and summary.keys == 48
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        assert run.status == RunStatus.done and run.finished_at is not None
        assert run.finished_at - run.started_at >= timedelta(seconds=summary.mining_seconds)
        assert run.provenance["corpus"] == "corpus.txt" and run.top_k == 4
        assert run.n_tokens == summary.tokens
        count = runs.count_entries
        assert count(session=session, run_id=run.id, kind="triggers") == summary.triggers == 3 * 48 * 2 * 4
        assert summary.value_tokens == 3 * 48 * 2 * 2 * 5
        assert session.scalar(select(func.count()).select_from(MemoryList)) == 3 * 48 * (2 + 2 * 2)
        assert session.scalar(select(func.count()).select_from(KeyStats)) == 3 * 48
        for layer, key in [(0, 0), (1, 17), (2, 47)]:
            for sign in (1, -1):
                triggers = memory_reads.get_triggers(
                    session=session, run_id=run.id, layer=layer, key=key, sign=sign
                )
                assert [t.rank for t in triggers] == [0, 1, 2, 3]
                for trigger in triggers:
                    sentence = session.get(Sentence, (run.corpus_id, trigger.sentence_index))
                    with torch.inference_mode(), capture(tiny.model, tiny.adapter, [layer]) as captured:
                        tiny.model(torch.tensor([sentence.token_ids]))
                    m = captured.coefficients[layer][0, :, key]  # [pos]
                    first = mined_from([sentence.first_position], first_position=False)[0]  # the default
                    best = first + int(m[first:].argmax() if sign == 1 else m[first:].argmin())
                    assert trigger.position == best
                    assert trigger.coefficient == pytest.approx(float(m[best]), rel=1e-5, abs=1e-5)
                    assert sentence.text in SENTENCES
            stats = memory_reads.get_key_stats(session=session, run_id=run.id, layer=layer, key=key)
            value = tiny.adapter.value_matrix(tiny.adapter.blocks(tiny.model)[layer])[key]  # [d]
            assert stats.value_norm == pytest.approx(float(value.detach().norm()), rel=1e-5)
            assert sum(stats.histogram) == run.n_tokens
            raw = value_logits(tiny, value[None], "raw")[0].detach()  # [vocab]
            assert stats.max_prob == pytest.approx(float(raw.softmax(-1).max()), rel=1e-4)
            top_ids = set(raw.topk(5).indices.tolist())
            positive = memory_reads.get_triggers(session=session, run_id=run.id, layer=layer, key=key, sign=1)
            following = []
            for trigger in positive:
                ids = session.get(Sentence, (run.corpus_id, trigger.sentence_index)).token_ids
                following.append(ids[trigger.position + 1] if trigger.position + 1 < len(ids) else None)
            assert stats.agreement == sum(token in top_ids for token in following)
            if following[0] is None:
                assert stats.next_token_rank is None
            else:
                assert stats.next_token_rank == int((raw > raw[following[0]]).sum())
            magnitudes = [abs(m) for m in _coefficients(tiny, session, run, layer, key)]
            peak = max(magnitudes)
            # density: |m| within three octaves of the peak's octave [2^e, 2^(e+1)), i.e. |m| >= 2^(e-2)
            floor = 2.0 ** (math.floor(math.log2(peak)) - 2)
            assert stats.density == pytest.approx(sum(m >= floor for m in magnitudes) / run.n_tokens)
            for readout in ("raw", "norm"):
                logits = value_logits(tiny, value[None], readout)[0].detach()  # [vocab]
                probs = logits.softmax(-1)
                top = memory_reads.get_value_tokens(
                    session=session, run_id=run.id, layer=layer, key=key, readout=readout, direction=1
                )
                assert [t.token_id for t in top] == logits.topk(5).indices.tolist()
                assert top[0].prob == pytest.approx(float(probs.max()), rel=1e-4)
                # prob = exp(logit − log_z) with the stored log-normaliser: the softmax, to float32's error
                for t in top:
                    assert t.prob == pytest.approx(float(probs[t.token_id]), rel=1e-5)
                bottom = memory_reads.get_value_tokens(
                    session=session, run_id=run.id, layer=layer, key=key, readout=readout, direction=-1
                )
                assert [t.token_id for t in bottom] == logits.topk(5, largest=False).indices.tolist()


def stored_rows(session, run_id: int) -> tuple[list, list, list]:
    """Everything a run stored, in a comparable order."""
    triggers = [
        (t.layer, t.key, t.sign, t.rank, t.sentence_index, t.position, t.coefficient)
        for t in memory_reads.iter_triggers(session=session, run_id=run_id)
    ]
    stats = session.execute(
        select(KeyStats.layer, KeyStats.key, KeyStats.histogram, KeyStats.positive_share, KeyStats.mean)
        .where(KeyStats.run_id == run_id)
        .order_by(KeyStats.layer, KeyStats.key)
    ).all()
    values = [
        (v.layer, v.key, v.readout, v.direction, v.token_id)
        for v in memory_reads.iter_value_tokens(session=session, run_id=run_id)
    ]
    return triggers, [tuple(r) for r in stats], values


def test_a_crashed_index_resumes_from_its_checkpoint(
    tmp_path, tiny, tiny_model_dir, corpus_file, monkeypatch
):
    from ffmem.store.db import upgrade

    urls = [f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db")]
    for url in urls:
        upgrade(url)
    one, crashed = (make_sessionmaker(make_engine(url)) for url in urls)
    uninterrupted = build_index(
        options(tiny_model_dir, corpus_file, tmp_path, checkpoint_batches=2), one, loaded=tiny
    )

    real = mining.mine_batches
    calls = {"n": 0}
    compiled_fold = []  # each batch's MiningState.compiled_fold

    def crash_on_fifth_batch(loaded, batches, state, *args, **kwargs):
        calls["n"] += 1
        compiled_fold.append(state.compiled_fold)
        if calls["n"] == 5:
            raise KeyboardInterrupt("simulated crash")
        return real(loaded, batches, state, *args, **kwargs)

    # The crashed and resumed runs with the setting compiled_fold (FFMEM_COMPILED_FOLD): it reaches the
    # mining state of a new shard and of a resumed one; on a CPU it changes nothing stored.
    monkeypatch.setattr("ffmem.worker.index.mine_batches", crash_on_fifth_batch)
    with pytest.raises(KeyboardInterrupt):
        build_index(
            options(tiny_model_dir, corpus_file, tmp_path, checkpoint_batches=2, compiled_fold=True),
            crashed,
            loaded=tiny,
        )
    with crashed() as session:
        shard = session.scalars(select(Shard).where(Shard.status != "done")).first()
        assert shard.batches_done >= 2 and session.scalars(select(Job.status)).one() == "running"
    calls["n"] = -1000  # no more crashes
    resumed = build_index(
        options(tiny_model_dir, corpus_file, tmp_path, checkpoint_batches=2, compiled_fold=True),
        crashed,
        loaded=tiny,
    )
    assert len(compiled_fold) > 5 and all(compiled_fold)
    assert resumed.resumed_shards == 1 and resumed.run_id == 1  # the same run, not a new one
    with one() as a, crashed() as b:
        assert stored_rows(a, uninterrupted.run_id) == stored_rows(b, resumed.run_id)
        assert b.scalars(select(MinedLayerRow)).all() == []  # checkpoints and snapshot dropped once stored
        assert {s.status for s in b.scalars(select(Shard))} == {"done"}


def _coefficients(tiny, session, run, layer: int, key: int) -> list[float]:
    """Every mined coefficient of one key over the run's corpus, recomputed one sentence at a time."""
    found = []
    sentences = session.scalars(select(Sentence).where(Sentence.corpus_id == run.corpus_id)).all()
    for sentence in sentences:
        with torch.inference_mode(), capture(tiny.model, tiny.adapter, [layer]) as captured:
            tiny.model(torch.tensor([sentence.token_ids]))
        first = mined_from([sentence.first_position], first_position=run.provenance["first_position"])[0]
        found += captured.coefficients[layer][0, first:, key].tolist()
    return found


def test_key_examples_shade_every_token_and_sample_every_band(
    db_url, tiny, tiny_model_dir, corpus_file, tmp_path
):
    """Each key's stored band samples are its mined ones; the shading of its first triggers and samples
    equals the coefficient at every token of the sentence run alone (a plain hook on down_proj), and at
    the trigger's position it is the stored coefficient."""
    from ffmem.store.key_examples import key_examples

    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(
        options(tiny_model_dir, corpus_file, tmp_path, shaded_triggers=2), sessions, loaded=tiny
    )
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        ids = corpora.load_sentence_tokens(session=session, corpus_id=run.corpus_id)
        for layer, key in ((0, 0), (1, 17), (2, 47)):
            found = key_examples(session=session, run_id=run.id, layer=layer, key=key)
            triggers = {
                sign: memory_reads.get_triggers(
                    session=session, run_id=run.id, layer=layer, key=key, sign=sign
                )
                for sign in (1, -1)
            }
            assert (found.positive, found.negative) == (2, 2) and found.samples
            shown = [*triggers[1][:2], *triggers[-1][:2], *found.samples]
            arrays = found.shading([len(ids[row.sentence_index]) for row in shown])
            for row, values, step in zip(shown, arrays, found.steps(), strict=True):
                m = _coefficients_by_hand(tiny, ids[row.sentence_index], layer)[:, key]  # [pos]
                assert math.isnan(values[0])  # position 0 is not mined (no BOS, the default)
                assert step == pytest.approx(float(m[1:].abs().max()) / 127, rel=1e-4)  # its peak / 127
                # int8 codes: within half a step, up to the recomputation's float32 noise
                tolerance = float(step) / 2 + 1e-4
                assert values[1:] == pytest.approx(m[1:].numpy(), abs=tolerance)
                assert float(values[row.position]) == pytest.approx(row.coefficient, abs=tolerance)


def _coefficients_by_hand(tiny, ids: list[int], layer: int) -> torch.Tensor:
    """m [pos, keys] of one layer for one sentence alone: the input of its down_proj, by a plain hook."""
    seen = {}
    handle = tiny.model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(
        lambda module, args: seen.setdefault("m", args[0][0].detach().clone())
    )
    try:
        with torch.inference_mode():
            tiny.model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return seen["m"]


def test_held_out_sentences_are_never_mined_and_are_what_the_analyses_read(
    db_url, tiny, tiny_model_dir, corpus_file, tmp_path
):
    from ffmem.worker.held_out import held_out

    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(
        options(tiny_model_dir, corpus_file, tmp_path, held_out_every=3), sessions, loaded=tiny
    )
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        assert run.corpus.n_sentences == 21 and run.n_sentences == summary.sentences == 14
        assert (
            run.provenance["held_out_every"] == 3 and "7 sentences, not mined" in run.provenance["held_out"]
        )
        mined = {t.sentence_index for t in memory_reads.iter_triggers(session=session, run_id=run.id)}
        assert mined and not {i for i in mined if i % 3 == 2}
        read = held_out(session, run, 5, tiny)
        stored = corpora.get_sentences(session=session, corpus_id=run.corpus_id, indices=[2, 5, 8, 11, 14])
        assert [s.text for s in read] == [stored[i].text for i in (2, 5, 8, 11, 14)]
        assert [s.token_ids for s in read] == [stored[i].token_ids for i in (2, 5, 8, 11, 14)]


def test_a_vocabulary_padded_past_the_tokenizer_is_indexed_whole(db_url, corpus_file, tmp_path):
    """Qwen2.5 pads its output embedding past its tokenizer (152,064 rows, 151,665 tokens): every row is a
    vocabulary entry (the padding named ⟨unused N⟩), read out by the values and found by token search."""
    tokenizer = tiny_tokenizer()
    padded = len(tokenizer) + 5
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=padded, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    folder = tmp_path / "padded"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(options(folder, corpus_file, tmp_path), sessions)
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        assert run.status == RunStatus.done and run.model.vocab_size == padded
        texts = vocabularies.vocabulary(session=session, model_id=run.model_id)
        assert len(texts) == padded and texts[padded - 1] == f"⟨unused {padded - 1}⟩"
        last = memory_search.token_memories(
            session=session, run_id=run.id, readout="raw", token_ids=[padded - 1]
        )
        for listed in last[padded - 1]["memory"]:  # the depth's 32 of the 48 memories in each list
            assert len(set(listed.tolist())) == 32 and 0 <= listed.min() and listed.max() < 2 * 24


def test_checkpoints_come_by_batches_or_by_time_and_take_at_most_a_tenth_of_mining(monkeypatch):
    from ffmem.worker import index

    clock = {"now": 1000.0}
    monkeypatch.setattr(index.time, "perf_counter", lambda: clock["now"])
    by_batches = index.Checkpoints(batches=4, seconds=60, last=1000.0)
    assert [n for n in range(1, 13) if by_batches.due(n, first=False)] == [4, 8, 12]
    assert [n for n in range(1, 6) if by_batches.due(n, first=True)] == [index.FIRST_CHECKPOINT, 4]

    by_time = index.Checkpoints(batches=0, seconds=60, last=1000.0)  # the shard started at 1000
    assert by_time.due(index.FIRST_CHECKPOINT, first=True)  # the run's first shard: early, whatever the time
    assert not by_time.due(index.FIRST_CHECKPOINT, first=False) and not by_time.due(5, first=False)
    clock["now"] = 1059.9
    assert not by_time.due(6, first=False)
    clock["now"] = 1060.0
    assert by_time.due(7, first=False)
    by_time.taken(begun=1050.0)  # that one took 10 s (an 8B model's 1.2 GB): the next waits 100 s, not 60
    assert (by_time.last, by_time.cost) == (1060.0, 10.0)
    clock["now"] = 1060.0 + 99.0
    assert not by_time.due(8, first=False)
    clock["now"] = 1060.0 + 100.0
    assert by_time.due(9, first=False)


def test_a_run_without_a_shard_size_gets_the_models(db_url, tiny, tiny_model_dir, corpus_file, tmp_path):
    sessions = make_sessionmaker(make_engine(db_url))
    summary = build_index(
        options(tiny_model_dir, corpus_file, tmp_path, shard_sentences=0), sessions, loaded=tiny
    )
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        assert run.provenance["shard_sentences"] == 2048  # 144 memories: the least automatic size
        assert session.scalar(select(func.count()).where(Shard.run_id == run.id)) == 1
        assert summary.sentences == 21 and run.status == RunStatus.done


def test_the_observer_is_told_each_timed_step_as_the_summary_counts_it(
    db_url, tiny, tiny_model_dir, corpus_file, tmp_path
):
    """IndexOptions.observer (how bench/device/run_index.py measures the stages): (name, None) as each
    timed step starts and (name, seconds) as it ends, an inner step ended before its outer one; the
    seconds it is told are the ones the summary adds up."""
    told: list[tuple[str, float | None]] = []
    observed = dataclasses.replace(
        options(tiny_model_dir, corpus_file, tmp_path),
        observer=lambda name, seconds: told.append((name, seconds)),
    )
    summary = build_index(observed, make_sessionmaker(make_engine(db_url)), loaded=tiny)
    open_steps, ended = [], {}
    for name, seconds in told:
        if seconds is None:
            open_steps.append(name)
        else:
            assert open_steps.pop() == name and seconds >= 0
            ended.setdefault(name, []).append(seconds)
    assert open_steps == []
    finishing = ["shading", "layers", "weight_graph", "token_change", "explanations", "neighbours", "closing"]
    assert [name for name, seconds in told if seconds is not None and name in finishing] == finishing
    assert len(ended["mining"]) == 3  # 21 sentences in shards of 8
    assert sum(ended["mining"]) == summary.mining_seconds
    assert sum(ended["projection"]) == summary.projection_seconds
    assert sum(ended["storing"]) == summary.storing_seconds
    assert sum(ended["shading"]) == summary.shading_seconds
