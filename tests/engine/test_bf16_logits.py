"""The bf16 readout (ffmem.engine.values.bf16_logits) against a float64 recomputation written here with numpy:
its bound holds for every logit, every value's top and bottom tokens are exactly the float64 ones (the same
tokens, logits within float32's rounding; only tokens whose exact logits tie within that may swap places),
log Z is within its stated tolerance, and a value with more candidates than the capacity is recomputed
whole. Through the projection (arithmetic="bf16") the stored tokens and the histograms' low and high equal
the float32 arithmetic's on the tiny Llama and GPT-2 (a bias on the norm readout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.bf16_logits import OUT, SLACK, Bf16Logits, Unembedding, extreme_tokens
from ffmem.engine.values.projection import project_layer

N = 30


def _synthetic(bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values [512, 384], E [6000, 384], bias [6000]) float32: tokens of uneven norms, values with a few
    strong directions (peaked readouts) and plain ones; duplicate token rows (exact ties)."""
    rng = np.random.default_rng(0)
    d, vocab = 384, 6000
    unembedding = rng.normal(size=(vocab, d)) * rng.uniform(0.5, 3.0, size=(vocab, 1))  # [vocab, d]
    unembedding[100:110] = unembedding[200]  # ten tokens with the same row: tied logits
    values = rng.normal(size=(512, d)) * rng.uniform(0.1, 2.0, size=(512, 1))  # [512, d]
    values[:64] += 4 * unembedding[rng.integers(vocab, size=64)] / np.sqrt(d)  # peaked on one token
    offset = rng.normal(size=vocab) if bias else np.zeros(vocab)  # [vocab]
    return values.astype(np.float32), unembedding.astype(np.float32), offset.astype(np.float32)


def _hand(values: np.ndarray, unembedding: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Exact logits in float64: [512, vocab]."""
    return values.astype(np.float64) @ unembedding.astype(np.float64).T + offset


def _assert_extremes_exact(found_logits, found_ids, exact: np.ndarray, largest: bool) -> None:
    """The found [rows, n] ids and logits are the exact top (bottom) n of `exact` [rows, vocab]: each
    found logit equals its token's exact one, and the n-th exact value bounds the rest."""
    ids, logits = found_ids.numpy(), found_logits.numpy()
    sign = 1 if largest else -1
    expected = np.sort(sign * exact, axis=1)[:, ::-1][:, : ids.shape[1]] * sign  # [rows, n]
    np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=1e-5)  # the same values, in order
    np.testing.assert_allclose(np.take_along_axis(exact, ids, 1), logits, rtol=1e-6, atol=1e-5)
    assert (np.diff(sign * logits, axis=1) <= 0).all()
    assert all(len(set(row)) == len(row) for row in ids.tolist())  # no token twice
    # tokens beyond the n-th exact value are never left out: every token above it was found
    nth = expected[:, -1:]  # [rows, 1]
    above = (sign * exact) > (sign * nth) + 1e-5  # [rows, vocab]
    for row in range(exact.shape[0]):
        assert set(np.flatnonzero(above[row])) <= set(ids[row].tolist())


@pytest.mark.parametrize("bias", [False, True])
def test_the_bound_holds_and_the_extremes_are_the_exact_ones(bias):
    values, unembedding, offset = _synthetic(bias)
    exact = _hand(values, unembedding, offset)  # [512, vocab]
    table = Unembedding.prepare(torch.from_numpy(unembedding), torch.from_numpy(offset) if bias else None)
    chunk = Bf16Logits.of(table, torch.from_numpy(values))
    approximate = chunk.logits.double().numpy()  # [512, vocab]
    beta = (  # the module's bound, written out: A·‖e‖ + B·R + OUT·|L̃|, with its slack, + C
        chunk.rounding.double().numpy()[:, None] * table.norm.double().numpy()
        + chunk.norm.double().numpy()[:, None] * table.rounding.double().numpy()
        + OUT * np.abs(approximate)
    ) * SLACK + table.bias_slack.double().numpy()
    error = np.abs(approximate - exact)
    assert (error <= beta).all()
    assert 0 < error.max() and np.median(error / beta) < 0.5  # bf16 is inexact, the bound not vacuous
    found = extreme_tokens(table, chunk, N)
    for direction, (logits, ids) in found.found.items():
        assert logits.shape == ids.shape == (512, N) and ids.dtype == torch.int64
        _assert_extremes_exact(logits, ids, exact, largest=direction == 1)
    high = exact.max(axis=1, keepdims=True)
    log_z = high[:, 0] + np.log(np.exp(exact - high).sum(axis=1))  # [512]
    assert found.log_z.shape == (512,)
    np.testing.assert_allclose(found.log_z.numpy(), log_z, atol=0.02)
    # the top candidates weigh most where the readout is peaked: log Z nearly exact there
    np.testing.assert_allclose(found.log_z.numpy()[:64], log_z[:64], atol=2e-3)


