"""The path a new user takes: `ffmem demo` (what `make demo` runs) on the real SmolLM2 with an EMPTY model
cache and a fresh database, its worker's index and live threads sharing one model. The live trace must
predict " Paris", and what the key pages show of sampled keys — the top triggers of both signs, the
coefficient at every token of the shaded sentences, the band samples — must equal a recomputation
written here with plain transformers calls (not through ffmem.engine); the job needs one attempt and
nothing in the output is a traceback. (Loading the model twice at once in the worker once gave a random
embedding: wrong numbers on every page, and nothing said so.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ffmem.engine.model.known import KNOWN

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

SENTENCES = 60  # the corpus-independent work (projection, weight graph, neighbours) dominates
SAMPLED = [(0, 7), (11, 1229), (20, 345), (29, 1000)]  # (layer, key); 0-based
TRIGGERS = 3  # top triggers checked per sampled key and sign
SAMPLES = 4  # band samples checked per sampled key
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(what: str, seconds: float, check, demo: subprocess.Popen, log) -> object:
    deadline = time.monotonic() + seconds
    while True:
        assert demo.poll() is None, f"ffmem demo ended early:\n{log.read_text()[-4000:]}"
        try:
            found = check()
            if found is not None:
                return found
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} took over {seconds} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def test_demo_from_a_cold_cache_computes_the_right_numbers(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()  # empty: the demo dequantizes the GGUF while its live thread wants the model too
    log = tmp_path / "demo.log"
    port, worker_port = _free_port(), _free_port()
    env = dict(
        os.environ,
        FFMEM_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}",
        FFMEM_CACHE_DIR=str(cache),
        FFMEM_SENTENCES=str(SENTENCES),
        FFMEM_DEVICE="cpu",
        FFMEM_WORKER_URL=f"http://127.0.0.1:{worker_port}",
        # The explanations' scores (not checked here) on 20 held-out sentences, not the default 1,000:
        # scoring on 1,000 of the source's unread sentences held most of this test's finishing stage.
        FFMEM_EXPLAIN_SENTENCES="20",
        # TokenChange (not checked here) for 2 memories a layer, not the default 2,000: each costs 16 edited
        # forward rows, ~5 minutes of this test on a 2-core machine at 2,000.
        FFMEM_TOKEN_CHANGE_MEMORIES=str(2 * 30),
    )
    for name in ("FFMEM_MODEL", "FFMEM_CORPUS", "FFMEM_DTYPE", "FFMEM_TOP_K", "FFMEM_FIRST_POSITION"):
        env.pop(name, None)  # the defaults, as a new user has them
    command = [sys.executable, "-c", "from ffmem.cli import main; main()", "demo", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log, "w") as output:
        demo = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    try:
        _wait("the explorer", 60, lambda: httpx.get(f"{base}/.json", timeout=5).json(), demo, log)

        def job_done():
            job = httpx.get(f"{base}/jobs/1.json", timeout=10).json()
            assert job["job"]["status"] in ("queued", "running", "done"), job["job"]
            return job if job["job"]["status"] == "done" else None

        job = _wait("the index job", 3600, job_done, demo, log)
        indexed = time.monotonic() - started
        assert job["job"]["attempts"] == 1, job["job"]
        provenance = job["run"]["provenance"]
        assert provenance["weights_sha256"] == KNOWN["smollm2-135m"].weights_sha256
        slug = job["model"]
        held_out = len(range(9, SENTENCES, 10))  # every 10th sentence is held out of mining
        assert slug == "smollm2-135m" and job["run"]["n_sentences"] == SENTENCES - held_out
        assert provenance["held_out_every"] == 10 and provenance["sentences"] == SENTENCES

        # The live trace, from the worker's live thread (the analyses run beside it meanwhile).
        traced = httpx.get(f"{base}/m/{slug}/trace.json", params={"text": PROMPT}, timeout=300)
        assert traced.status_code == 200, traced.text
        assert traced.json()["prediction"]["token"] == " Paris", traced.json()["prediction"]

        stored = {}
        for layer, key in SAMPLED:
            page = httpx.get(f"{base}/m/{slug}/layers/{layer}/keys/{key}.json", timeout=30).json()
            assert page["run"]["id"] == job["run"]["id"] and len(page["triggers"]) >= TRIGGERS
            positive, negative = page["triggers"][:TRIGGERS], page["negative_triggers"][:TRIGGERS]
            examples = httpx.get(f"{base}/m/{slug}/layers/{layer}/keys/{key}/samples.json", timeout=30).json()
            samples = examples["samples"][:SAMPLES]
            assert len(negative) == TRIGGERS and len(samples) == SAMPLES, page
            assert all(shown["shading"] for shown in positive + negative + samples), (
                "a stored run shades them"
            )
            stored[layer, key] = (positive, negative, samples)
    finally:
        demo.terminate()  # SIGTERM, as a service manager stops it
        demo.wait(timeout=60)
    output = log.read_text()
    assert "Traceback" not in output, output[-6000:]
    assert "LOAD REPORT" not in output and "could not load" not in output, output[-6000:]
    print(f"cold start to a finished index of {SENTENCES} sentences: {indexed:.0f} s")

    # The recomputation: plain transformers on the cached weights, one sentence at a time, unpadded.
    [folder] = [path for path in cache.iterdir() if path.is_dir()]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        assert tokenizer.decode(model(ids).logits[0, -1].argmax()) == " Paris"  # the cache holds SmolLM2
    coefficients = {}  # layer -> [pos, d_ff]: the input of the value projection (down_proj), m

    def keep(layer):
        def hook(module, inputs):
            coefficients[layer] = inputs[0][0]  # [pos, d_ff]

        return hook

    hooks = [
        model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(keep(layer)) for layer in range(30)
    ]

    def recomputed(layer: int, sentence: str) -> tuple[list[int], torch.Tensor, int]:
        """The sentence's tokens, the key coefficients of `layer` at each ([pos, d_ff]) and the first mined
        position."""
        tokens = tokenizer(sentence, truncation=True, max_length=128).input_ids
        with torch.inference_mode():
            model(torch.tensor([tokens]))
        first = 1 if (tokens[0] == tokenizer.bos_token_id or not provenance["first_position"]) else 0
        return tokens, coefficients[layer], first

    def same_shading(example: dict, m: torch.Tensor, first: int, where: str) -> None:
        """Every token of the sentence shaded by m there, the unmined first positions unshaded. The shading is
        stored as int8 codes: within half the sentence's step (its largest |m| / 127, which it shows
        exactly) of m, up to the recomputation's noise (as for the coefficients: 1e-3 relative, 1e-4)."""
        shaded = [token["coefficient"] for token in example["shading"]["tokens"]]  # [pos]
        assert len(shaded) == len(m) and shaded[:first] == [None] * first, where
        half_step = max(abs(s) for s in shaded[first:]) / 254
        expected = m[first:].tolist()
        off = [
            abs(s - e) - (half_step + 1e-3 * abs(e) + 1e-4)
            for s, e in zip(shaded[first:], expected, strict=True)
        ]
        assert max(off) <= 0, f"{where}: {max(off)} past the tolerance"

    try:
        for (layer, key), (positive, negative, samples) in stored.items():
            for sign, triggers in ((1, positive), (-1, negative)):
                for trigger in triggers:
                    tokens, m, first = recomputed(layer, trigger["sentence"])
                    assert tokens[trigger["position"]] == trigger["trigger_token_id"], trigger
                    mined = sign * m[first:, key]  # [mined positions]
                    where = (
                        f"L{layer} K{key} {sign:+d} trigger {trigger['rank']} ({trigger['sentence'][:60]!r})"
                    )
                    assert trigger["position"] == first + int(mined.argmax()), where
                    assert trigger["coefficient"] == pytest.approx(
                        sign * float(mined.max()), rel=1e-3, abs=1e-4
                    ), where
                    same_shading(trigger, m[:, key], first, where)
            for sample in samples:
                _, m, first = recomputed(layer, sample["sentence"])
                mined = sample["sign"] * m[first:, key]  # [mined positions]
                where = f"L{layer} K{key} band sample in {sample['band']} ({sample['sentence'][:60]!r})"
                assert sample["position"] == first + int(mined.argmax()), where
                assert sample["coefficient"] == pytest.approx(
                    float(m[sample["position"], key]), rel=1e-3, abs=1e-4
                )
                same_shading(sample, m[:, key], first, where)
    finally:
        for hook in hooks:
            hook.remove()
