"""The real embedded SmolLM2-135M on 50 Wikipedia sentences: stored triggers recompute exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sqlalchemy import select

from ffmem.config import get_settings
from ffmem.engine import loading
from ffmem.engine.hooks import capture
from ffmem.engine.loading import dequantized_folder, embedded_gguf, load_model
from ffmem.engine.trace import trace
from ffmem.store import queries
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.key_examples import key_examples
from ffmem.store.models import Run, Sentence, Token
from ffmem.worker.index import IndexOptions, build_index

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", device="cpu", cache_dir=get_settings().cache_dir)


def test_predicts_paris(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        logits = smollm2.model(ids).logits[0, -1]  # [vocab]
    assert smollm2.tokenizer.decode(logits.argmax()) == " Paris"
    assert (smollm2.n_layers, smollm2.n_keys, smollm2.adapter.family) == (30, 1536, "llama")


def test_live_trace_predicts_paris_and_refines_it_layer_by_layer(smollm2):
    result = trace(smollm2, smollm2.tokenizer("The capital of France is").input_ids)
    assert smollm2.tokenizer.decode([result.prediction]) == " Paris"
    assert result.layers[-1].top_o == result.prediction  # the last layer's output is the prediction
    assert len(result.layers) == 30 and all(len(layer.memories) == 10 for layer in result.layers)
    # The residual grows more confident in the final token with depth (the paper's Fig. 10).
    assert result.layers[-1].final_prob > result.layers[0].final_prob
    assert result.layers[-1].final_rank < result.layers[0].final_rank


def test_the_dequantized_cache_is_reused(smollm2, monkeypatch):
    gguf = embedded_gguf("smollm2-135m")
    folder, sha = dequantized_folder(gguf, get_settings().cache_dir)
    assert json.loads((folder / "ffmem.json").read_text())["sha256"] == sha == smollm2.revision

    def no_dequantizing(*args, **kwargs):
        raise AssertionError("the GGUF was dequantized again")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", no_dequantizing)
    assert dequantized_folder(gguf, get_settings().cache_dir) == (folder, sha)


def test_index_of_50_sentences_recomputes(smollm2, tmp_path):
    url = f"sqlite:///{tmp_path / 'ffmem.db'}"
    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    options = IndexOptions(
        sentences=50,
        top_k=5,
        value_tokens=5,
        device="cpu",
        dtype="float32",
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    summary = build_index(options, sessions, loaded=smollm2)
    assert summary.sentences == 45 and summary.padding_efficiency >= 0.9  # every 10th held out
    generator = torch.Generator().manual_seed(0)
    with sessions() as session:
        run = session.get(Run, summary.run_id)
        assert run.provenance["model_revision"] == smollm2.revision
        paris = session.scalars(
            select(Token).where(Token.model_id == run.model_id, Token.token_id == 7042)
        ).one()
        assert (paris.text, paris.piece) == (" Paris", "ĠParis")
        for _ in range(6):
            layer = int(torch.randint(30, (1,), generator=generator))
            key = int(torch.randint(1536, (1,), generator=generator))
            for sign in (1, -1):
                top = queries.get_triggers(session=session, run_id=run.id, layer=layer, key=key, sign=sign)[0]
                sentence = session.get(Sentence, (run.corpus_id, top.sentence_index))
                with torch.inference_mode(), capture(smollm2.model, smollm2.adapter, [layer]) as captured:
                    smollm2.model(torch.tensor([sentence.token_ids]))
                m = captured.coefficients[layer][0, :, key]  # [pos]
                assert top.coefficient == pytest.approx(float(m[top.position]), rel=1e-4, abs=1e-4)
                extreme = m.max() if sign == 1 else m.min()
                assert top.coefficient == pytest.approx(float(extreme), rel=1e-4, abs=1e-4)
                # Issue 15: the stored shading of this top trigger is m at every token (float16;
                # position 0 is not mined, so not shaded) — and so is that of each band sample.
                found = key_examples(session=session, run_id=run.id, layer=layer, key=key)
                shown = [
                    *queries.get_triggers(session=session, run_id=run.id, layer=layer, key=key, sign=1)[
                        : found.positive
                    ],
                    *queries.get_triggers(session=session, run_id=run.id, layer=layer, key=key, sign=-1)[
                        : found.negative
                    ],
                    *found.samples,
                ]
                lengths = [
                    len(session.get(Sentence, (run.corpus_id, r.sentence_index)).token_ids) for r in shown
                ]
                shading = dict(zip([id(r) for r in shown], found.shading(lengths), strict=True))
                first = shown[0 if sign == 1 else found.positive]
                assert first.sentence_index == top.sentence_index
                values = shading[id(first)].astype("float32")  # [pos]
                assert np.isnan(values[0])
                assert values[1:] == pytest.approx(m[1:].half().float().numpy(), rel=2e-3, abs=2e-3)
                for sample in found.samples[:3]:
                    ids = session.get(Sentence, (run.corpus_id, sample.sentence_index)).token_ids
                    with torch.inference_mode(), capture(smollm2.model, smollm2.adapter, [layer]) as again:
                        smollm2.model(torch.tensor([ids]))
                    row = again.coefficients[layer][0, :, key]  # [pos]
                    assert sample.coefficient == pytest.approx(
                        float(row[sample.position]), rel=1e-4, abs=1e-4
                    )
                    got = shading[id(sample)][1:].astype("float32")
                    assert got == pytest.approx(row[1:].half().float().numpy(), rel=2e-3, abs=2e-3)


def test_try_your_own_text_equals_a_hand_computation(smollm2):
    """Issue 15: the live worker's POST /coefficients on the real model equals silu(x·g)·(x·u) computed
    from the weights and the MLP's input (a plain hook, not ffmem's), at every token of a sentence."""
    from ffmem.worker.live_server import CoefficientsRequest, Live

    text = "The Eiffel Tower is in Paris, the capital of France."
    ids = smollm2.tokenizer(text).input_ids
    inputs = {}
    blocks = smollm2.model.model.layers
    handles = [
        block.mlp.register_forward_pre_hook(
            lambda module, args, layer=layer: inputs.__setitem__(layer, args[0][0])
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        with torch.inference_mode():
            smollm2.model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    live = Live(device="cpu")
    for layer in (0, 11, 29):
        mlp = blocks[layer].mlp
        with torch.inference_mode():
            x = inputs[layer].float()  # [pos, d]
            gate = x @ mlp.gate_proj.weight.float().T  # [pos, d_ff]
            m = gate * torch.sigmoid(gate) * (x @ mlp.up_proj.weight.float().T)  # [pos, d_ff]
        key = int(m[1:].abs().amax(dim=0).argmax())  # the key that fires hardest past position 0
        request = CoefficientsRequest(model="smollm2-135m", text=text, layer=layer, key=key)
        with smollm2.lock:
            answer = live.coefficients(smollm2, request)
        assert answer.token_ids == ids
        expected = m[:, key].tolist()
        assert answer.coefficients == pytest.approx(expected, rel=1e-3, abs=1e-3)
        assert answer.max_position == int(m[:, key].argmax()) and answer.min_position == int(
            m[:, key].argmin()
        )