def test_a_value_with_too_many_candidates_is_recomputed_whole():
    values, unembedding, offset = _synthetic(bias=True)
    exact = _hand(values, unembedding, offset)
    table = Unembedding.prepare(torch.from_numpy(unembedding), torch.from_numpy(offset))
    chunk = Bf16Logits.of(table, torch.from_numpy(values))
    found = extreme_tokens(table, chunk, N, capacity=N + 2)  # most rows overflow
    for direction, (logits, ids) in found.found.items():
        _assert_extremes_exact(logits, ids, exact, largest=direction == 1)
    high = exact.max(axis=1, keepdims=True)
    np.testing.assert_allclose(
        found.log_z.numpy(), high[:, 0] + np.log(np.exp(exact - high).sum(axis=1)), atol=0.02
    )


@pytest.fixture(scope="module", params=["tiny_llama", "gpt2"])
def loaded_model(request, tiny) -> LoadedModel:
    if request.param == "tiny_llama":
        return tiny
    model = _tiny(next(case for case in CASES if case.name == "gpt2"))
    return LoadedModel(
        model, None, adapter_for(model), "gpt2", "gpt2", None, torch.device("cpu"), torch.float32
    )


def test_the_projection_in_bf16_stores_the_float32_tokens(loaded_model):
    for layer in range(loaded_model.n_layers):
        fast = list(project_layer(loaded_model, layer, n=5, chunk=7, arithmetic="bf16"))
        plain = list(project_layer(loaded_model, layer, n=5, chunk=7, arithmetic="float32"))
        for f, p in zip(fast, plain, strict=True):
            assert (f.readout, f.direction) == (p.readout, p.direction)
            # the same tokens (a tie within float32's rounding may swap two neighbours)
            assert [sorted(row) for row in f.token_ids.tolist()] == [
                sorted(row) for row in p.token_ids.tolist()
            ]
            torch.testing.assert_close(f.logits, p.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f.log_z, p.log_z, rtol=0, atol=0.02)
            torch.testing.assert_close(f.probs, p.probs, rtol=0.03, atol=1e-6)
            torch.testing.assert_close(f.histogram.low, p.histogram.low, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f.histogram.high, p.histogram.high, rtol=1e-5, atol=1e-5)
            assert (f.histogram.counts.sum(dim=1) == p.histogram.counts.sum(dim=1)).all()  # every token once


def test_an_unknown_arithmetic_is_refused(tiny):
    with pytest.raises(ValueError, match="unknown arithmetic 'fp8'"):
        next(project_layer(tiny, 0, arithmetic="fp8"))


def test_the_prepared_embedding_is_kept_until_forgotten(tiny):
    first = Unembedding.of(tiny)
    assert Unembedding.of(tiny) is first
    raw = Unembedding.of(tiny, bias=False)  # the raw readout, v·Eᵀ: the same weights, no bias
    assert raw.weight_bf16 is first.weight_bf16 and not raw.bias.any()
    Unembedding.forget(tiny)  # what the worker does once the projection is done
    assert Unembedding.of(tiny) is not first
    Unembedding.forget(tiny)
