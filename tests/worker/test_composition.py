"""A run's weight graph and explanations, computed when it is stored: on a tiny model with one key
planted to fire on the token "Paris", its description names the word and predicts the key on the
held-out sentences; the same run described twice gives the same rows; a local model behind an
OpenAI-compatible URL writes the description only when one is set."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
from sqlalchemy import delete, func, select
from transformers import AutoTokenizer, LlamaForCausalLM

from ffmem.config import Settings
from ffmem.engine.explanations.fitting import START, CorpusCounts, Pattern, fit_pattern
from ffmem.engine.explanations.protocol import POLARITIES, control_keys, random_records
from ffmem.engine.mining.mined_layer import QUADRANT_SIGNS, QUADRANTS
from ffmem.engine.model.loading import load_model
from ffmem.engine.relations.weight_graph import weight_graph
from ffmem.store import composition, corpora, memory_reads, vocabularies
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.key_examples import key_examples, layer_shading
from ffmem.store.models import (
    Analysis,
    Explanation,
    Job,
    JobKind,
    JobStatus,
    KeyStats,
    MemoryLinks,
    NeighbourBaseline,
    Neighbours,
    Run,
)
from ffmem.store.specs import CompositionSpec, fingerprint
from ffmem.web.pages.jobs import explainer_report
from ffmem.worker.composition import compose, explanations_step, weight_graph_step
from ffmem.worker.explainer import GIVE_UP
from ffmem.worker.explanations import ExplanationOptions, _RunInputs
from ffmem.worker.fitting_positions import by_key, key_positions, layer_positions
from ffmem.worker.held_out import held_out
from ffmem.worker.index import IndexOptions
from ffmem.worker.leases import LostLease
from ffmem.worker.loop import Worker, build_index
from ffmem.worker.neighbours import neighbours_step

PLANTED = 7  # the key of layer 0 that fires on "Paris"
PARIS = [
    "The capital of France is Paris.",
    "We flew to Paris in May.",
    "She loves Paris and Rome.",
    "Many artists lived in Paris long ago.",
    "The river runs through Paris slowly.",
    "In spring Paris is full of visitors.",
    "They opened a museum in Paris last year.",
    "A train leaves for Paris every hour.",
]
OTHER = [
    "Water boils at one hundred degrees Celsius at sea level.",
    "The quick brown fox jumps over the lazy dog.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "Mozart wrote more than six hundred works of music.",
    "The lazy dog sleeps in the sun.",
    "Music fills the hall at night.",
    "The fox ran over the hill.",
    "Astronauts trained for many years.",
    "Boiling water makes good tea.",
    "The dog and the fox are friends.",
]
MINED = 18  # the first 18 sentences are mined, the rest held out


@pytest.fixture(scope="module")
def planted_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama with key PLANTED of layer 0 reading the embedding of "Paris" through its gate and
    up rows (layer 0's attention silenced, its FF norm unit): it fires on that token and hardly elsewhere."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (word,) = tokenizer("Paris", add_special_tokens=False).input_ids
    with torch.no_grad():
        block = model.model.layers[0]
        block.self_attn.o_proj.weight.zero_()
        block.post_attention_layernorm.weight.fill_(1.0)
        embedding = model.model.embed_tokens.weight[word]
        block.mlp.gate_proj.weight[PLANTED] = 2 * embedding / embedding.norm()
        block.mlp.up_proj.weight[PLANTED] = 2 * embedding / embedding.norm()
    folder = tmp_path_factory.mktemp("planted")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def planted(planted_dir):
    return load_model(str(planted_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, planted, planted_dir):
    """(sessions, run id) of an index of the planted model over 18 sentences of a 36-sentence corpus."""
    folder = tmp_path_factory.mktemp("planted-run")
    corpus = folder / "corpus.txt"
    mined = PARIS[:6] + OTHER + PARIS[6:7] + OTHER[:1]
    held_out = PARIS + OTHER
    assert len(mined) == MINED
    corpus.write_text("\n".join(mined + held_out) + "\n")
    url = f"sqlite:///{folder / 'ffmem.db'}"
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    options = IndexOptions.from_settings(
        Settings(
            model=str(planted_dir),
            corpus=str(corpus),
            sentences=MINED,
            held_out_every=0,  # the held-out sentences are those after the mined ones
            explain_quadrants=True,
            top_k=6,
            device="cpu",
            dtype="float32",
            batch_tokens=128,
            shard_sentences=8,
            value_tokens=5,
            cache_dir=folder / "cache",
        ),
        progress=False,
    )
    summary = build_index(options, sessions, loaded=planted)
    return sessions, summary.run_id


def _paris(planted) -> int:
    (word,) = planted.tokenizer("Paris", add_special_tokens=False).input_ids
    return word


def _rows(sessions, run_id):
    with sessions() as session:
        query = (
            select(Explanation)
            .where(Explanation.run_id == run_id)
            .order_by(Explanation.layer, Explanation.key)
        )
        return [
            (e.layer, e.key, e.source, e.text, e.score, composition.explanation_pattern(e), e.details)
            for e in session.scalars(query)
        ]


def test_the_description_names_the_planted_word_and_predicts_the_key(planted_run, planted):
    sessions, run_id = planted_run
    with sessions() as session:
        found = composition.get_explanation(session=session, run_id=run_id, layer=0, key=PLANTED)
        assert found.source == "heuristic"
        assert found.text.startswith("Fires on “Paris”"), found.text
        sides = found.details["polarities"]
        assert [(side["sign"], side["source"]) for side in sides] == [(1, "heuristic"), (-1, "heuristic")]
        assert found.details["sign"] == 1 and "text" not in sides[0]  # the row's text: stored once
        assert sides[1]["text"].startswith("Goes negative on") or sides[1]["text"].startswith("No token")
        assert sides[0]["scores"]["pooled"] == found.score
        pattern = composition.explanation_pattern(found)
        assert pattern["final"][0] == _paris(planted) and pattern["sign"] == 1  # the most important first
        largest = max([*pattern["final"], *(i for pair in pattern["pairs"] for i in pair)]) + 1
        width = 1 + (largest >= 2**8) + (largest >= 2**16) + (largest >= 2**24)  # bytes an id (−1 kept free)
        assert found.pattern is None and len(found.token_table) == 5 + (width + 2) * len(pattern["final"]) + (
            2 * width + 2
        ) * len(
            pattern["pairs"]
        )  # packed: 5 B of header, a token its id and a float16, a pair two ids and one
        # the held-out sentences (18 of them, 8 with "Paris") were never mined
        assert found.details["positions"] > 100 and found.details["matches"] >= len(PARIS)
        assert found.score > 0.9 and found.details["auroc"] > 0.95
        hits = composition.search_explanations(session=session, run_id=run_id, text="paris", limit=5)
        assert (hits[0].layer, hits[0].key) == (0, PLANTED)
        assert composition.explanation_summary(session=session, run_id=run_id)["explained"] == 3 * 48
        stored = {a.name: a for a in session.scalars(select(Analysis).where(Analysis.run_id == run_id))}
        data = stored["explanations"].data
        assert data["held_out_sentences"] == len(PARIS + OTHER)
        # 18 held out, 20 random records asked for: every one is random, none is left to be a top record
        assert (data["top_records"], data["random_records"]) == (20, len(PARIS + OTHER))
        assert [row["layer"] for row in data["layers"]] == [0, 1, 2]
        assert set(data["medians"]) == {
            "pooled",
            "pooled_control",
            "random",
            "random_control",
            "auroc",
            "auroc_control",
        }
        assert stored["explanations"].options["explainer_url"] is False
        assert stored["weight_graph"].data["rows"] == {"in": 2 * 48, "out": 2 * 48}


def test_the_stored_scores_equal_a_recomputation_from_the_stored_table(planted_run, planted):
    """The planted key's stored scores, recomputed here: its stored token table's match at every mined
    position of the held-out records (18, fewer than the 20 random records asked for: all random, no top
    record) against its coefficient there, read with a forward hook — pooled and random-only Pearson and
    the AUROC of the positions where it fires (past half its largest mined coefficient)."""
    sessions, run_id = planted_run
    with sessions() as session:
        found = composition.get_explanation(session=session, run_id=run_id, layer=0, key=PLANTED)
        table = composition.explanation_pattern(found)
        run = session.get(Run, run_id)
        held = held_out(session, run, 1000, planted)
        largest = session.get(KeyStats, (run_id, 0, PLANTED)).max_coefficient
    weights = dict(zip(table["final"], table["weights"], strict=True))
    pairs = {tuple(pair): w for pair, w in zip(table["pairs"], table["pair_weights"], strict=True)}
    match, m = [], []
    for sentence in held:
        ids, first = sentence.token_ids, max(sentence.first_position, 1)
        m += _coefficients(planted, ids)[first:, PLANTED].tolist()
        match += [pairs.get((ids[i - 1], ids[i]), weights.get(ids[i], 0.0)) for i in range(first, len(ids))]
    match, m = np.array(match), np.array(m)
    scores = found.details["polarities"][0]["scores"]
    expected = np.corrcoef(match, m)[0, 1]
    assert scores["random_positions"] == len(m) and scores["top_positions"] == 0
    assert scores["pooled"] == pytest.approx(expected, abs=2e-3) and scores["random"] == scores["pooled"]
    fires = m >= largest / 2
    wins = (match[fires][:, None] > match[~fires][None]) + 0.5 * (
        match[fires][:, None] == match[~fires][None]
    )
    assert scores["auroc"] == pytest.approx(wins.mean(), abs=2e-3)
    assert scores["pooled_control"] is not None and scores["pooled_control"] < scores["pooled"] - 0.5


def test_the_quadrant_scores_equal_a_recomputation_from_the_stored_records(planted_run, planted):
    """Each stored quadrant of some gated memories, recomputed here from the stored records: its pattern
    fitted on the quadrant's stored examples and the band samples' shaded sentences (and its control's:
    the same of the control key), then matched at every mined held-out position whose quadrant — the signs
    of m and x·u, both read with forward hooks — is that one, against sign · m there: pooled (= random-only
    here: the 18 records are all random) Pearson and AUROC, each with its control."""
    sessions, run_id = planted_run
    with sessions() as session:
        run = session.get(Run, run_id)
        held = held_out(session, run, 1000, planted)
        corpus = corpora.load_sentence_tokens(session=session, corpus_id=run.corpus_id)
        counts = CorpusCounts.of(corpus, len(planted.tokenizer))
        control = control_keys(run.model.n_keys)

        def pattern(layer: int, key: int, quadrant: int) -> Pattern:
            stored = key_examples(session=session, run_id=run_id, layer=layer, key=key)
            chosen = [
                (e.sentence_index, e.position, e.coefficient)
                for e in stored.quadrants
                if e.quadrant == quadrant
            ]
            if not chosen:
                return Pattern(sign=QUADRANT_SIGNS[quadrant])
            samples = [s.sentence_index for s in stored.samples]
            arrays = stored.sample_shading([len(corpus[s]) for s in samples])
            shading = dict(zip(samples, arrays, strict=True))  # each sentence once
            samples = list(dict.fromkeys(samples))
            chosen += [(s, p, v) for s in samples for p, v in enumerate(shading[s]) if not np.isnan(v)]
            tokens = [corpus[s][p] for s, p, _ in chosen]
            previous = [corpus[s][p - 1] if p else START for s, p, _ in chosen]
            m = [v for _, _, v in chosen]
            return fit_pattern(
                np.array(tokens), np.array(previous), np.array(m), QUADRANT_SIGNS[quadrant], counts
            )

        checked, (reads, ids) = 0, _layer_reads(planted, held)
        for layer, key in ((0, PLANTED), (1, 0), (2, 5)):
            found = composition.get_explanation(session=session, run_id=run_id, layer=layer, key=key)
            stats = session.get(KeyStats, (run_id, layer, key))
            m, u = reads[layer]
            for stored in found.details["quadrants"]:
                number = QUADRANTS.index(stored["quadrant"])
                sign = QUADRANT_SIGNS[number]
                assert stored["sign"] == sign
                gate_negative = ((m < 0) & (u > 0)) | ((m > 0) & (u < 0))
                inside = (2 * gate_negative + (u < 0) == number)[:, key]  # [positions]
                y = sign * m[inside, key]
                fires = y >= (stats.max_coefficient if sign > 0 else -stats.min_coefficient) / 2
                expected = []
                for of in (key, int(control[key])):
                    table = pattern(layer, of, number)
                    weights = dict(zip(table.final, table.weights, strict=True))
                    pairs = {tuple(p): w for p, w in zip(table.pairs, table.pair_weights, strict=True)}
                    x = np.array([pairs.get((b, t), weights.get(t, 0.0)) for b, t in ids[inside]])
                    r = np.corrcoef(x, y)[0, 1] if len(y) > 1 and x.std() > 1e-9 and y.std() > 1e-9 else None
                    wins = (x[fires][:, None] > x[~fires][None]) + 0.5 * (
                        x[fires][:, None] == x[~fires][None]
                    )
                    expected.append((r, wins.mean() if wins.size else None))
                scores = stored["scores"]
                assert scores["random_positions"] == len(y) and scores["top_positions"] == 0
                assert (
                    scores["random"] == scores["pooled"]
                    and scores["random_control"] == scores["pooled_control"]
                )
                got = [
                    (scores["pooled"], scores["auroc"]),
                    (scores["pooled_control"], scores["auroc_control"]),
                ]
                for have, want in zip(got, expected, strict=True):
                    for a, b in zip(have, want, strict=True):
                        assert (a is None) == (b is None), (layer, key, stored["quadrant"])
                        assert a is None or a == pytest.approx(b, abs=2e-3), (layer, key, stored["quadrant"])
                checked += 1
        assert checked >= 6
        planted_quadrants = composition.get_explanation(session=session, run_id=run_id, layer=0, key=PLANTED)
        pp = planted_quadrants.details["quadrants"][0]
        assert (
            pp["quadrant"] == "pp"
            and pp["text"].startswith("Fires on “Paris”")
            and pp["scores"]["pooled"] > 0.9
        )
        medians = session.get(Analysis, (run_id, "explanations")).data["quadrant_medians"]
        assert set(medians) == set(QUADRANTS) and len(medians["pp"]["pooled"]["thirds"]) == 3


def _layer_reads(planted, held: list) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Each layer's coefficients m (the input of its down projection) and inputs x·u (the output of its up
    projection) at every mined position of the held-out sentences ([positions, keys] each), read with
    forward hooks in one pass, and each position's (previous token, token) ([positions, 2])."""
    m, u, ids, first = {}, {}, [], [1]
    hooks = []
    for layer, block in enumerate(planted.model.model.layers):
        mlp = block.mlp
        hooks += [
            mlp.down_proj.register_forward_hook(
                lambda module, args, out, layer=layer: m.setdefault(layer, []).append(args[0][0, first[0] :])
            ),
            mlp.up_proj.register_forward_hook(
                lambda module, args, out, layer=layer: u.setdefault(layer, []).append(out[0, first[0] :])
            ),
        ]
    try:
        for sentence in held:
            tokens, first[0] = sentence.token_ids, max(sentence.first_position, 1)
            with torch.no_grad():
                planted.model.model(input_ids=torch.tensor([tokens]))
            ids += [(tokens[i - 1], tokens[i]) for i in range(first[0], len(tokens))]
    finally:
        for hook in hooks:
            hook.remove()
    reads = {
        layer: (torch.cat(m[layer]).double().numpy(), torch.cat(u[layer]).double().numpy()) for layer in m
    }
    return reads, np.array(ids)


