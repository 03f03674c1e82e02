"""Every page and its JSON twin on a tiny real index, on SQLite and Postgres: exact fields, numbers
equal to a direct computation from the stored rows, the one error shape, and escaping."""

from __future__ import annotations

import re
import statistics
from unittest.mock import ANY

import pytest
from explorer_index import HOSTILE, NO_WORKER
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from ffmem.config import Settings
from ffmem.store import memory_reads, vocabularies
from ffmem.store.cache import ProcessCache
from ffmem.store.models import KeyStats, Sentence, Token
from ffmem.web.display import coefficient_bar, tok, visible
from ffmem.web.main import create_app
from ffmem.web.worker_client import START

TRIGGER_FIELDS = {
    "shading",
    "rank",
    "coefficient",
    "prefix",
    "trigger_start",
    "trigger_token",
    "trigger_token_id",
    "next_token",
    "next_token_id",
    "sentence",
    "sentence_index",
    "position",
    "value_rank",
}
TOKEN_FIELDS = {"rank", "token", "token_id", "logit", "prob"}


def json_of(client, url: str, status: int = 200) -> dict:
    response = client.get(url)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def html_of(client, url: str, status: int = 200) -> str:
    response = client.get(url)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("text/html")
    return response.text


def alternate(page: str) -> str:
    found = re.search(r'<link rel="alternate" type="application/json" href="([^"]+)">', page)
    assert found, "the page links its JSON twin"
    return found.group(1).replace("&amp;", "&")


# ---- pages and their twins ----------------------------------------------------------------------


def test_home_lists_models_and_runs(client, slug, run):
    page = html_of(client, "/")
    assert alternate(page) == "/.json"
    assert f'href="/m/{slug}"' in page
    body = json_of(client, "/.json")
    assert body["page"] == "home" and len(body["models"]) == 1
    entry = body["models"][0]
    assert (
        entry["model"]["slug"] == slug and entry["model"]["n_layers"] == 3 and entry["model"]["n_keys"] == 48
    )
    assert set(entry["runs"][0]) == {
        "id",
        "status",
        "corpus",
        "n_sentences",
        "n_tokens",
        "top_k",
        "n_value_tokens",
        "dtype",
        "device",
        "package_version",
        "started_at",
        "finished_at",
        "provenance",
        "provenance_text",
        "error",
        "job",
        "mined",
    }
    made = run.provenance  # issue 39: the provenance in words, not its fields dumped
    assert entry["runs"][0]["provenance_text"] == (
        f"Model {made['model_source']} (LlamaForCausalLM, weights SHA-256 {made['weights_sha256'][:12]}…). "
        f"Corpus corpus.txt (16 sentences, SHA-256 {made['corpus_sha256'][:12]}…); every 10th sentence held "
        "out of mining (1 sentence), for the analyses and explanations. Mined in sentences cut at 128 "
        "tokens, batches of 128 tokens, shards of 8 sentences. Positions mined from 1: the tokenizer puts no "
        "BOS first; the first token (attention sink) is not mined. Triggers and every statistic (histogram, "
        f"mean, shares, tokens) cover these positions. Built by ffmem {run.package_version} with torch "
        f"{made['torch']}, transformers {made['transformers']}, Python {made['python']}."
    )
    home = html_of(client, "/")
    assert f'<p class="provenance">{entry["runs"][0]["provenance_text"]}</p>' in home.replace("&#39;", "'")
    assert "<dt>weights_sha256</dt>" not in home
    assert (entry["runs"][0]["job"], entry["runs"][0]["mined"]) == (None, None)  # built: no job builds it
    assert (entry["runs"][0]["id"], entry["runs"][0]["status"], entry["runs"][0]["top_k"]) == (
        run.id,
        "done",
        6,
    )
    assert entry["runs"][0]["n_sentences"] == 2 * (6 + len(HOSTILE)) - 1  # sentence 9 is held out


