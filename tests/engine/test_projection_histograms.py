"""Each value's logit histogram over the whole vocabulary (ffmem.engine.values.projection, in the projection's
pass) against numpy's histogram of logits computed apart from ffmem.engine, in float64 from the Hugging Face
modules' weights: v_i·Eᵀ (raw) and lm_head(final_norm(v_i)) (norm), for every key of every layer of the
tiny Llama (RMSNorm, untied) and of a tiny GPT-2 (LayerNorm with a bias, tied embeddings). The compiled
CPU count and the torch count (other devices) give the same bins."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import (
    HISTOGRAM_BINS,
    READOUTS,
    _histogram_compiled,
    _histogram_torch,
    layer_logits,
    logit_histogram,
    project_layer,
)

GPT2 = next(case for case in CASES if case.name == "gpt2")


def _hand_values(model) -> tuple[list[np.ndarray], np.ndarray, callable]:
    """(each layer's values [keys, d], E [vocab, d], final_norm) in float64, read off the HF modules."""
    weights = lambda t: t.detach().double().numpy()  # noqa: E731
    if hasattr(model, "transformer"):  # GPT-2: Conv1D c_proj holds [d_ff, d], rows are the values
        values = [weights(block.mlp.c_proj.weight) for block in model.transformer.h]
        norm = model.transformer.ln_f
        w, b, eps = weights(norm.weight), weights(norm.bias), norm.eps

        def final_norm(v):
            centered = v - v.mean(axis=-1, keepdims=True)
            return centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + eps) * w + b
    else:  # Llama: down_proj holds [d, d_ff], its columns are the values
        values = [weights(layer.mlp.down_proj.weight).T for layer in model.model.layers]
        norm = model.model.norm
        w, eps = weights(norm.weight), norm.variance_epsilon

        def final_norm(v):
            return v / np.sqrt((v**2).mean(axis=-1, keepdims=True) + eps) * w

    return values, weights(model.lm_head.weight), final_norm


def _expected(logits: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy's histogram of each row between its min and max ([keys, bins]), and each row's logits that
    lie within float32's reach of an inner edge ([keys]: where an independent computation may bin apart)."""
    counts, near = [], []
    for row in logits:
        counts.append(np.histogram(row, bins=bins, range=(row.min(), row.max()))[0])
        place = (row - row.min()) / (row.max() - row.min()) * bins  # [vocab]: in bin widths
        inner = (np.round(place) >= 1) & (np.round(place) <= bins - 1)
        near.append(int((inner & (np.abs(place - np.round(place)) < 2e-4)).sum()))
    return np.array(counts), np.array(near)


@pytest.fixture(scope="module", params=["tiny_llama", "gpt2"])
def model_and_loaded(request, tiny):
    if request.param == "tiny_llama":
        return tiny.model, tiny
    model = _tiny(GPT2)
    return model, LoadedModel(
        model, None, adapter_for(model), "gpt2", "gpt2", None, torch.device("cpu"), torch.float32
    )


def test_every_value_histogram_equals_numpys_over_the_whole_vocabulary(model_and_loaded):
    model, loaded = model_and_loaded
    values, unembedding, final_norm = _hand_values(model)
    vocab = unembedding.shape[0]
    near_edges = checked = 0
    for layer, v in enumerate(values):
        hand = {"raw": v @ unembedding.T, "norm": final_norm(v) @ unembedding.T}  # [keys, vocab] each
        found = {
            p.readout: p.histogram for p in project_layer(loaded, layer, n=3, chunk=7) if p.direction == 1
        }
        assert set(found) == set(READOUTS)
        for readout, logits in hand.items():
            histogram = found[readout]
            counts = histogram.counts.numpy()
            assert counts.shape == (v.shape[0], HISTOGRAM_BINS) and histogram.counts.dtype == torch.int64
            assert (counts.sum(axis=1) == vocab).all(), (layer, readout)
            np.testing.assert_allclose(histogram.low.numpy(), logits.min(axis=1), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(histogram.high.numpy(), logits.max(axis=1), rtol=1e-5, atol=1e-5)
            expected, near = _expected(logits, HISTOGRAM_BINS)
            # A token binned apart moves one count out of a bin and into another: at most 2 per such token.
            moved = np.abs(counts - expected).sum(axis=1)  # [keys]
            assert (moved <= 2 * near).all(), (layer, readout, np.flatnonzero(moved > 2 * near))
            near_edges += int(near.sum())
            checked += logits.size
    assert near_edges < 0.002 * checked  # the tolerance excuses almost no token: the counts are checked


def test_the_torch_count_equals_the_compiled_one(tiny):
    for layer in range(tiny.n_layers):
        for readout in READOUTS:
            for _, logits in layer_logits(tiny, layer, readout, chunk=16):  # [16, vocab]
                low, high = logits.amin(dim=-1, keepdim=True), logits.amax(dim=-1, keepdim=True)
                scale = HISTOGRAM_BINS / (high - low)
                compiled = _histogram_compiled(logits, low, scale, HISTOGRAM_BINS)
                assert torch.equal(compiled, _histogram_torch(logits, low, scale, HISTOGRAM_BINS))
                assert torch.equal(compiled, logit_histogram(logits, low, high, HISTOGRAM_BINS))


def test_the_bins_close_on_the_highest_logit_and_a_constant_value_fills_the_first():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 4.0], [2.5] * 6])  # [2, vocab 6]
    low, high = logits.amin(dim=-1, keepdim=True), logits.amax(dim=-1, keepdim=True)
    counts = logit_histogram(logits, low, high, 4)
    assert counts.tolist() == [[1, 1, 1, 3], [6, 0, 0, 0]]
    assert np.histogram(logits[0].numpy(), bins=4)[0].tolist() == [1, 1, 1, 3]  # numpy's rule