def test_explanations_are_deterministic(planted_run, planted):
    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    compose(sessions, run_id, planted, ExplanationOptions(quadrants=True, batch_tokens=64))
    assert _rows(sessions, run_id) == before


def test_the_stored_weight_graph_is_the_engines(planted_run, planted):
    sessions, run_id = planted_run
    graph = weight_graph(planted)
    with sessions() as session:
        assert composition.get_links(session=session, run_id=run_id, layer=0, key=3)["in"] == []
        for layer, key in ((1, 0), (2, 47), (0, PLANTED)):
            links = composition.get_links(session=session, run_id=run_id, layer=layer, key=key)
            for direction, (layers, keys, scores) in (
                ("in", (graph.inbound_layer, graph.inbound_key, graph.inbound_score)),
                ("out", (graph.outbound_layer, graph.outbound_key, graph.outbound_score)),
            ):
                expected = [
                    (int(a), int(b), float(s))
                    for a, b, s in zip(layers[layer, key], keys[layer, key], scores[layer, key], strict=True)
                    if a >= 0
                ]
                got = [(link.layer, link.key, link.score) for link in links[direction]]
                assert [g[:2] for g in got] == [e[:2] for e in expected]
                assert all(
                    abs(g[2] - e[2]) <= 1e-4 * max(1.0, abs(e[2])) for g, e in zip(got, expected, strict=True)
                )
        rows = session.scalars(select(MemoryLinks).where(MemoryLinks.run_id == run_id)).all()
        assert len(rows) == 3 * 48  # a row a memory; layer 0 has no inbound links, layer 2 no outbound ones
        assert sum(r.inbound is None for r in rows) == 48 and sum(r.outbound is None for r in rows) == 48