def test_model_page_aggregates_the_key_statistics(client, db, slug, run):
    page = html_of(client, f"/m/{slug}")
    assert alternate(page) == f"/m/{slug}.json"
    assert page.count('class="chart"') == 4
    body = json_of(client, f"/m/{slug}.json")
    assert [layer["layer"] for layer in body["layers"]] == [0, 1, 2]
    assert set(body["layers"][0]) == {
        "layer",
        "keys",
        "positive_share",
        "density",
        "max_coefficient",
        "max_prob",
        "mean_max_prob",
        "agreement_rate",
        "agreeing_keys",
        "value_norm",
    }
    for summary in body["layers"]:
        stats = db.scalars(
            select(KeyStats).where(KeyStats.run_id == run.id, KeyStats.layer == summary["layer"])
        ).all()
        assert summary["keys"] == len(stats) == 48
        assert summary["positive_share"] == pytest.approx(statistics.mean(s.positive_share for s in stats))
        assert summary["density"] == pytest.approx(statistics.mean(s.density for s in stats))
        assert summary["max_coefficient"] == pytest.approx(max(s.max_coefficient for s in stats))
        assert summary["max_prob"] == pytest.approx(max(s.max_prob for s in stats))
        ranked = [s.next_token_rank for s in stats if s.next_token_rank is not None]
        assert summary["agreement_rate"] == pytest.approx(sum(r == 0 for r in ranked) / len(ranked))
        assert summary["agreeing_keys"] == sum(s.agreement > 0 for s in stats)


def test_the_model_pages_prompt_box_must_be_filled(client, slug):
    """Issue 39: an empty prompt sent from the model page opened an empty live view; the box is required."""
    page = html_of(client, f"/m/{slug}")
    live = f'<form class="live" action="/m/{slug}/trace" method="get">'
    box = re.search(rf"{live}<input ([^>]*)>", page).group(1)
    assert 'name="text"' in box and box.split()[-1] == "required"


def test_layer_page_sorts_pages_and_filters(client, db, slug, run):
    page = html_of(client, f"/m/{slug}/layers/1")
    assert alternate(page) == f"/m/{slug}/layers/1.json"
    assert '<mark class="trigger"' in page
    body = json_of(client, f"/m/{slug}/layers/1.json?sort=max_coefficient&order=desc&per_page=10&page=2")
    stats = db.scalars(select(KeyStats).where(KeyStats.run_id == run.id, KeyStats.layer == 1)).all()
    expected = [s.key for s in sorted(stats, key=lambda s: (-s.max_coefficient, s.key))][10:20]
    assert [k["key"] for k in body["keys"]] == expected
    assert (body["total"], body["pages"], body["page_number"], body["per_page"]) == (48, 5, 2, 10)
    row = body["keys"][0]
    assert set(row) == {
        "key",
        "top_trigger",
        "value_top",
        "max_coefficient",
        "min_coefficient",
        "positive_share",
        "density",
        "agreement",
        "max_prob",
        "next_token_rank",
        "value_norm",
        "dominant_quadrant",
        "dominant_share",
        "label",
        "explanation_score",
        "explanation_control",
    }
    assert body["gated"] is True and row["dominant_quadrant"] in ("pp", "pn", "np", "nn")
    top = memory_reads.get_triggers(session=db, run_id=run.id, layer=1, key=row["key"], sign=1)[0]
    assert row["top_trigger"]["coefficient"] == pytest.approx(top.coefficient)
    assert row["top_trigger"]["sentence_index"] == top.sentence_index
    assert [t["rank"] for t in row["value_top"]] == [0, 1, 2, 3, 4]

    # Filter by a value token: exactly the keys whose value has it among its top tokens.
    token_id = row["value_top"][0]["token_id"]
    text = db.get(Token, (run.model_id, token_id)).text
    filtered = json_of(client, f"/m/{slug}/layers/1.json?per_page=500&token={text}")
    holders = {
        v.key
        for v in memory_reads.iter_value_tokens(session=db, run_id=run.id)
        if (v.layer, v.readout, v.direction) == (1, "raw", 1) and v.token_id in filtered["token_ids"]
    }
    assert token_id in filtered["token_ids"]
    assert [k["key"] for k in filtered["keys"]] == sorted(holders) and filtered["total"] == len(holders)


def test_a_token_filter_takes_the_form_the_pages_show(client, db, slug, run, tiny):
    """A byte that is no character shows as ⟨0xNN⟩: typed or pasted so, it finds its token."""
    pieces = tiny.tokenizer.convert_ids_to_tokens(list(range(len(tiny.tokenizer))))
    byte_ids = [
        i for i, piece in enumerate(pieces) if tiny.tokenizer.decode([i]) == "\ufffd" and len(piece) == 1
    ]
    assert byte_ids, "the tiny vocabulary has lone bytes"
    token_id = byte_ids[0]
    shown = (
        tok(vocabularies.vocabulary(session=db, model_id=run.model_id)[token_id]).split(">")[1].split("<")[0]
    )
    assert re.fullmatch(r"⟨0x[0-9A-F]{2}⟩", shown)
    filtered = json_of(client, f"/m/{slug}/layers/1.json?per_page=500&token={shown}")
    assert filtered["token_ids"] == [token_id]


