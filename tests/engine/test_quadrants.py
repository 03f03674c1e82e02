"""A gated memory's sign quadrants (gate act(x·g), input x·u) as mining keeps them: the counts and the top
examples of each quadrant equal a brute force written here, for the compiled CPU fold, the torch fold (a
layer at a time and grouped) and a tiny gated model read through hooks of its own; they survive a
checkpoint's bytes, a merge of shards and a resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ffmem.engine.mining import fold_torch as mining
from ffmem.engine.mining.batches import mine_batches, shard_batches
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.mined_layer import MinedLayer
from ffmem.engine.mining.order import unpack
from ffmem.engine.mining.state import MiningState

E = 8  # examples kept per quadrant (mined_layer.QUADRANT_EXAMPLES)
SIGN = (1, -1, -1, 1)  # m's sign in quadrants pp, pn, np, nn
TIES = np.array([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=np.float32)


def random_batches(seed: int, n_layers: int, n_keys: int, n_batches: int, most_rows: int = 8):
    """(coefficients, inputs [layers, batch, pos, keys], mined [batch, pos], sentence [batch]) each: tied
    and continuous values of both signs, zeros (of m and of u), a few NaN coefficients, holes, padding, rows
    with nothing mined; unmined positions hold garbage. Batches of 1 to `most_rows` sentences."""
    rng = np.random.default_rng(seed)
    batches, next_sentence = [], 0
    for _ in range(n_batches):
        rows, width = int(rng.integers(1, most_rows + 1)), int(rng.integers(1, 15))
        mined = np.zeros((rows, width), dtype=bool)
        for row in range(rows):
            mined[row, int(rng.integers(0, 2)) : int(rng.integers(1, width + 1))] = True
            if row % 4 == 3:
                mined[row] = False
        shape = (n_layers, rows, width, n_keys)
        u = np.where(rng.random(shape) < 0.5, rng.choice(TIES, size=shape), rng.standard_normal(shape))
        gate = np.where(rng.random(shape) < 0.5, rng.choice(TIES, size=shape), rng.standard_normal(shape))
        c = (gate * u).astype(np.float32) + np.float32(0.0)  # no −0.0
        c = np.where(rng.random(shape) < 0.02, np.float32(np.nan), c)
        c = np.where(mined[None, :, :, None], c, np.float32(7.0))
        u = np.where(mined[None, :, :, None], u, -3.0).astype(np.float32)
        sentence = np.arange(next_sentence, next_sentence + rows)[::-1].copy() * 2 + 1
        next_sentence += rows
        batches.append((c.astype(np.float32), u, mined, sentence))
    return batches


def as_batch(mined: np.ndarray, sentence: np.ndarray) -> Batch:
    ids = torch.zeros(mined.shape, dtype=torch.long)
    return Batch(ids, torch.from_numpy(mined).long(), torch.from_numpy(mined), torch.from_numpy(sentence))


class Grouped(MiningState):
    def update(self, layer, coefficients, batch, inputs=None):
        self._gather(layer, coefficients, batch, inputs)


def mine(batches, n_layers, n_keys, fold):
    state = (Grouped if fold == "grouped" else MiningState)(n_layers, n_keys, 3, gated=True)
    method = "update" if fold == "grouped" else fold
    for c, u, mined, sentence in batches:
        batch = as_batch(mined, sentence)
        for layer in range(n_layers):
            inputs = torch.from_numpy(u[layer]).clone()
            getattr(state, method)(layer, torch.from_numpy(c[layer]).clone(), batch, inputs)
        state.count(batch)
    return state


def quadrant_of(m: float, u: float) -> int:
    """2·(the gate m/u is negative) + (u is negative); a zero gate or input counts as ≥ 0."""
    gate_negative = (m < 0 < u) or (u < 0 < m)
    return 2 * gate_negative + (u < 0)


def brute_force(batches, layer: int, key: int):
    """One key's counts per quadrant and its examples [(m, sentence, position, u)] per quadrant: per
    sentence the largest |m| among its mined positions in the quadrant (NaN never), its first position."""
    counts, examples = [0] * 4, [[] for _ in range(4)]
    for c, u, mined, sentences in batches:
        for row, sentence in enumerate(sentences.tolist()):
            best = {}
            for p in np.flatnonzero(mined[row]).tolist():
                m, x = float(c[layer, row, p, key]), float(u[layer, row, p, key])
                q = quadrant_of(m, x)
                counts[q] += 1
                if m == m and (q not in best or abs(m) > best[q][0]):
                    best[q] = (abs(m), p, x)
            for q, (magnitude, p, x) in best.items():
                examples[q].append((SIGN[q] * magnitude, sentence, p, x))
    for rows in examples:
        rows.sort(key=lambda r: (-abs(r[0]), r[1]))
    return counts, [rows[:E] for rows in examples]


def assert_quadrants(got: MinedLayer, batches, layer: int):
    for key in range(got.quadrant_count.shape[0]):
        counts, examples = brute_force(batches, layer, key)
        assert got.quadrant_count[key].tolist() == counts, (layer, key)
        for q, want in enumerate(examples):
            n = len(want)
            where = (layer, key, q)
            assert got.quadrant_sentence[key, q, :n].tolist() == [w[1] for w in want], where
            assert got.quadrant_sentence[key, q, n:].tolist() == [-1] * (E - n), where
            assert got.quadrant_coefficient[key, q, :n].tolist() == pytest.approx([w[0] for w in want]), where
            assert got.quadrant_position[key, q, :n].tolist() == [w[2] for w in want], where
            assert got.quadrant_input[key, q, :n].tolist() == pytest.approx([w[3] for w in want]), where


@pytest.mark.parametrize("fold", ["update", "fold_tensors", "grouped"])
@pytest.mark.parametrize("seed", [1, 2])
def test_every_fold_keeps_the_quadrants_of_the_brute_force(fold, seed, monkeypatch):
    monkeypatch.setattr(mining, "FOLD_BYTES", 3000)  # grouped: groups of a few layers, a last one shorter
    batches = random_batches(seed, 3, 6, 9)
    state = mine(batches, 3, 6, fold)
    for layer in range(3):
        assert_quadrants(state.layer(layer), batches, layer)
    positions = sum(int(mined.sum()) for _, _, mined, _ in batches)
    assert state.layer(0).quadrant_shares().sum(axis=1).tolist() == pytest.approx([1.0] * 6)
    assert int(state.quadrant_count[1].sum()) == positions * 6


def test_the_torch_fold_gives_the_compiled_folds_quadrants_bit_for_bit():
    batches = random_batches(3, 2, 9, 12)
    compiled, tensors = mine(batches, 2, 9, "update"), mine(batches, 2, 9, "fold_tensors")
    for name in ("quadrant_count", "quadrant_order", "quadrant_position", "quadrant_input"):
        assert torch.equal(getattr(compiled, name), getattr(tensors, name)), name


def test_quadrants_survive_bytes_a_merge_and_a_resume():
    batches = random_batches(4, 2, 5, 10)
    whole = mine(batches, 2, 5, "update")
    first, second = mine(batches[:4], 2, 5, "update"), mine(batches[4:], 2, 5, "update")
    for layer in range(2):
        parts = [MinedLayer.from_bytes(part.layer(layer).to_bytes()) for part in (first, second)]
        merged = MinedLayer.merge(parts)
        assert_quadrants(merged, batches, layer)
    resumed = MiningState.from_layers([first.layer(layer) for layer in range(2)])
    assert resumed.gated
    for c, u, mined, sentence in batches[4:]:
        batch = as_batch(mined, sentence)
        for layer in range(2):
            resumed.update(layer, torch.from_numpy(c[layer]).clone(), batch, torch.from_numpy(u[layer]))
        resumed.count(batch)
    for name in ("quadrant_count", "quadrant_order", "quadrant_position", "quadrant_input"):
        assert torch.equal(getattr(resumed, name), getattr(whole, name)), name


def test_a_gated_state_refuses_a_layer_without_its_inputs():
    state = MiningState(1, 4, 2, gated=True)
    batch = as_batch(np.ones((1, 3), dtype=bool), np.array([0]))
    with pytest.raises(ValueError, match="inputs"):
        state.update(0, torch.zeros(1, 3, 4), batch)


def test_a_tiny_gated_models_quadrants_equal_its_gate_and_up_projections_read_apart(tiny):
    """The counts and top examples of mine_batches on a tiny SwiGLU Llama equal those of act(x·g) and x·u
    read by hooks on its own gate and up projections, each sentence alone."""
    rng = np.random.default_rng(5)
    vocab = tiny.config.vocab_size
    ids = [rng.integers(0, vocab, int(rng.integers(2, 20))).tolist() for _ in range(24)]
    first = [1] * len(ids)
    state = MiningState(tiny.n_layers, tiny.n_keys, 4, gated=True)
    batches = shard_batches(ids, first, shard=0, shard_sentences=100, batch_tokens=64, pad_id=0)
    mine_batches(tiny, batches, state)
    reference = []  # per sentence as a batch of one: (c, u, mined, sentence) over all layers
    blocks = tiny.model.model.layers
    with torch.inference_mode():
        for index, sentence in enumerate(ids):
            gates, ups = {}, {}

            def keep(store, layer):
                return lambda module, inputs, output: store.__setitem__(layer, output)

            handles = []
            for n, block in enumerate(blocks):
                handles.append(block.mlp.gate_proj.register_forward_hook(keep(gates, n)))
                handles.append(block.mlp.up_proj.register_forward_hook(keep(ups, n)))
            tiny.model.base_model(input_ids=torch.tensor([sentence]))
            for handle in handles:
                handle.remove()
            u = torch.stack([ups[layer][0] for layer in range(len(blocks))])  # [layers, pos, keys]
            gate = torch.stack([F.silu(gates[layer][0]) for layer in range(len(blocks))])  # like u
            mined = np.zeros((1, len(sentence)), dtype=bool)
            mined[0, 1:] = True
            reference.append(((gate * u)[:, None].numpy(), u[:, None].numpy(), mined, np.array([index])))
    for layer in range(tiny.n_layers):
        got = state.layer(layer)
        for key in range(tiny.n_keys):
            counts, examples = brute_force(reference, layer, key)
            assert got.quadrant_count[key].tolist() == counts, (layer, key)
            for q, want in enumerate(examples):
                n = len(want)
                assert got.quadrant_sentence[key, q, :n].tolist() == [w[1] for w in want], (layer, key, q)
                assert got.quadrant_position[key, q, :n].tolist() == [w[2] for w in want], (layer, key, q)
                close = {"rel": 1e-4, "abs": 1e-6}
                assert got.quadrant_coefficient[key, q, :n] == pytest.approx([w[0] for w in want], **close)
                assert got.quadrant_input[key, q, :n] == pytest.approx([w[3] for w in want], **close)


@pytest.mark.parametrize("bar_fold", [False, True])
@pytest.mark.parametrize("compiled_fold", [False, True])
def test_the_grouped_torch_fold_gives_the_compiled_folds_quadrants_and_triggers(
    compiled_fold, bar_fold, compile_backend
):
    """The gated torch fold, every layer of a batch at once, its passes eager or compiled by torch.compile
    (`compiled_fold`), its lists merged as a topk of all or in the bar form (`bar_fold`), on batches of 1
    to 12 sentences (fewer and more than E) with NaN coefficients: the compiled CPU fold's quadrants,
    histogram and triggers (a row's first NaN its extreme of both signs) bit for bit."""
    batches = random_batches(5, 2, 9, 8, most_rows=12)
    compiled = mine(batches, 2, 9, "update")
    tensors = MiningState(2, 9, 3, gated=True, compiled_fold=compiled_fold, bar_fold=bar_fold)
    for c, u, mined, sentence in batches:
        tensors.fold_tensors(slice(0, 2), torch.from_numpy(c), as_batch(mined, sentence), torch.from_numpy(u))
        tensors.count(as_batch(mined, sentence))
    assert bool(torch.isnan(unpack(compiled.top[1].order)[0]).any())  # NaN triggers in the compared state
    for name in ("quadrant_count", "quadrant_order", "quadrant_position", "quadrant_input", "histogram"):
        assert torch.equal(getattr(compiled, name), getattr(tensors, name)), name
    for sign in (1, -1):
        assert torch.equal(compiled.top[sign].order, tensors.top[sign].order), sign
        assert torch.equal(compiled.top[sign].position, tensors.top[sign].position), sign