def _answer(content: str) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": content}}]})


def test_a_local_model_writes_the_description_when_one_is_set(planted_run, planted):
    """Each side of each memory is asked for in turn (layer 0's keys first); the planted key's positive
    side gets the model's description, every failed side keeps the heuristic one, and after GIVE_UP
    failures in a row the explainer stops asking (a server that looks down) and says so."""
    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    asked = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        prompt = body["messages"][0]["content"]
        if "⟦Paris⟧" in prompt and "positive (m > 0)" in prompt:
            return _answer(
                'Sure: {"description": "the city of Paris", "ends_with": ["Paris"], "context": []}'
            )
        return httpx.Response(500, text="overloaded")

    client = httpx.Client(transport=httpx.MockTransport(server), base_url="http://explainer.test/v1")
    options = ExplanationOptions(
        quadrants=True,
        explainer_url="http://explainer.test/v1",
        explainer_model="tiny-explainer",
        simulated_records=0,
    )
    try:
        compose(sessions, run_id, planted, options, client=client)
        with sessions() as session:
            found = composition.get_explanation(session=session, run_id=run_id, layer=0, key=PLANTED)
            assert (found.source, found.text) == ("llm:tiny-explainer", "the city of Paris")
            assert composition.explanation_pattern(found)["final"] == [_paris(planted)] and found.score > 0.9
            negative = found.details["polarities"][1]
            assert negative["sign"] == -1 and negative["source"] == "heuristic"
            other = composition.get_explanation(session=session, run_id=run_id, layer=1, key=0)
            assert other.source == "heuristic"  # never asked: the explainer gave up before
            data = session.get(Analysis, (run_id, "explanations")).data
            # keys 0–6 (two sides each) fail, key 7's positive side is written, then 20 failures in a row
            assert len(asked) == 2 * PLANTED + 1 + GIVE_UP
            assert data["explainer_sides"] == 2 * 3 * 48 and data["explainer_failures"] == 2 * 3 * 48 - 1
            assert data["explainer_gave_up"] is True
        assert {a["model"] for a in asked} == {"tiny-explainer"} and asked[0]["temperature"] == 0
        first = asked[0]["messages"][0]["content"]  # layer 0 key 0's positive side: reads and writes
        assert "positive (m > 0)" in first and "its value promotes" in first and "suppresses" in first
        assert "negative (m < 0)" in asked[1]["messages"][0]["content"]
    finally:
        compose(sessions, run_id, planted, ExplanationOptions(quadrants=True))
    assert _rows(sessions, run_id) == before