def test_a_page_past_the_last_is_a_404_that_links_the_last(client, slug):
    twin = client.get(f"/m/{slug}/layers/1.json?per_page=10&page=99999&sort=density")
    assert twin.status_code == 404 and twin.json() == {
        "ok": False,
        "error": "There are 5 pages of 10 keys here (48 keys); page 99,999 is past the last.",
        "status": 404,
        "link": f"/m/{slug}/layers/1?sort=density&order=asc&per_page=10&page=5",
    }
    page = html_of(client, f"/m/{slug}/layers/1?per_page=10&page=6&sort=density", 404)
    last = f"/m/{slug}/layers/1?sort=density&amp;order=asc&amp;per_page=10&amp;page=5"
    assert f'<a id="next" href="{last}">See the last page, 5</a>' in page
    assert json_of(client, f"/m/{slug}/layers/1.json?per_page=10&page=5")["page_number"] == 5


def test_layer_table_fragment_for_htmx(client, slug):
    response = client.get(
        f"/m/{slug}/layers/0?sort=density&order=desc", headers={"HX-Request": "true", "HX-Target": "keys"}
    )
    assert response.status_code == 200
    assert response.text.lstrip().startswith('<section id="keys"') and "<html" not in response.text


def test_key_page_matches_the_stored_rows(client, db, slug, run, tiny):
    layer, key = 2, 7
    page = html_of(client, f"/m/{slug}/layers/{layer}/keys/{key}")
    assert alternate(page) == f"/m/{slug}/layers/{layer}/keys/{key}.json"
    assert 'id="next-key"' in page and 'id="previous-key"' in page and 'class="shaded"' in page
    body = json_of(client, f"/m/{slug}/layers/{layer}/keys/{key}.json")
    assert (body["model"], body["layer"], body["key"], body["run"]["id"]) == (slug, layer, key, run.id)
    assert {"triggers", "negative_triggers", "value", "agreement", "histogram", "stats", "links"} <= set(body)
    assert set(body["value"]) == {"raw", "norm"}
    for readout in ("raw", "norm"):
        for direction, side in ((1, "top"), (-1, "bottom")):
            listed = body["value"][readout][side]
            assert listed and set(listed[0]) == TOKEN_FIELDS
            stored = memory_reads.get_value_tokens(
                session=db, run_id=run.id, layer=layer, key=key, readout=readout, direction=direction
            )
            assert [(t["token_id"], t["logit"], t["prob"]) for t in listed] == [
                (v.token_id, pytest.approx(v.logit), pytest.approx(v.prob)) for v in stored
            ]
            for shown, v in zip([t["token"] for t in listed], stored, strict=True):
                decoded = tiny.tokenizer.decode([v.token_id])  # a lone byte decodes to "�": shown as ⟨0x..⟩
                assert shown == decoded or (
                    "\ufffd" in decoded and re.fullmatch(r"(⟨0x[0-9A-F]{2}⟩)+", shown)
                )
    top_ids = [t["token_id"] for t in body["value"]["raw"]["top"]]
    bottom_ids = [t["token_id"] for t in body["value"]["raw"]["bottom"]]
    for name, sign, value_ids in (("triggers", 1, top_ids), ("negative_triggers", -1, bottom_ids)):
        shown = body[name]
        stored = memory_reads.get_triggers(session=db, run_id=run.id, layer=layer, key=key, sign=sign)
        assert len(shown) == len(stored) == 6 and set(shown[0]) == TRIGGER_FIELDS
        for trigger, row in zip(shown, stored, strict=True):
            sentence = db.get(Sentence, (run.corpus_id, row.sentence_index))
            ids = sentence.token_ids
            assert (trigger["rank"], trigger["position"]) == (row.rank, row.position)
            assert trigger["coefficient"] == pytest.approx(row.coefficient)
            assert trigger["prefix"] == tiny.tokenizer.decode(ids[: row.position + 1])
            assert trigger["prefix"][trigger["trigger_start"] :] == trigger["trigger_token"]
            assert trigger["trigger_token"] == tiny.tokenizer.decode([ids[row.position]])
            following = ids[row.position + 1] if row.position + 1 < len(ids) else None
            assert trigger["next_token_id"] == following
            assert trigger["next_token"] == (
                None if following is None else tiny.tokenizer.decode([following])
            )
            assert trigger["value_rank"] == (value_ids.index(following) if following in value_ids else None)
            assert trigger["sentence"] == sentence.text
            shading = trigger["shading"]  # every token of the sentence, the trigger outlined
            assert "".join(t["text"] for t in shading["tokens"]) == sentence.text
            assert shading["peak"] == shading["prefix_end"] == row.position
            assert shading["tokens"][0]["coefficient"] is None  # position 0 is not mined
            at_trigger = shading["tokens"][row.position]["coefficient"]
            assert at_trigger == pytest.approx(row.coefficient, abs=half_step(shading) + NOISE)
            assert shading["scale"] == pytest.approx(
                max(abs(body["triggers"][0]["coefficient"]), abs(body["negative_triggers"][0]["coefficient"]))
            )
    endings = [
        db.get(Sentence, (run.corpus_id, row.sentence_index)).token_ids[: row.position + 1]
        for row in memory_reads.get_triggers(session=db, run_id=run.id, layer=layer, key=key, sign=1)
    ]
    last = [ids[-1] for ids in endings]
    commonest = max(last, key=last.count)
    hints = body["patterns"]
    assert hints["triggers"] == len(endings)
    assert hints["final_token_share"] == pytest.approx(last.count(commonest) / len(endings))
    assert last.count(hints["final_token"]["token_id"]) == last.count(commonest)
    found, found_count = None, 0  # the commonest final n-gram (n = 2–4) two or more share; longer on ties
    for n in (2, 3, 4):
        grams = [tuple(ids[-n:]) for ids in endings if len(ids) >= n]
        best = max(grams, key=grams.count) if grams else None
        if best is not None and grams.count(best) >= max(2, found_count):
            found, found_count = best, grams.count(best)
    assert hints["final_ngram"] == (None if found is None else [{"token_id": t, "token": ANY} for t in found])
    assert hints["final_ngram_share"] == pytest.approx(found_count / len(endings))
    assert 'id="pattern-hints"' in page
    agreement = body["agreement"]
    assert agreement["positive"] == sum(t["value_rank"] is not None for t in body["triggers"])
    assert agreement["positive"] == db.get(KeyStats, (run.id, layer, key)).agreement
    assert agreement["positive_of"] == sum(t["next_token_id"] is not None for t in body["triggers"])
    histogram = body["histogram"]
    assert (
        len(histogram["labels"]) == len(histogram["counts"]) == 43
        and sum(histogram["counts"]) == run.n_tokens
    )
    links = body["links"]
    assert links["previous"] == f"/m/{slug}/layers/2/keys/6" and links["next"] == f"/m/{slug}/layers/2/keys/8"
    assert links["permalink"] == f"/m/{slug}/layers/2/keys/7?run={run.id}"
    assert re.fullmatch(rf"/m/{slug}/layers/[0-2]/keys/\d+", links["random"])


