"""The key page's statistics panel (issue 30): its JSON twin carries exactly what a synthetic run wrote —
each readout's value histogram beside the page's coefficient histogram, density and value tokens — and its
page draws them (the first top and bottom tokens marked on the value's) with every token text escaped; a
memory without a stored value histogram (a run from before them) still renders, saying so. With "try your
own text" (the tiny index, its live worker) the panel's coefficient histogram marks the bin of the text's
max m: on the page, and to htmx out of band."""

from __future__ import annotations

import html
import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, update

from bench.synthetic_index import HISTOGRAM_BINS, Shape, layer_arrays, sentence_tokens, write_run
from ffmem.config import Settings
from ffmem.engine.mining.mined_layer import histogram_edges
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Token, ValueHistogram
from ffmem.web.charts import label
from ffmem.web.main import create_app
from ffmem.web.pages.key import MARKED_TOKENS, Histogram, bin_labels, histogram_bin
from ffmem.web.pages.key_charts import coefficient_histogram
from ffmem.web.worker_client import LiveWorker
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live

SHAPE = Shape(
    slug="stats",
    n_layers=2,
    n_keys=30,
    vocab_size=400,
    d_model=16,
    top_k=5,
    value_tokens=12,
    sentences=40,
    sentence_tokens=10,
    shaded_triggers=2,
    band_bins=2,
    token_memories=0,
)
LAYER, KEY, UNSTORED = 1, 7, 3  # UNSTORED: its value histogram row deleted, as in a run from before them
HOSTILE = '<img src=x onerror=alert(1)>&"'
M = f"/m/{SHAPE.slug}"
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


@pytest.fixture(scope="module")
def arrays():
    """What the synthetic run holds in LAYER."""
    return layer_arrays(SHAPE, LAYER, np.array([len(ids) for ids in sentence_tokens(SHAPE)]))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def client(request, tmp_path_factory, arrays):
    """The explorer over the synthetic run; KEY's top raw token renamed to HOSTILE, UNSTORED's value
    histograms deleted."""
    from conftest import migrated_url

    url = migrated_url(request, tmp_path_factory.mktemp("stats"))
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        run_id = write_run(session, SHAPE).run_id
        top = int(arrays.values["raw", 1][0][KEY, 0])
        session.execute(update(Token).where(Token.token_id == top).values(text=HOSTILE))
        session.execute(
            delete(ValueHistogram).where(
                ValueHistogram.run_id == run_id, ValueHistogram.layer == LAYER, ValueHistogram.key == UNSTORED
            )
        )
        session.commit()
    engine.dispose()
    app = create_app(Settings(database_url=url))
    with TestClient(app) as test_client:
        yield test_client
    app.state.engine.dispose()


def key_json(client: TestClient, key: int) -> dict:
    response = client.get(f"{M}/layers/{LAYER}/keys/{key}.json")
    assert response.status_code == 200, response.text
    return response.json()


def test_the_json_twin_carries_the_panel_as_written(client, arrays):
    """The value histograms as written; the panel's coefficient histogram, density and marked tokens are the
    page's own `histogram`, `stats.density` and `value` (not repeated)."""
    page = key_json(client, KEY)
    expected = {}
    for readout in ("raw", "norm"):
        low, high, counts = (a[KEY] for a in arrays.histograms[readout])
        low, high = float(low), float(high)
        expected[readout] = {
            "edges": [low + (high - low) * b / HISTOGRAM_BINS for b in range(HISTOGRAM_BINS + 1)],
            "counts": counts.tolist(),
        }
        assert sum(page["value_histograms"][readout]["counts"]) == SHAPE.vocab_size
    assert page["value_histograms"] == expected
    edges = histogram_edges()
    assert page["histogram"] == {
        "edges": edges,
        "labels": bin_labels(edges),
        "counts": arrays.stats["histogram"][KEY].tolist(),
    }
    assert page["stats"]["density"] == pytest.approx(float(arrays.stats["density"][KEY]))
    assert "statistics" not in page


def test_the_page_draws_the_panel_with_token_texts_escaped(client, arrays):
    response = client.get(f"{M}/layers/{LAYER}/keys/{KEY}")
    assert response.status_code == 200
    text = response.text
    for element in ("statistics", "activation-histogram", "histogram-chart", "activation-density"):
        assert f'id="{element}"' in text, element
    assert text.count('id="histogram-chart"') == 1  # the panel's, not also the value section's
    assert "activation density <" not in text and "value-histograms-missing" not in text
    density = f"{100 * float(arrays.stats['density'][KEY]):.2f}%"
    assert f'<strong class="num">{density}</strong>' in text
    assert "<img src=x" not in text  # the hostile token text: escaped everywhere
    figures = {}
    for readout in ("raw", "norm"):
        found = re.search(rf'id="value-histogram-{readout}" data-figure="([^"]*)"', text)
        assert found, readout
        figures[readout] = json.loads(html.unescape(found.group(1)))
    bars, marks, names = figures["raw"]["data"]
    low, high, counts = (a[KEY] for a in arrays.histograms["raw"])
    assert bars["y"] == counts.tolist() and figures["raw"]["layout"]["yaxis"]["type"] == "log"
    assert bars["x"][0] - bars["width"][0] / 2 == pytest.approx(float(low))
    ids, logits = (a[KEY, :MARKED_TOKENS] for a in arrays.values["raw", 1])
    assert marks["x"][-MARKED_TOKENS:] == pytest.approx(logits.tolist())  # the top tokens, on the logit axis
    assert marks["customdata"][MARKED_TOKENS] == f"{label(HOSTILE)} #{ids[0]}"
    assert names["text"][0] == label(HOSTILE) == '&lt;img␣src=x␣onerror=alert(1)&gt;&amp;"'  # as text
    # Issue 39 (2): the names of close logits ran into one blob. Three each way, the strongest first, each
    # rank a step higher, running inward from the chart's edges; charts.js hides one that still overlaps.
    bottom_logits = arrays.values["raw", -1][1][KEY, :3]
    assert names["mode"] == "text" and names["hoverinfo"] == "skip" and len(names["text"]) == 6
    assert names["x"] == pytest.approx(
        [v for pair in zip(logits[:3], bottom_logits, strict=True) for v in pair]
    )
    assert names["y"] == [0.8, 0.8, 2.4, 2.4, 7.2, 7.2]
    assert names["textposition"] == ["top left", "top right"] * 3
    assert figures["raw"]["layout"]["meta"] == {"declutter": True}


