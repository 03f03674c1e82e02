"""A gated memory's sign quadrants on the explorer: the key page's 2×2 panel, one page per quadrant and
the layer table's dominant quadrant equal what the tiny SwiGLU model's own gate and up projections give,
read here apart from ffmem.engine, over the sentences the run mined."""

from __future__ import annotations

import re
from html import unescape

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from markupsafe import escape
from sqlalchemy import func, select
from transformers import GPT2Config, GPT2LMHeadModel

from bench.tiny_tokenizer import TRAINING_TEXT, tiny_tokenizer
from ffmem.config import Settings
from ffmem.engine.mining.corpus import mined_sentences
from ffmem.store import corpora
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Corpus, Job, KeyExamples, KeyStats, LanguageModel
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index

LAYER = 1
NAMES = ("pp", "pn", "np", "nn")


@pytest.fixture(scope="module")
def brute(db, run, tiny):
    """Per key of LAYER: the quadrant counts and every (|m|, sentence text, position, m, gate, input)
    of each quadrant's per-sentence best, from act(x·g) and x·u read by hooks of this test."""
    spec = db.scalars(select(Job)).first().options
    indices = mined_sentences(db.get(Corpus, run.corpus_id).n_sentences, spec["held_out_every"])
    sentences = corpora.get_sentences(session=db, corpus_id=run.corpus_id, indices=indices)
    mlp = tiny.model.model.layers[LAYER].mlp
    captured = {}
    handles = [
        mlp.gate_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("gate", o)),
        mlp.up_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("up", o)),
    ]
    counts = np.zeros((tiny.n_keys, 4), dtype=np.int64)
    best = [[[] for _ in range(4)] for _ in range(tiny.n_keys)]
    try:
        with torch.inference_mode():
            for index in indices:
                sentence = sentences[index]
                first = max(sentence.first_position, 0 if spec["first_position"] else 1)
                tiny.model.base_model(input_ids=torch.tensor([sentence.token_ids]))
                gate = F.silu(captured["gate"][0, first:]).numpy()  # [pos, keys]
                up = captured["up"][0, first:].numpy()  # [pos, keys]
                m = gate * up
                quadrant = 2 * (((m < 0) & (up > 0)) | ((m > 0) & (up < 0))) + (up < 0)  # [pos, keys]
                for key in range(tiny.n_keys):
                    for q in range(4):
                        where = np.flatnonzero(quadrant[:, key] == q)
                        counts[key, q] += len(where)
                        if len(where):
                            p = where[np.argmax(np.abs(m[where, key]))]
                            row = (
                                abs(m[p, key]),
                                sentence.text,
                                first + p,
                                m[p, key],
                                gate[p, key],
                                up[p, key],
                            )
                            best[key][q].append(row)
    finally:
        for handle in handles:
            handle.remove()
    return counts, best


def test_the_key_page_shows_the_shares_of_the_four_quadrants(client, slug, run, brute):
    counts, _ = brute
    for key in (0, 5, 17):
        page = client.get(f"/m/{slug}/layers/{LAYER}/keys/{key}.json").json()["quadrants"]
        shares = counts[key] / counts[key].sum()
        assert [q["quadrant"] for q in page["quadrants"]] == list(NAMES)
        shown = [q["share"] for q in page["quadrants"]]
        assert shown == pytest.approx(shares.tolist(), abs=1e-7)  # float32 (a 4-byte real on Postgres)
        assert [(q["gate"], q["input"], q["sign"]) for q in page["quadrants"]] == [
            (1, 1, 1), (1, -1, -1), (-1, 1, -1), (-1, -1, 1)
        ]  # fmt: skip
        assert page["dominant"] == NAMES[int(np.argmax(shares))]
        assert [q["url"] for q in page["quadrants"]] == [
            f"/m/{slug}/layers/{LAYER}/keys/{key}/quadrants/{name}?run={run.id}" for name in NAMES
        ]
        text = client.get(f"/m/{slug}/layers/{LAYER}/keys/{key}").text
        assert '<section class="quadrants" id="quadrants">' in text
        assert (
            f'href="/m/{slug}/layers/{LAYER}/keys/{key}/quadrants/nn?run={run.id}"' in text
            or not counts[key, 3]
        )


def test_a_quadrants_page_lists_its_top_sentences_with_gate_input_and_coefficient(client, slug, brute):
    _, best = brute
    key = 5
    for q, name in enumerate(NAMES):
        page = client.get(f"/m/{slug}/layers/{LAYER}/keys/{key}/quadrants/{name}.json").json()
        want = sorted(best[key][q], key=lambda r: -r[0])[:8]
        got = page["examples"]
        assert page["quadrant"]["quadrant"] == name and len(got) == len(want)
        assert sorted((e["prefix"] + e["token"] + e["rest"], e["position"]) for e in got) == sorted(
            (text, int(position)) for _, text, position, *_ in want
        )
        assert [e["coefficient"] for e in got] == pytest.approx(
            [float(r[3]) for r in want], rel=1e-4, abs=1e-6
        )
        assert [e["input"] for e in got] == pytest.approx([float(r[5]) for r in want], rel=1e-4, abs=1e-6)
        for e, r in zip(got, want, strict=True):
            assert e["gate"] == pytest.approx(float(r[4]), rel=1e-3, abs=1e-5)
            assert e["coefficient"] * (1 if name in ("pp", "nn") else -1) >= 0
        text = client.get(f"/m/{slug}/layers/{LAYER}/keys/{key}/quadrants/{name}").text
        for e in got:
            assert f"{escape(e['prefix'])}<mark>{escape(e['token'])}</mark>" in text
        assert "<script>alert" not in text