def test_key_page_edges_and_trigger_limit(client, slug):
    first = json_of(client, f"/m/{slug}/layers/0/keys/0.json?triggers=2")
    assert first["links"]["previous"] is None and first["links"]["next"] == f"/m/{slug}/layers/0/keys/1"
    assert (
        len(first["triggers"]) == 2 and len(first["negative_triggers"]) == 2 and first["more_triggers"] == 4
    )
    last = json_of(client, f"/m/{slug}/layers/2/keys/47.json")
    assert last["links"]["next"] is None and last["links"]["previous"] == f"/m/{slug}/layers/2/keys/46"
    wrap = json_of(client, f"/m/{slug}/layers/1/keys/0.json")
    assert wrap["links"]["previous"] == f"/m/{slug}/layers/0/keys/47"
    fragment = client.get(
        f"/m/{slug}/layers/0/keys/0?triggers=6", headers={"HX-Request": "true", "HX-Target": "triggers"}
    )
    assert fragment.text.lstrip().startswith('<div id="triggers">') and fragment.text.count("<tr>") >= 12


def test_pinned_run(client, slug, run):
    assert json_of(client, f"/m/{slug}/layers/0/keys/3.json?run={run.id}")["run"]["id"] == run.id
    error = json_of(client, f"/m/{slug}/layers/0/keys/3.json?run={run.id + 99}", 404)
    assert error == {
        "ok": False,
        "status": 404,
        "error": f"Model '{slug}' has no run {run.id + 99}. Its runs: {run.id}.",
    }