class _FakeOpenAI(BaseHTTPRequestHandler):
    """An OpenAI-compatible server (POST /v1/chat/completions) over real HTTP: it describes the planted
    key's positive side, simulates a description by giving 10 to every "Paris" token and 0 elsewhere, and
    gives every other side no description (or, `slow`, answers after longer than the client waits)."""

    asked: list = []
    slow = 0.0

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        type(self).asked.append(prompt)
        if self.slow:
            time.sleep(self.slow)
        if prompt.startswith("A memory of a language model is described as"):
            lines = [line.split(". ", 1)[1] for line in prompt.splitlines() if re.match(r"\d+\. ", line)]
            activations = [[10 if t == "Paris" else 0 for t in line.split("⟨|⟩")] for line in lines]
            content = json.dumps({"activations": activations})
        elif "⟦Paris⟧" in prompt and "positive (m > 0)" in prompt:
            content = json.dumps({"description": "the city of Paris", "ends_with": ["Paris"]})
        else:  # an answer with no description: that side keeps its heuristic one
            content = json.dumps({"description": "", "ends_with": []})
        answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_openai():
    _FakeOpenAI.asked, _FakeOpenAI.slow = [], 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _coefficients(planted, token_ids: list[int]) -> np.ndarray:
    """Layer 0's coefficients (the input of its down projection) at every position of a sentence, read
    with a forward hook: [positions, keys]."""
    found = []
    mlp = planted.model.model.layers[0].mlp
    hook = mlp.down_proj.register_forward_hook(lambda module, args, out: found.append(args[0][0].double()))
    try:
        with torch.no_grad():
            planted.model(input_ids=torch.tensor([token_ids]))
    finally:
        hook.remove()
    return found[0].numpy()