def test_the_octave_bins_name_a_few_edges_level_and_readable():
    """Issue 39 (3): all 43 bins' ranges were written at 60° in 9 px. Now the axis names the edges ±2^k every
    5 octaves and 0, level, in 11 px; a bar's hover gives its bin's range."""
    edges = histogram_edges()
    figure = coefficient_histogram(Histogram(edges=edges, labels=bin_labels(edges), counts=list(range(43))))
    axis, bars = figure["layout"]["xaxis"], figure["data"][0]
    assert axis["tickvals"] == [0.5, 5.5, 10.5, 15.5, 21, 26.5, 31.5, 36.5, 41.5]  # between bins; +0's centre
    assert axis["ticktext"] == [
        "−2<sup>10</sup>", "−2<sup>5</sup>", "−1", "−2<sup>−5</sup>", "0", "2<sup>−5</sup>", "1",
        "2<sup>5</sup>", "2<sup>10</sup>",
    ]  # fmt: skip
    assert (axis["tickangle"], axis["tickfont"], axis["range"]) == (0, {"size": 11}, [-0.5, 42.5])
    assert bars["x"] == list(range(43)) and bars["customdata"] == bin_labels(edges)
    assert bars["customdata"][31:33] == ["[2^-1, 2^0)", "[2^0, 2^1)"]  # the tick "1" at 31.5 parts them
    assert bars["hovertemplate"] == "m in %{customdata}: %{y} positions<extra></extra>"


def test_a_memory_without_a_stored_value_histogram_still_renders(client, arrays):
    page = key_json(client, UNSTORED)
    assert page["value_histograms"] is None
    assert page["histogram"]["counts"] == arrays.stats["histogram"][UNSTORED].tolist()
    response = client.get(f"{M}/layers/{LAYER}/keys/{UNSTORED}")
    assert response.status_code == 200
    assert 'id="value-histograms-missing"' in response.text and 'id="histogram-chart"' in response.text
    assert 'id="value-histogram-raw"' not in response.text


# ---- "try your own text" marks the panel's coefficient histogram (the tiny index, its live worker) --------


@pytest.fixture(scope="module")
def live_client(explorer_db, tiny, tiny_model_dir):
    live = Live(device="cpu", max_tokens=56, queue=4)
    live.models[str(tiny_model_dir)] = tiny
    worker = TestClient(create_live_app(live), base_url="http://worker")
    app = create_app(Settings(database_url=explorer_db, trace_rate_limit="0"))
    app.state.live = LiveWorker("http://worker", 30, client=worker)
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def _marked(fragment: str) -> dict:
    """The coefficient histogram's figure in an HTML fragment."""
    found = re.search(r'id="histogram-chart" data-figure="([^"]*)"', fragment)
    assert found
    return json.loads(html.unescape(found.group(1)))


def test_try_text_marks_where_its_max_falls(live_client, slug):
    url = f"/m/{slug}/layers/1/keys/4"
    text = "The capital of France is Paris."
    body = live_client.get(f"{url}.json", params={"text": text}).json()
    m = body["try_text"]["max"]["coefficient"]
    at = histogram_bin(body["histogram"]["edges"], m)
    page = live_client.get(url, params={"text": text})
    assert page.status_code == 200
    figure = _marked(page.text)
    assert [(s["x0"], s["x1"]) for s in figure["layout"]["shapes"]] == [(at, at)]
    assert figure["layout"]["annotations"][0]["text"] == f"your text: max m {m:.3g}"
    assert (
        figure["data"][0]["x"][at] == at
        and body["histogram"]["labels"][at] == figure["data"][0]["customdata"][at]
    )
    untried = _marked(live_client.get(url).text)
    assert "shapes" not in untried["layout"]  # no text: no marker
    headers = {"HX-Request": "true", "HX-Target": "try_text"}
    fragment = live_client.get(url, params={"text": text}, headers=headers).text
    assert fragment.lstrip().startswith(
        '<div id="try_text"'
    )  # the answer, then the panel's chart out of band
    assert '<div id="activation-histogram" hx-swap-oob="true">' in fragment
    assert _marked(fragment)["layout"]["shapes"] == figure["layout"]["shapes"]


@pytest.mark.parametrize(
    ("m", "expected"),
    [(0.0, 21), (1e-4, 22), (2.0**-9, 23), (1.5, 32), (2.0**10, 42), (1e6, 42), (-1e-4, 20), (-(2.0**-9), 19),
     (-1.5, 10), (-1e6, 0)],
)  # fmt: skip
def test_a_coefficient_falls_in_the_bin_mining_counts_it_in(m, expected):
    assert histogram_bin(histogram_edges(), m) == expected
