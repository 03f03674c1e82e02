"""`ffmem.open(url)`: the index from Python — models → runs → layers → keys — equal to what the explorer
serves (its JSON twins) and to the stored rows decoded by hand here; tables as DataFrames; no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ffmem
from ffmem.store import memory_lists
from ffmem.store.models import Label, MemoryList, Neighbours, Sentence

pytestmark = pytest.mark.backends("sqlite", "postgres")

SCORED = np.dtype([("layer", "<i2"), ("key", "<i4"), ("score", "<f4")])


@pytest.fixture(scope="module")
def index(explorer_db):
    with ffmem.open(explorer_db) as opened:
        yield opened


def test_models_runs_layers_keys(index, run, slug):
    assert [model.slug for model in index.models] == [slug]
    model = index.model(slug)
    assert (model.n_layers, model.n_keys) == (run.model.n_layers, run.model.n_keys)
    assert [r.id for r in model.runs] == [run.id] and model.run().id == run.id
    found = model.run(run.id)
    assert (found.status, found.corpus, found.n_tokens) == ("done", run.corpus.name, run.n_tokens)
    assert len(found.layers) == model.n_layers and len(found.layer(1).keys) == model.n_keys
    assert repr(found.key(1, 4)) == f"<Key {slug} run {run.id} layer 1 key 4>"
    with pytest.raises(IndexError, match=f"layer 99 is out of range: 0 to {model.n_layers - 1}"):
        found.layer(99)
    with pytest.raises(IndexError, match="key 999 is out of range"):
        found.layer(1).key(999)
    with pytest.raises(LookupError, match=f"no model 'nope': this index holds {slug}"):
        index.model("nope")
    with pytest.raises(LookupError, match=f"{slug} has no run 99"):
        model.run(99)


def test_a_keys_triggers_are_the_stored_ones_with_their_text_and_shading(index, db, run):
    key = index.model().run().key(1, 4)
    for sign, triggers in ((1, key.triggers), (-1, key.negative_triggers)):
        blob = db.get(MemoryList, (run.id, "triggers", sign, 1, 4)).data
        stored = memory_lists.decode_triggers(blob)  # as the store reads it (packed since 0031; test_storage)
        assert [(t.sentence_index, t.position) for t in triggers] == [
            (int(s), int(p)) for s, p, _ in stored.tolist()
        ]
        assert [t.coefficient for t in triggers] == pytest.approx(stored["coefficient"].tolist())
        assert [t.rank for t in triggers] == list(range(len(stored))) and {t.sign for t in triggers} == {sign}
        first = triggers[0]
        sentence = db.get(Sentence, (run.corpus_id, first.sentence_index))
        assert first.sentence == sentence.text
        assert first.prefix == sentence.text[: sentence.offsets[first.position][1]]
        # The shading: the coefficient at every token of the sentence, its peak the trigger's to float32's
        # precision (ffmem.store.models.KeyExamples).
        assert len(first.shading) == len(sentence.token_ids)
        assert first.shading[first.position] == pytest.approx(first.coefficient, rel=1e-6)
        assert triggers[-1].shading is None or len(triggers[-1].shading) > 0
    frame = key.triggers.to_pandas()
    assert list(frame.columns) == [
        "sign", "rank", "sentence_index", "position", "coefficient", "prefix", "token", "next_token",
        "sentence", "shading",
    ]  # fmt: skip
    assert len(frame) == len(key.triggers) and frame["coefficient"].is_monotonic_decreasing


def test_a_key_reads_as_its_page_does(index, client, slug, db, run):
    db.add(Label(model_id=run.model_id, layer=1, key=4, pattern="a city", tag="semantic", author="ada",
                 created_at=run.started_at))  # fmt: skip
    db.commit()
    try:
        key = index.model().run().key(1, 4)
        page = client.get(f"/m/{slug}/layers/1/keys/4.json").json()
        for readout in ("raw", "norm"):
            for direction, side in ((1, "top"), (-1, "bottom")):
                assert [
                    {
                        "rank": v.rank,
                        "token": v.token,
                        "token_id": v.token_id,
                        "logit": v.logit,
                        "prob": v.prob,
                    }
                    for v in key.values(readout, direction)
                ] == [pytest.approx(t) for t in page["value"][readout][side]]
        assert len(key.value_tokens) == sum(
            len(page["value"][r][s]) for r in ("raw", "norm") for s in ("top", "bottom")
        )
        assert {name: key.stats[name] for name in page["stats"]} == pytest.approx(page["stats"])
        assert key.stats["histogram"] == page["histogram"]["counts"]
        assert (key.explanation.text, key.explanation.score) == (
            page["explanation"]["text"], pytest.approx(page["explanation"]["score"]),
        )  # fmt: skip
        assert (
            key.label == ffmem.api.Label("a city", "semantic", "ada") and page["label"]["pattern"] == "a city"
        )
        assert [t.prefix for t in key.triggers[:3]] == [t["prefix"] for t in page["triggers"][:3]]
    finally:
        db.execute(Label.__table__.delete())
        db.commit()
    with pytest.raises(ValueError, match="readout is one of raw, norm, not 'logit'"):
        key.values("logit")


def test_neighbours_quadrants_and_the_layer_table(index, db, run):
    key = index.model().run().key(2, 7)
    row = db.get(Neighbours, (run.id, 2, 7))
    expected = [
        ("key" if i == 0 else "value", lay, k, c)
        for i, blob in enumerate((row.by_key, row.by_value))
        for lay, k, c in np.frombuffer(blob, SCORED).tolist()
    ]
    found = [(n.kind, n.layer, n.key, n.cosine) for n in key.neighbours]
    assert [f[:3] for f in found] == [e[:3] for e in expected]
    assert [f[3] for f in found] == pytest.approx([e[3] for e in expected], abs=1e-6)
    quadrants = key.quadrants  # the tiny Llama's FFs are gated
    assert set(quadrants.shares) == {"pp", "pn", "np", "nn"}
    assert sum(quadrants.shares.values()) == pytest.approx(1, abs=1e-5)
    assert [key.stats[f"quadrant_{q}"] for q in quadrants.shares] == pytest.approx(
        list(quadrants.shares.values())
    )
    for example in quadrants.examples:
        assert example.sentence == db.get(Sentence, (run.corpus_id, example.sentence_index)).text
    layer = index.model().run().layer(2)
    frame = layer.to_pandas()
    assert len(frame) == run.model.n_keys and list(frame["key"]) == list(range(run.model.n_keys))
    assert frame.loc[7, "max_coefficient"] == pytest.approx(key.stats["max_coefficient"])
    assert set(index.model().run().analyses) >= {"explanations", "weight_graph"}


def test_the_api_never_imports_torch(explorer_db):
    code = (
        "import sys, ffmem\n"
        "assert 'ffmem.api' not in sys.modules\n"
        f"index = ffmem.open({explorer_db!r})\n"
        "key = index.model().run().key(1, 4)\n"
        "assert key.triggers and key.value_tokens and key.stats\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "index.close()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