def test_a_local_server_simulates_what_it_described(planted_run, planted, fake_openai):
    """OpenAI's simulation score: the server simulates the side it described on the side's top records and
    the random ones; the stored score is the Pearson correlation, recomputed here from the records it was
    shown and the key's coefficients there (a forward hook), of its simulation with m."""
    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    options = ExplanationOptions(
        quadrants=True,
        explainer_url=fake_openai,
        top_records=4,
        random_records=6,
        simulated_records=2,
        explainer_timeout=30,
    )
    try:
        compose(sessions, run_id, planted, options)
        with sessions() as session:
            found = composition.get_explanation(session=session, run_id=run_id, layer=0, key=PLANTED)
            positive = found.details["polarities"][0]
            data = session.get(Analysis, (run_id, "explanations")).data
            run = session.get(Run, run_id)
            held = held_out(session, run, options.explain_sentences, planted)
            vocabulary = vocabularies.stored_texts(session=session, model_id=run.model_id)
            query = select(Explanation).where(Explanation.run_id == run_id)
            described = [  # the sides the server wrote, in the order it was asked to simulate them
                (e.layer, e.key, side)
                for e in session.scalars(query.order_by(Explanation.layer, Explanation.key))
                for side, written in enumerate(e.details["polarities"])
                if written["source"] != "heuristic"
            ]
        shown = [p for p in _FakeOpenAI.asked if p.startswith("A memory of a language model")]
        assert len(shown) == len(described) == data["simulated_sides"] and data["simulation_failures"] == 0
        prompt = shown[described.index((0, PLANTED, 0))]
        assert "the city of Paris" in prompt
        lines = [line.split(". ", 1)[1] for line in prompt.splitlines() if re.match(r"\d+\. ", line)]
        records = [
            next(i for i, s in enumerate(held) if [vocabulary[t] for t in s.token_ids] == line.split("⟨|⟩"))
            for line in lines
        ]
        # its 2 top records (where m peaks highest among the records that are not random), then 2 random
        random = random_records(len(held), 6).tolist()
        assert len(records) == 4 and records[2:] == random[:2]
        m = {
            i: _coefficients(planted, s.token_ids)[max(s.first_position, 1) :, PLANTED]
            for i, s in enumerate(held)
        }
        others = [m[i].max() for i in m if i not in random and i not in records[:2]]
        assert all(m[i].max() >= max(others) - 1e-5 for i in records[:2])
        simulated, real = [], []
        for i, line in zip(records, lines, strict=True):
            tokens = line.split("⟨|⟩")
            simulated += [10.0 if t == "Paris" else 0.0 for t in tokens[max(held[i].first_position, 1) :]]
            real += m[i].tolist()
        expected = np.corrcoef(simulated, real)[0, 1]
        assert positive["scores"]["simulation"] == pytest.approx(expected, abs=1e-4) and expected > 0.9
        assert "simulation" not in found.details["polarities"][1]["scores"]  # not described: not simulated
    finally:
        compose(sessions, run_id, planted, ExplanationOptions(quadrants=True))
    assert _rows(sessions, run_id) == before