def test_the_layer_table_sorts_by_the_dominant_quadrant_and_by_each_share(client, slug, brute):
    counts, _ = brute
    shares = counts / counts.sum(axis=1, keepdims=True)  # [keys, 4]
    table = client.get(f"/m/{slug}/layers/{LAYER}.json?sort=dominant_quadrant&per_page=100").json()
    assert table["gated"] is True
    dominant = shares.argmax(axis=1)
    keys = np.arange(len(shares))  # by quadrant, then by its share (the largest first), then by key
    assert [k["key"] for k in table["keys"]] == np.lexsort((keys, -shares.max(axis=1), dominant)).tolist()
    assert len(set(dominant)) > 1 and len(set(shares.max(axis=1))) > 4  # else the order could not tell
    for row in table["keys"]:
        assert row["dominant_quadrant"] == NAMES[dominant[row["key"]]]
        assert row["dominant_share"] == pytest.approx(shares[row["key"]].max())
    by_nn = client.get(f"/m/{slug}/layers/{LAYER}.json?sort=quadrant_nn&order=desc&per_page=5").json()
    assert [k["key"] for k in by_nn["keys"]] == np.lexsort((np.arange(len(shares)), -shares[:, 3]))[
        :5
    ].tolist()
    page = client.get(f"/m/{slug}/layers/{LAYER}").text
    assert ">quadrant</a>" in page
    sorts = re.search(r'<span class="share-sorts" id="quadrant-sorts">(.*?)</span>', page, re.S).group(1)
    links = re.findall(r'<a href="([^"]+)"[^>]*title="([^"]+)">(\w+)</a>', sorts)
    run = table["run"]["id"]
    assert [(unescape(href), title, text) for href, title, text in links] == [
        (
            f"/m/{slug}/layers/{LAYER}?sort=quadrant_{q}&order=desc&per_page=50&run={run}",
            f"by the share of positions in {name}",
            q,
        )
        for q, name in zip(
            NAMES, ("gate+ input+", "gate+ input−", "gate− input+", "gate− input−"), strict=True
        )
    ]


def test_an_unknown_quadrant_is_refused_in_the_error_shape(client, slug):
    answer = client.get(f"/m/{slug}/layers/{LAYER}/keys/5/quadrants/px.json")
    assert answer.status_code == 400
    assert answer.json() == {
        "ok": False,
        "error": "quadrant: Input should be 'pp', 'pn', 'np' or 'nn'",
        "status": 400,
    }
    page = client.get(f"/m/{slug}/layers/{LAYER}/keys/5/quadrants/px")
    assert page.status_code == 400 and "Input should be" in page.text


def test_a_model_without_a_gate_has_no_quadrants_anywhere(tmp_path):
    """A tiny GELU GPT-2 indexed end to end: no quadrant stored, no panel, no column, and its quadrant page
    is a 404 that says why."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(2)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
    url = f"sqlite:///{tmp_path / 'ffmem.db'}"
    upgrade(url)
    settings = dict(held_out_every=0, top_k=3, device="cpu", dtype="float32", batch_tokens=64)
    options = IndexOptions.from_settings(
        Settings(model=str(folder), corpus=str(corpus), sentences=None, cache_dir=tmp_path, **settings),
        progress=False,
    )
    sessions = make_sessionmaker(make_engine(url))
    build_index(options, sessions)
    with sessions() as session:
        assert session.scalar(select(func.count()).where(KeyStats.dominant_quadrant.is_not(None))) == 0
        assert session.scalar(select(func.count()).where(KeyExamples.quadrants.is_not(None))) == 0
        slug = session.scalars(select(LanguageModel.slug)).one()
    app = create_app(Settings(database_url=url))
    with TestClient(app) as client:
        assert client.get(f"/m/{slug}/layers/1/keys/3.json").json()["quadrants"] is None
        assert 'id="quadrants"' not in client.get(f"/m/{slug}/layers/1/keys/3").text
        layer = client.get(f"/m/{slug}/layers/1.json").json()
        assert layer["gated"] is False and all(k["dominant_quadrant"] is None for k in layer["keys"])
        refused = client.get(f"/m/{slug}/layers/1/keys/3/quadrants/pp.json")
        assert refused.status_code == 404 and refused.json()["error"] == (
            f"{slug}'s feed-forward layers have no gate, so its memories have no sign quadrants."
        )
    app.state.engine.dispose()