NOISE = 1e-4  # the shading pass's float32 recomputation against the mining pass's, on the tiny model


def half_step(shading: dict) -> float:
    """Half the int8 step a sentence's shading is stored with (its largest |m| / 127, which it shows
    exactly): the most a shown value differs from the coefficient (ffmem.store.key_examples)."""
    return max(abs(t["coefficient"]) for t in shading["tokens"] if t["coefficient"] is not None) / 254


def spaced_token(db, run) -> tuple[int, str]:
    """A token with a leading space that some value promotes, and whose text without it is no token."""
    texts = dict(db.execute(select(Token.token_id, Token.text).where(Token.model_id == run.model_id)).all())
    promoted = [
        v.token_id for v in memory_reads.iter_value_tokens(session=db, run_id=run.id) if v.readout == "raw"
    ]
    known = set(texts.values())
    for token_id in promoted:
        text = texts[token_id]
        if text.startswith(" ") and text[1:].isalpha() and text[1:] not in known:
            return token_id, text
    raise AssertionError("the tiny index has no such token")


def test_search_by_token_ranks_both_signs(client, db, slug, run):
    token_id, text = spaced_token(db, run)
    word = text[1:]
    page = html_of(client, f"/m/{slug}/search?q=%20{word}")
    assert alternate(page) == f"/m/{slug}/search.json?q=%20{word}"
    for q in (f"%20{word}", word, f"%E2%90%A3{word}"):  # " word", "word" (also means " word"), "␣word"
        assert json_of(client, f"/m/{slug}/search.json?q={q}")["token_ids"] == [token_id]
    body = json_of(client, f"/m/{slug}/search.json?q=%20{word}&by=prob&limit=200")
    no_worker = f"No live worker answers at {NO_WORKER} (ConnectError). {START}"
    assert body["memories"] == 144
    assert body["depth"] == {"stored": 32, "source": "stored", "reason": no_worker}, "past 32: the worker's"
    for direction, name in ((1, "promote"), (-1, "suppress")):  # all memories ranked: see test_search.py
        shown = body[name]
        assert len(shown) == 32 and all(m["direction"] == direction and m["token"] == text for m in shown)
        probs = [m["prob"] for m in shown]
        assert probs == sorted(probs, reverse=direction == 1)
    by_logit = json_of(client, f"/m/{slug}/search.json?q=%20{word}&by=logit&readout=norm&limit=3")
    logits = [m["logit"] for m in by_logit["promote"]]
    assert logits == sorted(logits, reverse=True) and len(logits) <= 3


@pytest.mark.parametrize("q", ["L1 K5", "1/5", "l1k5", " 1 / 5 "])
def test_search_jumps_to_a_key(client, slug, q):
    response = client.get(f"/m/{slug}/search", params={"q": q}, follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == f"/m/{slug}/layers/1/keys/5"
    response = client.get(f"/m/{slug}/search.json", params={"q": q}, follow_redirects=False)
    assert response.headers["location"] == f"/m/{slug}/layers/1/keys/5.json"


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/m/nope", 404, "There is no model 'nope'. Known models: {slug}."),
        ("/m/{slug}/layers/3", 404, "{slug} has layers 0–2; there is no layer 3."),
        ("/m/{slug}/layers/-1/keys/0", 404, "{slug} has layers 0–2; there is no layer -1."),
        ("/m/{slug}/layers/0/keys/48", 404, "Layer 0 has keys 0–47; there is no key 48."),
        (
            "/m/{slug}/layers/x",
            400,
            "layer: Input should be a valid integer, unable to parse string as an integer",
        ),
        ("/m/{slug}/layers/0?sort=bogus", 400, None),
        ("/m/{slug}/layers/0?page=0", 400, "page: Input should be greater than or equal to 1"),
        ("/m/{slug}/layers/0?per_page=100000", 400, "per_page: Input should be less than or equal to 500"),
        ("/m/{slug}/layers/0/keys/0?triggers=0", 400, "triggers: Input should be greater than or equal to 1"),
        ("/m/{slug}/search?by=magic", 400, "by: Input should be 'prob' or 'logit'"),
        ("/m/{slug}/search?readout=x", 400, "readout: Input should be 'raw' or 'norm'"),
        ("/no/such/page", 404, "No page at this address."),
        ("/m/%00", 404, "There is no model '\\x00'. Known models: {slug}."),
        ("/m/{slug}?run=0", 400, "run: Input should be greater than or equal to 1"),
        ("/m/{slug}?run=99999999999", 400, "run: Input should be less than or equal to 2147483647"),
    ],
)
def test_one_error_shape(client, slug, path, status, message):
    path = path.format(slug=slug)
    twin = re.sub(r"^([^?]+?)(\?|$)", r"\1.json\2", path, count=1)
    body = json_of(client, twin, status)
    linked = {"link"} if "run=" in path else set()  # a bad ?run= links the page on the newest run
    assert set(body) == {"ok", "error", "status"} | linked
    assert body["ok"] is False and body["status"] == status
    if message is not None:
        assert body["error"] == message.format(slug=slug)
    page = html_of(client, path, status)
    assert f"<h1>{status} · " in page and "Traceback" not in page
    if message is not None:
        assert message.format(slug=slug).replace("'", "&#39;") in page