def test_a_slow_server_leaves_the_token_tables_and_the_job_page_says_so(planted_run, planted, fake_openai):
    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    _FakeOpenAI.slow = 0.5  # longer than the client waits
    options = ExplanationOptions(
        quadrants=True, explainer_url=fake_openai, explainer_timeout=0.1, simulated_records=2
    )
    try:
        compose(sessions, run_id, planted, options)
        assert [row[2:4] for row in _rows(sessions, run_id)] == [row[2:4] for row in before]  # all heuristic
        assert len(_FakeOpenAI.asked) == GIVE_UP  # then it stopped asking
        with sessions() as session:
            data = session.get(Analysis, (run_id, "explanations")).data
            assert (data["explainer_failures"], data["explainer_gave_up"]) == (2 * 3 * 48, True)
            job = Job(
                kind=JobKind.composition, status=JobStatus.done, run_id=run_id, options={}, fingerprint="x"
            )
            report = explainer_report(session, job)
        assert (report.sides, report.failures, report.gave_up) == (2 * 3 * 48, 2 * 3 * 48, True)
    finally:
        _FakeOpenAI.slow = 0.0
        compose(sessions, run_id, planted, ExplanationOptions(quadrants=True))
    assert _rows(sessions, run_id) == before


def test_nothing_is_sent_without_a_url(planted_run, planted, monkeypatch):
    sessions, run_id = planted_run

    def refuse(*args, **kwargs):
        raise AssertionError("an HTTP request was made without explainer_url")

    monkeypatch.setattr(httpx.Client, "send", refuse)
    compose(sessions, run_id, planted, ExplanationOptions(quadrants=True))
    assert {row[2] for row in _rows(sessions, run_id)} == {"heuristic"}


