"""Target ranks from the bf16 product (ffmem.engine.values.bf16_ranks) against recomputations written here:
every rank equals the count of tokens with a higher float64 logit (numpy), near-ties included (token rows
equal to the target's, tie not counted; rows scaled by 1 ± 2⁻²⁰, a difference far inside the bf16 bound and
close to float32's rounding); against a float32 recomputation, a rank differs only by tokens whose float32
logit lies within float32's error bound of the target's. Through `target_ranks` (arithmetic="bf16") on the
tiny models, the ranks equal the float64 ones, and −1 stays −1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_adapters import CASES, _tiny

from ffmem.engine.model.adapters import adapter_for
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.bf16_logits import Bf16Logits, Unembedding
from ffmem.engine.values.bf16_ranks import bf16_target_ranks
from ffmem.engine.values.projection import READOUTS, target_ranks


def _synthetic(bias: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(values [256, 384], E [6000, 384], bias [6000], targets [256]) float32 / int64: targets spread over
    the bulk and the tails, and near-ties of every target: tokens 10–19 copy token 5's row (exact ties),
    token 20 is its row × (1 + 2⁻²⁰) and token 21 × (1 − 2⁻²⁰); half the rows target token 5."""
    rng = np.random.default_rng(1)
    d, vocab = 384, 6000
    unembedding = rng.normal(size=(vocab, d)) * rng.uniform(0.5, 3.0, size=(vocab, 1))  # [vocab, d]
    unembedding[10:20] = unembedding[5]
    unembedding[20] = unembedding[5] * (1 + 2.0**-20)
    unembedding[21] = unembedding[5] * (1 - 2.0**-20)
    values = rng.normal(size=(256, d)) * rng.uniform(0.1, 2.0, size=(256, 1))  # [256, d]
    offset = rng.normal(size=vocab) if bias else np.zeros(vocab)  # [vocab]
    offset[10:22] = offset[5]  # the near-ties' biases are the target's
    targets = rng.integers(vocab, size=256)  # [256]
    targets[::2] = 5
    targets[3] = -1
    return values.astype(np.float32), unembedding.astype(np.float32), offset.astype(np.float32), targets


def _hand_ranks(values, unembedding, offset, targets) -> np.ndarray:
    """Tokens with a higher logit, in float64 from the float32 inputs: [rows]; −1 where the target is −1."""
    logits = values.astype(np.float32).astype(np.float64) @ unembedding.astype(np.float64).T + offset
    own = np.take_along_axis(logits, np.maximum(targets, 0)[:, None], 1)  # [rows, 1]
    return np.where(targets >= 0, (logits > own).sum(axis=1), -1)


@pytest.mark.parametrize("bias", [False, True])
def test_every_rank_is_the_exact_one_near_ties_included(bias):
    values, unembedding, offset, targets = _synthetic(bias)
    table = Unembedding.prepare(torch.from_numpy(unembedding), torch.from_numpy(offset) if bias else None)
    chunk = Bf16Logits.of(table, torch.from_numpy(values))
    ranks = bf16_target_ranks(table, chunk, torch.from_numpy(targets)).numpy()  # [256]
    np.testing.assert_array_equal(ranks, _hand_ranks(values, unembedding, offset, targets))
    # the near-ties are real: token 20 sits above token 5 where its logit is positive, 21 below, and bf16
    # cannot tell them apart (the exact pass decides)
    exact = values.astype(np.float64) @ unembedding.astype(np.float64).T + offset  # [256, vocab]
    assert (np.abs(exact[:, 20] - exact[:, 5]) < 1e-5 * np.abs(exact[:, 5]) + 1e-6).all()
    assert ((exact[:, 20] > exact[:, 5]) != (exact[:, 21] > exact[:, 5])).mean() > 0.9
    approximate = chunk.logits.double().numpy()
    assert (approximate[:, 20] == approximate[:, 5]).mean() > 0.5
    # float32's ranks differ only by the tokens within its error bound of the target's logit
    float32 = torch.from_numpy(values) @ torch.from_numpy(unembedding).T + torch.from_numpy(
        offset
    )  # [256, vocab]
    own = float32.gather(1, torch.from_numpy(np.maximum(targets, 0))[:, None])  # [256, 1]
    ranks32 = (float32 > own).sum(dim=1).numpy()
    error = 384 * 2.0**-24 * (np.abs(values) @ np.abs(unembedding).T) + 2.0**-24 * np.abs(
        exact
    )  # [256, vocab]
    slack = error + np.take_along_axis(error, np.maximum(targets, 0)[:, None], 1)
    near = (np.abs(float32.double().numpy() - own.double().numpy()) <= slack).sum(axis=1)  # [256]
    held = targets >= 0
    assert (np.abs(ranks - ranks32)[held] <= near[held]).all()
    assert ranks[3] == -1


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("llama", "gpt2")], ids=lambda c: c.name)
def test_target_ranks_in_bf16_are_the_float64_ones(case):
    model = _tiny(case)
    loaded = LoadedModel(
        model, None, adapter_for(model), case.name, case.name, None, torch.device("cpu"), torch.float32
    )
    transformer = getattr(model, "transformer", None)  # GPT-2's blocks and final norm, else Llama's
    blocks, norm = (
        (transformer.h, transformer.ln_f) if transformer else (model.model.layers, model.model.norm)
    )
    unembedding = model.lm_head.weight.detach().double().numpy()  # [vocab, d]
    generator = torch.Generator().manual_seed(0)
    for layer, block in enumerate(blocks):
        projection = block.mlp.c_proj.weight if transformer else block.mlp.down_proj.weight.T  # [keys, d]
        targets = torch.randint(0, unembedding.shape[0], (projection.shape[0],), generator=generator)
        targets[::5] = -1
        for readout in READOUTS:
            with (
                torch.no_grad()
            ):  # what the output embedding reads: the value, or the model's final norm of it
                read = (projection if readout == "raw" else norm(projection)).double().numpy()  # [keys, d]
            expected = _hand_ranks(read, unembedding, np.zeros(unembedding.shape[0]), targets.numpy())
            ranks = target_ranks(loaded, layer, targets, readout, chunk=7, arithmetic="bf16")
            np.testing.assert_array_equal(
                ranks.numpy(), expected, err_msg=f"{case.name} layer {layer} {readout}"
            )