def test_a_malformed_run_is_said_once_with_a_link_to_the_newest_run(client, slug):
    """Issue 39: `?run=abc` says why once, and links the same page on a run that exists (the newest)."""
    message = "run: Input should be a valid integer, unable to parse string as an integer"
    twin = client.get(f"/m/{slug}/layers/1.json?run=abc&sort=density")
    assert twin.status_code == 400
    link = f"/m/{slug}/layers/1.json?sort=density"
    assert twin.json() == {"ok": False, "error": message, "status": 400, "link": link}
    page = html_of(client, f"/m/{slug}/layers/1?sort=density&run=abc", 400)
    assert page.count("Input should be a valid integer") == 1
    newest = f'<a id="next" href="/m/{slug}/layers/1?sort=density">See the same page on the newest run</a>'
    assert newest in page
    assert f'<a id="next" href="/m/{slug}">' in html_of(client, f"/m/{slug}?run=abc", 400)
    assert "link" not in json_of(client, f"/m/{slug}/layers/1.json?page=x", 400)  # only a bad run


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("POST", "/m/{slug}", "GET, HEAD"),
        ("DELETE", "/m/{slug}/analysis", "GET, HEAD, POST"),  # a page and its form: two routes, one path
        ("PUT", "/m/{slug}/analysis.json", "GET, HEAD, POST"),
        ("GET", "/m/{slug}/runs/1/delete", "POST"),
        ("POST", "/static/app.css", "GET, HEAD"),
    ],
)
def test_a_method_not_allowed_names_the_allowed_ones(client, slug, method, path, allow):
    """Issue 39: a 405 carries `Allow` (RFC 9110), every method the path answers, through our error page."""
    answer = client.request(method, path.format(slug=slug))
    assert answer.status_code == 405 and answer.headers["allow"] == allow
    assert "<h1>405 · Method not allowed</h1>" in answer.text or answer.json()["status"] == 405


@pytest.mark.parametrize("q", ["%00", "a%00b", "%25", "_", "%5C", "'", "%F0%9F%98%80"])
def test_odd_queries_are_answered(client, slug, q):
    assert json_of(client, f"/m/{slug}/search.json?q={q}")["page"] == "search"
    assert json_of(client, f"/m/{slug}/layers/0.json?token={q}")["page"] == "layer"


def test_no_models_yet(tmp_path):
    from ffmem.store.db import upgrade

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url))
    with TestClient(app) as client:
        assert json_of(client, "/.json")["models"] == []
        assert json_of(client, "/m/x.json", 404)["error"] == (
            "There is no model 'x'. Known models: none yet (build one with `ffmem index`)."
        )
    app.state.engine.dispose()


# ---- escaping and visible tokens ----------------------------------------------------------------


def test_corpus_markup_renders_as_text(client, db, slug, run):
    hostile = db.scalars(
        select(Sentence.index).where(Sentence.corpus_id == run.corpus_id, Sentence.text.in_(HOSTILE))
    )
    indices = set(hostile)
    triggers = [
        t
        for t in memory_reads.iter_triggers(session=db, run_id=run.id)
        if t.sentence_index in indices and t.position > 8
    ]
    assert triggers, "some key is triggered inside the markup"
    pages = {(t.layer, t.key) for t in triggers[:5]}
    for layer, key in pages:
        page = html_of(client, f"/m/{slug}/layers/{layer}/keys/{key}?triggers=6")
        _assert_inert(page)
    for q in ("script", "onerror", "<img"):
        _assert_inert(html_of(client, f"/m/{slug}/search?q={q}"))
    _assert_inert(html_of(client, f"/m/{slug}/search?q=%3Cscript%3Ealert(1)%3C/script%3E"))
    _assert_inert(html_of(client, f"/m/{slug}/layers/0?token=%3Cscript%3E"))
    _assert_inert(html_of(client, "/m/%3Cscript%3Ealert(1)%3C%2Fscript%3E", 404))