def test_ffmem_compose_fills_in_a_run(planted_run):
    from typer.testing import CliRunner

    from ffmem.cli import cli

    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    with sessions() as session:
        composition.delete_links(session=session, run_id=run_id)
        composition.delete_explanations(session=session, run_id=run_id)
        session.commit()
    url = sessions.kw["bind"].url.render_as_string(hide_password=False)
    command = ["compose", "--run", str(run_id), "--db", url, "--device", "cpu"]
    result = CliRunner().invoke(cli, command, env={"FFMEM_EXPLAIN_QUADRANTS": "true"})  # as the run was
    assert result.exit_code == 0, result.output
    assert f"stored the weight graph and explanations of run {run_id}" in result.output
    assert _rows(sessions, run_id) == before
    with sessions() as session:
        assert composition.has_links(session=session, run_id=run_id)
    missing = CliRunner().invoke(cli, ["compose", "--run", "999", "--db", url])
    assert missing.exit_code == 2 and "no finished index run 999" in missing.output


def test_the_index_job_explains_as_its_spec_says(tmp_path, planted, planted_dir):
    """The explanations read their options from the job's RunSpec, not the worker's settings: the spec's
    `explain_sentences` held-out sentences score them, and it is part of the run's fingerprint."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(PARIS[:6] + OTHER + PARIS + OTHER) + "\n")
    url = f"sqlite:///{tmp_path / 'ffmem.db'}"
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    settings = Settings(
        model=str(planted_dir), corpus=str(corpus), sentences=16, held_out_every=0, top_k=4, device="cpu",
        dtype="float32", batch_tokens=128, shard_sentences=8, value_tokens=5, cache_dir=tmp_path / "cache",
        explain_sentences=1000,  # the worker's setting: the spec below says 5
    )  # fmt: skip
    options = IndexOptions.from_settings(settings, progress=False, explain_sentences=5)
    assert options.spec.explain_sentences == 5
    summary = build_index(options, sessions, loaded=planted)
    with sessions() as session:
        query = select(Analysis).where(Analysis.run_id == summary.run_id)
        stored = {a.name: a for a in session.scalars(query)}
    assert stored["explanations"].data["held_out_sentences"] == 5
    assert stored["explanations"].options["explain_sentences"] == 5
    other = IndexOptions.from_settings(settings, progress=False, explain_sentences=6).spec
    assert fingerprint(other.options()) != fingerprint(options.spec.options())


class _Lost:
    """A lease another worker took over: `check` raises, as Heartbeat.check does then."""

    def check(self, session) -> None:
        raise LostLease("job 1 was taken over")


def test_a_step_that_lost_its_lease_commits_nothing(planted_run, planted):
    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    with sessions() as session:
        analyses_before = {a.name: a.seconds for a in session.scalars(select(Analysis))}
        links_before = session.scalar(select(func.count()).select_from(MemoryLinks))
    with pytest.raises(LostLease):
        explanations_step(
            sessions, run_id, planted, ExplanationOptions(quadrants=True, explain_sentences=3), lease=_Lost()
        )
    with pytest.raises(LostLease):
        weight_graph_step(sessions, run_id, planted, lease=_Lost())
    assert _rows(sessions, run_id) == before  # not deleted, not replaced
    with sessions() as session:
        assert {a.name: a.seconds for a in session.scalars(select(Analysis))} == analyses_before
        assert session.scalar(select(func.count()).select_from(MemoryLinks)) == links_before


def test_a_neighbours_step_that_lost_its_lease_commits_nothing(planted_run, planted):
    """Issue 40 (7): the neighbours step checks the lease before it commits, as the steps above do: its rows,
    gone here, stay gone; with a lease it holds (none here) it stores them again."""
    sessions, run_id = planted_run

    def count() -> tuple[int, int]:
        with sessions() as session:
            return tuple(
                session.scalar(select(func.count()).select_from(table).where(table.run_id == run_id))
                for table in (Neighbours, NeighbourBaseline)
            )

    stored = count()
    assert stored == (3 * 48, 3 * 2)  # a row a memory (3 layers of 48 keys); a baseline a layer and kind
    with sessions() as session:
        for table in (Neighbours, NeighbourBaseline):
            session.execute(delete(table).where(table.run_id == run_id))
        session.commit()
    with pytest.raises(LostLease):
        neighbours_step(sessions, run_id, planted, lease=_Lost())
    assert count() == (0, 0)
    neighbours_step(sessions, run_id, planted)
    assert count() == stored


def test_ffmem_compose_queues_a_composition_job_that_a_worker_takes(planted_run, planted):
    """Issue 40 (2): `ffmem compose --queue` queues a job (kind "composition", the run, the spec's options)
    as `ffmem analyze` does; a worker takes it and computes the same rows, scored as its spec says."""
    from typer.testing import CliRunner

    from ffmem.cli import cli

    sessions, run_id = planted_run
    before = _rows(sessions, run_id)
    url = sessions.kw["bind"].url.render_as_string(hide_password=False)
    command = ["compose", "--run", str(run_id), "--db", url, "--queue", "--explain-sentences", "4"]
    result = CliRunner().invoke(cli, command, env={"FFMEM_EXPLAIN_QUADRANTS": "true"})  # as the run was
    assert result.exit_code == 0, result.output
    with sessions() as session:
        job = session.scalars(select(Job).order_by(Job.id.desc()).limit(1)).one()
        assert (job.kind, job.status, job.run_id) == (JobKind.composition, JobStatus.queued, run_id)
        assert job.spec == CompositionSpec.from_settings(
            Settings(explain_quadrants=True), explain_sentences=4
        )
    assert f"job {job.id}: run {run_id}'s composition queued" in result.output
    options = IndexOptions.from_settings(Settings(device="cpu"), progress=False)
    Worker(sessions, options, loaded=planted).work(job_id=job.id)
    with sessions() as session:
        assert session.get(Job, job.id).status == JobStatus.done
        stored = {a.name: a for a in session.scalars(select(Analysis).where(Analysis.run_id == run_id))}
        assert stored["explanations"].data["held_out_sentences"] == 4
    kept = [row[:4] + row[5:6] for row in _rows(sessions, run_id)]  # the scores: on 4 sentences now
    assert kept == [row[:4] + row[5:6] for row in before]


def test_a_layers_fitting_positions_at_once_are_those_gathered_key_by_key(planted_run, planted):
    """fit_patterns' positions of every pattern of a layer (sides, then quadrants), gathered for the layer at
    once, are exactly those the key-by-key path gathers from the same stored examples."""
    sessions, run_id = planted_run
    run = _RunInputs.read(sessions, run_id, planted)
    n_layers, n_keys = run.signs.shape
    compared = 0
    for layer in range(n_layers):
        with sessions() as session:
            triggers = {
                sign: memory_reads.layer_triggers(session=session, run_id=run_id, layer=layer, sign=sign)
                for sign in POLARITIES
            }
            shaded = layer_shading(session=session, run_id=run_id, layer=layer, quadrants=True)
        laid = layer_positions(shaded, triggers, run, n_keys)
        keyed = {sign: by_key(found, n_keys) for sign, found in triggers.items()}
        (tokens, previous, m, lengths, signs), quadrants = key_positions(shaded, keyed, run, n_keys)
        np.testing.assert_array_equal(laid.tokens, tokens)
        np.testing.assert_array_equal(laid.previous, previous)
        np.testing.assert_array_equal(laid.m, m)
        assert laid.lengths.tolist() == list(lengths) and laid.signs.tolist() == list(signs)
        assert laid.quadrants == quadrants
        compared += sum(map(len, quadrants))
    assert compared > 0, "the planted run's gated keys have quadrant patterns"
