"""The shading pass: a key's coefficient at every token of each wanted sentence equals the input of the
layer's down_proj read by a plain PyTorch hook, each sentence run alone; NaN where the run mines nothing."""

from __future__ import annotations

import random

import numpy as np
import torch

from ffmem.engine.mining.sentence_coefficients import sentence_coefficients


def down_proj_inputs(tiny, ids: list[int]) -> dict[int, torch.Tensor]:
    """The coefficients m [pos, keys] of every layer, read at the input of down_proj, without ffmem."""
    seen, handles = {}, []
    for index, block in enumerate(tiny.model.model.layers):
        hook = lambda module, args, index=index: seen.__setitem__(index, args[0][0].detach().clone())  # noqa: E731
        handles.append(block.mlp.down_proj.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            tiny.model(input_ids=torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_every_token_equals_a_hand_computation_in_any_batch_shape(tiny):
    rng = random.Random(3)
    vocab = tiny.config.vocab_size
    corpus = [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(30)]
    first = [1] * len(corpus)  # the default policy without a BOS: position 0 is not mined
    wanted = {
        layer: np.array([[rng.randrange(tiny.n_keys), rng.randrange(len(corpus))] for _ in range(25)])
        for layer in range(tiny.n_layers)
    }
    for batch_tokens in (20, 1000):
        found = sentence_coefficients(tiny, corpus, first, wanted, batch_tokens=batch_tokens, pad_id=0)
        for layer, pairs in wanted.items():
            values, offsets = found[layer]
            assert values.dtype == np.float32 and offsets.tolist() == [
                0,
                *np.cumsum([len(corpus[s]) for s in pairs[:, 1]]),
            ]
            for i, (key, sentence) in enumerate(pairs):
                got = values[offsets[i] : offsets[i + 1]]
                expected = down_proj_inputs(tiny, corpus[sentence])[layer][:, key]  # [pos]
                assert np.isnan(got[0])  # not mined
                np.testing.assert_allclose(got[1:], expected[1:].numpy(), rtol=1e-4, atol=1e-5)


def test_nothing_wanted_runs_nothing(tiny):
    nothing = {0: np.zeros((0, 2), np.int64)}
    found = sentence_coefficients(tiny, [[1, 2]], [0], nothing, batch_tokens=9, pad_id=0)
    assert list(found) == [0] and len(found[0][0]) == 0 and found[0][1].tolist() == [0]