def _assert_inert(page: str) -> None:
    assert "<script>alert(1)</script>" not in page
    assert "<img src=x" not in page and "onerror=alert(1)>" not in page
    scripts = re.findall(r"<script[^>]*>", page)
    assert all(re.fullmatch(r'<script src="/static/[^"]+"( defer)?>', s) for s in scripts), scripts


def test_escaped_markup_is_shown(client, slug):
    page = html_of(client, f"/m/{slug}/search?q=onerror")
    assert "<img src=x" not in page
    shown = re.sub(r"</?mark>", "", page)  # the match is marked inside the escaped sentence
    escaped = ("&#34;&gt;&lt;img src=x onerror=alert(1)&gt;", "&quot;&gt;&lt;img src=x onerror")
    assert any(text in shown for text in escaped)
    assert "<mark>onerror</mark>" in page


@pytest.mark.parametrize(
    ("token", "shown"),
    [
        (" Paris", "␣Paris"),
        ("\n", "↵"),
        ("\n\n", "↵↵"),
        ("\t", "⇥"),
        ("", "∅"),
        (None, "—"),
        ("\u200b", "⟨U+200B⟩"),
        ("\x00", "⟨U+0000⟩"),
        ("\ufffd", "\ufffd"),
        ("é", "é"),
    ],
)
def test_tokens_render_visibly(token, shown):
    assert visible(token) == shown


def test_tokens_are_visible_in_pages(client, slug):
    body = json_of(client, f"/m/{slug}/layers/0/keys/0.json")
    page = html_of(client, f"/m/{slug}/layers/0/keys/0")
    for t in body["value"]["raw"]["top"]:
        assert f'title="token id {t["token_id"]}">{_escaped(visible(t["token"]))}</code>' in page


def test_token_and_coefficient_bar_html():
    """The templates' `tok` and `coefficient_bar` (Python, not macros): escaped, made visible, exact HTML."""
    escaped = "␣&lt;b&gt;&amp;&#34;x&#39;"
    assert str(tok(" <b>&\"x'", 7)) == f'<code class="tok" title="token id 7">{escaped}</code>'
    assert str(tok("\n")) == '<code class="tok">↵</code>' and str(tok(None)) == '<code class="tok">—</code>'
    assert str(coefficient_bar(-0.5, 2.0)) == (
        '<span class="bar neg"><span style="width: 25.0%"></span></span>\n<span class="num">-0.5</span>'
    )
    assert 'class="bar pos"><span style="width: 0.0%">' in coefficient_bar(1.23456, 0)  # no scale: no bar
    assert '<span class="num">1.235</span>' in coefficient_bar(1.23456, 0)


def _escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True).replace("&#x27;", "&#39;")


# ---- the rest -----------------------------------------------------------------------------------


def test_openapi_lists_every_page_and_twin(client):
    paths = set(client.get("/openapi.json").json()["paths"])
    pages = [
        "/",
        "/m/{model}",
        "/m/{model}/layers/{layer}",
        "/m/{model}/layers/{layer}/keys/{key}",
        "/m/{model}/search",
    ]
    twins = ["/.json"] + [f"{p}.json" for p in pages[1:]]
    assert set(pages + twins) <= paths


def test_vendored_assets_are_served_with_long_cache(client):
    response = client.get("/static/vendor/htmx-2.0.11.min.js")
    assert response.status_code == 200 and "immutable" in response.headers["cache-control"]
    assert client.get("/static/vendor/plotly-basic-3.7.0.min.js").status_code == 200
    assert client.get("/static/app.css").headers["cache-control"] == "no-cache"


def test_server_timing_header(client, slug):
    timing = client.get(f"/m/{slug}/layers/0/keys/0.json").headers["server-timing"]
    assert re.fullmatch(r"app;dur=\d+\.\d\d", timing)


