"""The explorer at a wide model's shape (a synthetic index, bench/synthetic_index.py): 3 layers × 28,672 keys
(Llama-3.3-70B's width: 86,016 memories, past 65,535; layers past 16,384 keys), Qwen3's 151,936-token
vocabulary (ids past 65,535 and 131,072 in sentences, value lists and search: nothing assumes int16 ids or
a 17-bit vocabulary), on SQLite and Postgres. Each page must answer with exactly what was written: a late
key of the last layer, its examples and related memories, the layer page under every sort and past its
first pages, filtered by a token near the vocabulary's end, token search for its last token, the model
page.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bench.synthetic_index import (
    READOUTS,
    Shape,
    explanation_scores,
    layer_arrays,
    sentence_tokens,
    token_table,
    token_text,
    write_runs,
)
from ffmem.config import Settings
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.layer_table import KEY_SORTS
from ffmem.store.memory_lists import TOKEN_LISTS
from ffmem.store.models import QUADRANT_COLUMNS
from ffmem.web.main import create_app

SHAPE = Shape(
    slug="wide",
    n_layers=3,
    n_keys=28_672,
    vocab_size=151_936,
    d_model=32,
    top_k=4,
    value_tokens=10,
    sentences=120,
    sentence_tokens=12,
    shaded_triggers=1,
    band_bins=1,
)
LAST = SHAPE.n_layers - 1
M = f"/m/{SHAPE.slug}"


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return np.array([len(ids) for ids in sentence_tokens(SHAPE)])


@pytest.fixture(scope="module")
def last_layer(lengths):
    """What the synthetic run holds in its last layer (its explanations' scores among its statistics)."""
    arrays = layer_arrays(SHAPE, LAST, lengths)
    arrays.stats["explanation"] = explanation_scores(SHAPE, LAST)
    return arrays


@pytest.fixture(scope="module")
def wide_urls(request, tmp_path_factory, migrated_template, postgres_databases) -> dict[str, object]:
    """backend → the URL of a database holding the synthetic wide run, for each backend this module's
    selected tests use (or the skip that says why it cannot be used): copies of the process's migrated
    templates, the run generated once and written into each (write_runs)."""
    from conftest import copy_database

    params = (
        getattr(item, "callspec", None) for item in request.session.items if item.module is request.module
    )
    backends = sorted(
        {callspec.params["client"] for callspec in params if callspec and "client" in callspec.params}
    )
    found: dict[str, object] = {}
    with ExitStack() as stack:
        for backend in backends:
            folder = tmp_path_factory.mktemp(f"wide-{backend}")
            try:
                found[backend] = stack.enter_context(
                    copy_database(migrated_template(backend), folder, postgres_databases)
                )
            except pytest.skip.Exception as unusable:  # Postgres not reachable (off CI)
                found[backend] = unusable
        engines = [make_engine(url) for url in found.values() if isinstance(url, str)]
        sessions = [make_sessionmaker(engine)() for engine in engines]
        write_runs(sessions, SHAPE)
        for session, engine in zip(sessions, engines, strict=True):
            session.close()
            engine.dispose()
        yield found


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def client(request, wide_urls):
    """The explorer on a database holding the synthetic wide run."""
    url = wide_urls[request.param]
    if isinstance(url, BaseException):
        raise url
    app = create_app(Settings(database_url=url))
    with TestClient(app) as test_client:
        yield test_client
    app.state.engine.dispose()  # before the database is dropped


def json_of(client: TestClient, path: str, **params) -> dict:
    response = client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def wide_key(arrays) -> int:
    """The last key of the layer whose raw top tokens include an id past 65,535."""
    ids = arrays.values["raw", 1][0]  # [keys, n]
    return int(np.flatnonzero((ids > 0xFFFF).any(axis=1))[-1])


def test_a_late_key_shows_what_was_written(client, last_layer):
    key = wide_key(last_layer)
    assert key > SHAPE.n_keys - 100 and LAST * SHAPE.n_keys + key > 0xFFFF  # its memory index too
    page = json_of(client, f"{M}/layers/{LAST}/keys/{key}.json")
    for sign, shown in ((1, page["triggers"]), (-1, page["negative_triggers"])):
        coefficient, sentence, position = (a[key] for a in last_layer.triggers[sign])
        assert [t["sentence_index"] for t in shown] == sentence.tolist()
        assert [t["position"] for t in shown] == position.tolist()
        assert [t["coefficient"] for t in shown] == pytest.approx(coefficient.tolist(), rel=1e-6)
    for readout in ("raw", "norm"):
        log_z = float(last_layer.log_z[readout][key])
        for direction, part in ((1, "top"), (-1, "bottom")):
            ids, logits = (a[key] for a in last_layer.values[readout, direction])
            shown = page["value"][readout][part]
            assert [v["token_id"] for v in shown] == ids.tolist()
            assert [v["token"] for v in shown] == [token_text(t) for t in ids.tolist()]
            assert [v["logit"] for v in shown] == pytest.approx(logits.tolist(), rel=1e-6)
            assert [v["prob"] for v in shown] == pytest.approx(np.exp(logits - log_z).tolist(), rel=1e-5)
    assert max(v["token_id"] for v in page["value"]["raw"]["top"]) > 0xFFFF
    stats = last_layer.stats
    assert page["stats"]["max_coefficient"] == pytest.approx(float(stats["max_coefficient"][key]))
    assert page["stats"]["agreement"] == int(stats["agreement"][key])
    assert page["histogram"]["counts"] == stats["histogram"][key].tolist()
    html = client.get(f"{M}/layers/{LAST}/keys/{key}")
    assert (
        html.status_code == 200 and f"w{max(v['token_id'] for v in page['value']['raw']['top'])}" in html.text
    )


def test_its_samples_and_related_memories(client, last_layer):
    key = SHAPE.n_keys - 1
    mined = last_layer.mined
    kept = mined.sample_sentence[key] >= 0  # [bins, SAMPLES]
    bins = np.nonzero(kept)[0]
    written = sorted(
        zip(
            bins.tolist(),
            mined.sample_sentence[key][kept].tolist(),
            mined.sample_position[key][kept].tolist(),
            strict=True,
        )
    )
    samples = json_of(client, f"{M}/layers/{LAST}/keys/{key}/samples.json")["samples"]
    assert sorted((s["bin"], s["sentence_index"], s["position"]) for s in samples) == written
    related = json_of(client, f"{M}/layers/{LAST}/keys/{key}/related.json")
    for kind, shown in (
        ("key", related["neighbours"]["by_key"]),
        ("value", related["neighbours"]["by_value"]),
    ):
        indices, cosines = (a[key] for a in last_layer.neighbours[kind])
        assert [(n["layer"], n["key"]) for n in shown] == [divmod(int(i), SHAPE.n_keys) for i in indices]
        assert [n["cosine"] for n in shown] == pytest.approx(cosines.tolist(), abs=1e-6)
    layers, keys, _ = (a[key] for a in last_layer.links["in"])
    inbound = related["weight_graph"]["inbound"]
    assert [(link["layer"], link["key"]) for link in inbound] == list(
        zip(layers.tolist(), keys.tolist(), strict=True)
    )
    assert related["weight_graph"]["outbound"] == []  # the last layer: no later keys


def expected_order(stats: dict, sort: str, descending: bool, keys: np.ndarray | None = None) -> list[int]:
    """The layer table's order: NULLs last, then the column (a quadrant: then its share), then the key."""
    keys = np.arange(SHAPE.n_keys) if keys is None else keys
    quadrants = {"dominant_quadrant": stats["quadrant_shares"].argmax(axis=1)}  # [keys] each
    quadrants.update(zip(QUADRANT_COLUMNS, stats["quadrant_shares"].T, strict=True))
    column = quadrants[sort] if sort in quadrants else None if sort == "key" else stats[sort]
    value = keys.astype(float) if sort == "key" else np.asarray(column, float)[keys]
    missing = value < 0 if sort == "next_token_rank" else np.isnan(value)  # −1 is stored as NULL
    primary = np.where(missing, 0.0, -value if descending else value)
    # By the dominant quadrant, each quadrant's keys by its share, the largest first either way.
    shares = stats["quadrant_shares"][keys]  # [keys, 4]
    within = -shares.max(axis=1) if sort == "dominant_quadrant" else np.zeros(len(keys))
    return keys[np.lexsort((keys, within, primary, missing))].tolist()


@pytest.mark.parametrize("sort", KEY_SORTS)
def test_the_layer_page_sorts_every_column_past_its_first_pages(client, last_layer, sort):
    for order in ("desc", "asc"):
        page = json_of(client, f"{M}/layers/{LAST}.json", sort=sort, order=order, page=3, per_page=50)
        assert (page["total"], page["pages"]) == (SHAPE.n_keys, -(-SHAPE.n_keys // 50))
        expected = expected_order(last_layer.stats, sort, order == "desc")
        assert [row["key"] for row in page["keys"]] == expected[100:150], (sort, order)
    final = -(-SHAPE.n_keys // 50)  # a short last page (28,672 = 573 · 50 + 22)
    last = json_of(client, f"{M}/layers/{LAST}.json", sort=sort, order="desc", page=final)
    expected = expected_order(last_layer.stats, sort, True)[(final - 1) * 50 :]
    assert [row["key"] for row in last["keys"]] == expected and len(expected) == SHAPE.n_keys % 50
    # pages past the middle are read from the other end: a short last page and the one before it
    per_page = 37
    pages = -(-SHAPE.n_keys // per_page)
    for order in ("asc", "desc"):
        expected = expected_order(last_layer.stats, sort, order == "desc")
        for number in (pages - 1, pages):
            page = json_of(
                client, f"{M}/layers/{LAST}.json", sort=sort, order=order, page=number, per_page=per_page
            )
            start = (number - 1) * per_page
            assert [row["key"] for row in page["keys"]] == expected[start : start + per_page], (
                sort,
                order,
                number,
            )


def test_the_layer_page_filtered_by_a_token_near_the_vocabulary_end(client, last_layer):
    ids = last_layer.values["raw", 1][0]  # [keys, n]
    token = int(ids.max())
    assert token > SHAPE.vocab_size - 1000
    keys = np.flatnonzero((ids == token).any(axis=1))
    page = json_of(client, f"{M}/layers/{LAST}.json", token=f"w{token}", sort="max_prob", order="desc")
    assert page["token_ids"] == [token]
    assert page["total"] == len(keys)
    assert [row["key"] for row in page["keys"]] == expected_order(last_layer.stats, "max_prob", True, keys)[
        :50
    ]


@pytest.fixture(scope="module")
def far_tokens() -> dict[str, tuple[int, np.ndarray, np.ndarray]]:
    """Per readout, from its token → memories table as written: the last token with a memory past 65,536
    among its first 20 of a list, and its rows (memories, scores) [lists, depth]. Drawn once for both
    backends (the table is 150 MB a readout: its rows alone are kept)."""
    found = {}
    for readout in READOUTS:
        memories, scores = token_table(SHAPE, readout)  # [vocab, lists, depth] each
        far = (memories[:, :, :20] > 2**16).any(axis=(1, 2))  # [vocab]: a memory past 65,536 among the shown
        token = int(np.flatnonzero(far)[-1])  # near the vocabulary's end
        found[readout] = (token, memories[token].copy(), scores[token].copy())
    return found


@pytest.mark.parametrize(("readout", "by"), [("raw", "prob"), ("norm", "logit")])
def test_token_search_finds_a_token_near_the_end_of_the_vocabulary(client, far_tokens, readout, by):
    """Read from the written table: a token id past 65,535 with a memory past 65,535, each way's list in
    order, its scores the logits (or log-probabilities) written."""
    token, memories, scores = far_tokens[readout]  # [lists, depth] each
    assert token > SHAPE.vocab_size - 1000
    page = json_of(client, f"{M}/search.json", q=f"w{token}", readout=readout, by=by, limit=20)
    assert page["token_ids"] == [token] and page["token_coverage"] == "full"
    assert page["memories"] == SHAPE.memories
    assert page["depth"] == {"stored": SHAPE.token_memories, "source": "stored", "reason": None}
    for direction, part in ((1, "promote"), (-1, "suppress")):
        written = TOKEN_LISTS.index((by, direction))
        shown = page[part]
        assert {m["token_id"] for m in shown} == {token}
        assert [m["layer"] * SHAPE.n_keys + m["key"] for m in shown] == memories[written, :20].tolist()
        if by == "logit":
            assert [m["logit"] for m in shown] == pytest.approx(scores[written, :20].tolist(), rel=1e-6)
        else:
            assert [math.log(m["prob"]) for m in shown] == pytest.approx(scores[written, :20].tolist())
    assert client.get(f"{M}/search", params={"q": f"w{token}"}).status_code == 200


def test_the_model_page(client, last_layer):
    page = json_of(client, f"{M}.json")
    model = page["model"]
    assert (model["n_layers"], model["n_keys"], model["vocab_size"]) == (3, 28_672, 151_936)
    assert [row["keys"] for row in page["layers"]] == [SHAPE.n_keys] * SHAPE.n_layers
    assert page["layers"][LAST]["max_coefficient"] == pytest.approx(
        float(last_layer.stats["max_coefficient"].max())
    )
    assert page["run"]["n_tokens"] == int(last_layer.mined.positions)
    assert math.isclose(
        page["layers"][LAST]["density"], float(np.mean(last_layer.stats["density"])), rel_tol=1e-9
    )
    assert client.get(M).status_code == 200