def test_key_page_shows_examples_across_the_range(client, db, slug, run):
    """The band samples: exact fields, each in its band, strongest band first per sign, shaded, escaped."""
    from ffmem.store.key_examples import key_examples

    layer, key = 1, 3
    key_page = json_of(client, f"/m/{slug}/layers/{layer}/keys/{key}.json")
    assert "samples" not in key_page  # the key page loads them as a section, from their own page
    assert key_page["links"]["samples"] == f"/m/{slug}/layers/{layer}/keys/{key}/samples?run={run.id}"
    body = json_of(client, key_page["links"]["samples"].replace("/samples?", "/samples.json?"))
    assert {k: body[k] for k in ("page", "model", "layer", "key")} == {
        "page": "samples",
        "model": slug,
        "layer": layer,
        "key": key,
    }
    assert body["run"]["id"] == run.id and body["provisional"] is None
    stored = key_examples(session=db, run_id=run.id, layer=layer, key=key)
    samples = body["samples"]
    assert samples and len(samples) == len(stored.samples)
    assert set(samples[0]) == {
        "bin",
        "band",
        "sign",
        "coefficient",
        "sentence_index",
        "position",
        "sentence",
        "shading",
    }
    edges = run.histogram_edges
    for sample in samples:
        low, high = edges[sample["bin"] - 1], edges[min(sample["bin"], len(edges) - 1)]
        if sample["sign"] > 0 and 22 < sample["bin"] < 42:  # [low, high)
            assert low <= sample["coefficient"] < high
        if sample["sign"] < 0 and 0 < sample["bin"] < 20:  # (low, high]
            assert low < sample["coefficient"] <= high
        sentence = db.get(Sentence, (run.corpus_id, sample["sentence_index"]))
        assert sample["sentence"] == sentence.text
        tokens = sample["shading"]["tokens"]
        assert "".join(t["text"] for t in tokens) == sentence.text
        assert tokens[sample["position"]]["coefficient"] == pytest.approx(
            sample["coefficient"], abs=half_step(sample["shading"]) + NOISE
        )
    signs = [s["sign"] for s in samples]
    assert signs == sorted(signs, reverse=True)
    for sign in (1, -1):
        strengths = [abs(s["coefficient"]) for s in samples if s["sign"] == sign]
        assert strengths == sorted(strengths, reverse=True)
    page = html_of(client, f"/m/{slug}/layers/{layer}/keys/{key}")
    loads = f'hx-get="{key_page["links"]["samples"]}"'.replace("&", "&amp;")
    assert f'<section id="samples" class="samples" {loads}' in page and "Examples across the range" in page
    path = f"/m/{slug}/layers/{layer}/keys/{key}/samples"
    whole = html_of(client, path)
    section = client.get(path, headers={"HX-Request": "true", "HX-Target": "samples"})  # htmx's request
    assert section.status_code == 200 and "<html" not in section.text
    assert section.text.count('<section id="samples"') == 1 and "<title>" in whole
    for shown in (whole, section.text):
        assert shown.count('<span class="shaded">') == len(samples)
    for shown in (page, whole, section.text):
        assert "<script>alert(1)" not in shown and "<img src=x" not in shown


def vocabulary_reads(client, url: str) -> int:
    """How many statements one request of `url` runs on the vocabulary's table (`tokens`)."""
    seen: list[str] = []

    def note(conn, cursor, statement, *args) -> None:
        seen.append(statement)

    engine = client.app.state.engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        assert client.get(url).status_code == 200
    finally:
        event.remove(engine, "before_cursor_execute", note)
    return sum(bool(re.search(r"\bFROM tokens\b", statement)) for statement in seen)


def test_the_key_page_reads_the_vocabulary_once(client, slug, monkeypatch):
    """One read of the vocabulary a request, for the triggers, the value's tokens and the explanation's
    token table alike (key 0 of layer 0 has all three); none while the process keeps it."""
    url = f"/m/{slug}/layers/0/keys/0"
    assert json_of(client, url + ".json")["explanation"]["table"]["tokens"]  # a token table to name
    vocabularies._VOCABULARIES.clear()
    assert vocabulary_reads(client, url) == 1
    assert vocabulary_reads(client, url) == 0  # kept: the process read it once
    monkeypatch.setattr(vocabularies, "_VOCABULARIES", ProcessCache(0))  # kept nowhere: more models than kept
    assert vocabulary_reads(client, url) == 1
    assert vocabulary_reads(client, url + ".json") == 1
