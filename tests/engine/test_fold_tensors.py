"""The torch fold (`MiningState.fold_tensors`, the fold of every non-CPU device) equals a brute-force
computation written here in numpy and the compiled CPU fold, and never reads a value back to the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ffmem.engine.mining import fold_torch as mining
from ffmem.engine.mining.corpus import Batch
from ffmem.engine.mining.state import MiningState

N_BINS, ZERO_BIN = 43, 21  # the documented histogram (mined_layer.histogram_edges)
SAMPLES = 2  # band samples per key and bin
EMPTY = np.iinfo(np.int64).max  # an empty band sample's order key
TIES = np.array([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 1e-40, -1e-40, 5000.0], dtype=np.float32)
GARBAGE = np.array([1e4, -1e4, np.nan], dtype=np.float32)  # what unmined positions hold: never counted


def random_batches(seed: int, n_layers: int, n_keys: int, n_batches: int):
    """Batches of random shapes as (coefficients [layers, batch, pos, keys], mined [batch, pos], sentence
    [batch]): padding, a first position left unmined, holes in some rows, rows with nothing mined; half the
    coefficients from a few tied values of both signs, half continuous, a few +inf; sentences shuffled
    over batches."""
    rng = np.random.default_rng(seed)
    shapes = [(int(rng.integers(1, 13)), int(rng.integers(1, 21))) for _ in range(n_batches)]  # [batch, pos]
    sentence = rng.permutation(sum(rows for rows, _ in shapes)) * 3 + 1  # sparse, unsorted indices
    batches, start = [], 0
    for rows, width in shapes:
        mined = np.zeros((rows, width), dtype=bool)
        for row in range(rows):
            length, first = int(rng.integers(1, width + 1)), int(rng.integers(0, 2))
            mined[row, first:length] = True
            if row % 4 == 3:
                mined[row] &= rng.random(width) < 0.7  # holes: mined positions need not be contiguous
            if row % 5 == 4:
                mined[row] = False  # nothing mined: no trigger, no statistic
        shape = (n_layers, rows, width, n_keys)
        tied = rng.choice(TIES, size=shape)
        continuous = (rng.standard_normal(shape) * rng.random(n_keys) * 4).astype(np.float32)
        values = np.where(rng.random(shape) < 0.5, tied, continuous) + np.float32(0.0)  # no −0.0
        values = np.where(rng.random(shape) < 0.02, np.float32(np.inf), values)  # a maximum in no band
        values = np.where(mined[None, :, :, None], values, rng.choice(GARBAGE, size=shape))
        batches.append((values.astype(np.float32), mined, sentence[start : start + rows]))
        start += rows
    return batches


def as_batch(mined: np.ndarray, sentence: np.ndarray) -> Batch:
    ids = torch.zeros(mined.shape, dtype=torch.long)  # [batch, pos]: the fold reads no token
    return Batch(ids, torch.from_numpy(mined).long(), torch.from_numpy(mined), torch.from_numpy(sentence))


class Grouped(MiningState):
    """The state of a GPU on the CPU: each layer gathered into groups of consecutive layers (`_gather`,
    what `update` does on every device but the CPU), a group folded at once by the torch fold."""

    def update(self, layer: int, coefficients: torch.Tensor, batch: Batch, inputs=None) -> None:
        self._gather(layer, coefficients, batch, inputs)


def mine(batches, n_layers: int, n_keys: int, top_k: int, fold: str, bar: bool = False) -> MiningState:
    """Every batch's layers through `fold`: "update" (compiled, on a CPU), "fold_tensors" (torch, a layer
    at a time), "grouped" (torch, the layers that fit mining.FOLD_BYTES at a time) or "compiled" (grouped,
    the torch fold's passes compiled by torch.compile); `bar`: the torch fold's lists merged in the bar
    form."""
    grouped = fold in ("grouped", "compiled")
    kind = Grouped if grouped else MiningState
    state = kind(n_layers, n_keys, top_k, compiled_fold=fold == "compiled", bar_fold=bar)
    method = "update" if grouped else fold
    for coefficients, mined, sentence in batches:
        batch = as_batch(mined, sentence)
        for layer in range(n_layers):
            getattr(state, method)(layer, torch.from_numpy(coefficients[layer]).clone(), batch)
        state.count(batch)
    return state


# -- the brute force --------------------------------------------------------------------------------------
def bin_of(x: np.float32) -> int:
    """The documented bin: 21 + 1 + octave for m > 0, 20 − octave for m ≤ −0.0, 21 for +0.0 and positive
    subnormals (their exponent bits are those of zero); octave 0 below 2^-9, 20 from 2^10, else
    ⌊log2|m|⌋ + 10."""
    magnitude = abs(float(x))
    if not np.signbit(x) and magnitude < np.finfo(np.float32).tiny:
        return ZERO_BIN
    octave = 0 if magnitude < 2.0**-9 else 20 if magnitude >= 2.0**10 else np.frexp(magnitude)[1] - 1 + 10
    return ZERO_BIN - 1 - octave if np.signbit(x) else ZERO_BIN + 1 + octave


def priority(sentence: int, memory: int) -> int:
    """The documented 31-bit hash of (sentence, memory = layer · keys + key), in Python integers."""
    x = (sentence * 2654435761 % 2**32) ^ (memory * 2246822519 % 2**32)
    x ^= x >> 16
    x = x * 0x45D9F3B % 2**32
    x ^= x >> 16
    return x >> 1


def brute_force(batches, layer: int, key: int, n_keys: int, top_k: int):
    """One key's (top-T per sign as [(coefficient, sentence, position)], histogram, sum, band samples
    {bin: [(order key, position, coefficient)]}) from each sentence's mined coefficients alone."""
    top = {1: [], -1: []}
    histogram, total, candidates = np.zeros(N_BINS, dtype=np.int64), 0.0, {}
    for coefficients, mined, sentences in batches:
        for row, sentence in enumerate(sentences.tolist()):
            where = np.flatnonzero(mined[row])  # [mined]
            values = coefficients[layer, row, where, key]  # [mined]
            for value in values:
                histogram[bin_of(value)] += 1
                total += float(value)
            if not len(where):
                continue
            order = priority(sentence, layer * n_keys + key) << 32 | sentence
            for sign in (1, -1):
                extreme = values.max() if sign == 1 else values.min()
                position = int(where[np.argmax(values == extreme)])  # its first mined position
                top[sign].append((float(sign * extreme), sentence, position, float(extreme)))
                if sign * extreme > 0 and np.isfinite(extreme):
                    candidates.setdefault(bin_of(extreme), []).append((order, position, float(extreme)))
    # An infinite extreme ranks first (+inf) or last (−inf) and reads as an empty slot's sentence, −1
    # (MiningState.triggers), its coefficient and position kept.
    triggers = {
        sign: [
            (extreme, sentence if np.isfinite(extreme) else -1, position)
            for _, sentence, position, extreme in sorted(rows, key=by_rank)
        ]
        for sign, rows in top.items()
    }
    samples = {band: sorted(rows)[:SAMPLES] for band, rows in candidates.items()}
    return {sign: rows[:top_k] for sign, rows in triggers.items()}, histogram, total, samples


def by_rank(row):
    """s·coefficient descending, then sentence ascending."""
    return -row[0], row[1]


CASES = {  # seed, layers, keys, T, batches
    "small T, many batches": (1, 2, 9, 3, 8),
    "T above the sentences": (2, 1, 7, 64, 3),
    "T of 1": (3, 2, 5, 1, 6),
    "more keys": (4, 1, 33, 5, 5),
}


@pytest.mark.parametrize("case", CASES)
def test_the_torch_fold_equals_brute_force(case):
    """Per layer and key: the top-T sentences, positions and coefficients of both signs (empty slots
    after them), the histogram, the sum and the band samples of each bin, as the brute force has them."""
    seed, n_layers, n_keys, top_k, n_batches = CASES[case]
    batches = random_batches(seed, n_layers, n_keys, n_batches)
    state = mine(batches, n_layers, n_keys, top_k, "fold_tensors")
    for layer in range(n_layers):
        got = state.layer(layer)
        for key in range(n_keys):
            triggers, histogram, total, samples = brute_force(batches, layer, key, n_keys, top_k)
            where = f"layer {layer} key {key}"
            for sign, want in triggers.items():
                n = len(want)
                assert got.sentence[sign][key, :n].tolist() == [w[1] for w in want], (where, sign)
                assert got.sentence[sign][key, n:].tolist() == [-1] * (top_k - n)  # empty slots
                assert got.position[sign][key, :n].tolist() == [w[2] for w in want], (where, sign)
                assert got.coefficient[sign][key, :n].tolist() == [w[0] for w in want], (where, sign)
            assert got.histogram[key].tolist() == histogram.tolist(), where
            assert got.total[key] == pytest.approx(total, rel=1e-12, abs=1e-9), where
            for band in range(N_BINS):
                want = samples.get(band, [])
                n = len(want)
                assert got.sample_order[key, band].tolist() == [w[0] for w in want] + [EMPTY] * (SAMPLES - n)
                assert got.sample_position[key, band, :n].tolist() == [w[1] for w in want], (where, band)
                assert got.sample_coefficient[key, band, :n].tolist() == [w[2] for w in want], (where, band)
    assert state.positions == sum(int(mined.sum()) for _, mined, _ in batches)
    assert state.sentences == sum(len(sentences) for _, _, sentences in batches)


@pytest.mark.parametrize("group_bytes", [None, 1, 2000, 2**30])
@pytest.mark.parametrize("case", CASES)
def test_the_torch_fold_gives_the_compiled_folds_state(case, group_bytes, monkeypatch):
    """Bit for bit: the same order keys (so sentences and coefficients), positions, histogram and band
    samples as `update` on a CPU (mining_cpu.fold); the sums up to their order of addition. A layer at a
    time (None) and grouped: one layer a group (1 byte), groups of as many as fit 2,000 bytes (each batch's
    shape its own: 1 to all layers, a last group shorter), or every layer of a batch at once (2^30)."""
    seed, n_layers, n_keys, top_k, n_batches = CASES[case]
    batches = random_batches(seed + 100, n_layers, n_keys, n_batches)
    if group_bytes is not None:
        monkeypatch.setattr(mining, "FOLD_BYTES", group_bytes)
    torch_fold = "fold_tensors" if group_bytes is None else "grouped"
    compiled, tensors = (mine(batches, n_layers, n_keys, top_k, fold) for fold in ("update", torch_fold))
    assert_same_state(compiled, tensors)


@pytest.mark.parametrize("case", CASES)
def test_the_bar_form_gives_the_compiled_folds_state(case, monkeypatch):
    """The torch fold's lists merged in the bar form (`bar_fold`), in groups of as many layers as fit 2,000
    bytes: `update`'s state bit for bit, with batches of fewer sentences than T and of more (T of 1 and 3:
    the candidate buffer of T cut from the batch's)."""
    seed, n_layers, n_keys, top_k, n_batches = CASES[case]
    batches = random_batches(seed + 300, n_layers, n_keys, n_batches)
    monkeypatch.setattr(mining, "FOLD_BYTES", 2000)
    compiled = mine(batches, n_layers, n_keys, top_k, "update")
    assert_same_state(compiled, mine(batches, n_layers, n_keys, top_k, "grouped", bar=True))


def assert_same_state(compiled: MiningState, tensors: MiningState) -> None:
    """The same order keys, positions, histogram and band samples; the sums up to their order."""
    for sign in (1, -1):
        assert torch.equal(compiled.top[sign].order, tensors.top[sign].order), sign
        assert torch.equal(compiled.top[sign].position, tensors.top[sign].position), sign
    for name in ("histogram", "sample_order", "sample_position", "sample_coefficient"):
        assert torch.equal(getattr(compiled, name), getattr(tensors, name)), name
    assert torch.allclose(compiled.total, tensors.total, rtol=1e-12, atol=1e-9)


# Operators that run on meta tensors but read a value back to the host on a GPU (a CUDA tensor as the
# value of masked_fill is read with .item()), or compare whole tensors into a Python bool.
SYNCING = {
    "aten.masked_fill.Tensor",
    "aten.masked_fill_.Tensor",
    "aten.equal.default",
    "aten.allclose.default",
}


class Operators(TorchDispatchMode):
    """Records the name of every aten operator dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bar", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_the_fold_of_a_batch_never_reads_a_value_back_to_the_host(gated, bar):
    """Every layer of a batch folded on the meta device (shapes, no data), as `update` does on any non-CPU
    device: `nonzero`, boolean indexing, `bincount`, `.item()`, `bool()`, `.tolist()` or `.numpy()` of a
    tensor raise there, so any host synchronisation that creeps back into the fold fails this test. Gated:
    with the sign quadrants; `bar`: the lists merged in the bar form."""
    n_layers, n_keys, top_k = 3, 11, 4
    coefficients, mined, sentence = random_batches(5, n_layers, n_keys, 1)[0]
    batch = as_batch(mined, sentence).to(torch.device("meta"))
    state = MiningState(n_layers, n_keys, top_k, device="meta", gated=gated, bar_fold=bar)
    with Operators() as operators:
        for layer in range(n_layers):
            inputs = torch.from_numpy(coefficients[layer]).to("meta") if gated else None
            state.update(layer, torch.from_numpy(coefficients[layer]).to("meta"), batch, inputs)
    assert {"aten.topk.default", "aten.scatter_reduce_.two", "aten.index_add_.default"} <= operators.names
    assert not operators.names & SYNCING
    assert state.top[1].order.shape == (n_layers, n_keys, top_k)
    assert state.quadrant_order.shape == ((n_layers, n_keys, 4, 8) if gated else (0, 0, 0, 0))


def test_the_first_of_a_stable_sort_by_comparisons_equals_torch_sort():
    from ffmem.engine.mining.order import first_of_stable_sort

    rng = np.random.default_rng(5)
    for n, k in ((4, 2), (6, 3), (1, 1), (8, 8)):
        values = torch.from_numpy(rng.integers(0, 4, size=(50, 7, n)))  # [rows, cells, n]: many ties
        values[0, 0] = EMPTY  # every entry the empty key: the kept ones stay first
        expected = values.sort(dim=-1, stable=True).indices[..., :k]  # [rows, cells, k]
        assert torch.equal(first_of_stable_sort(values, k), expected)


@pytest.mark.parametrize("bar", [False, True])
def test_the_compiled_torch_fold_gives_the_compiled_folds_state(compile_backend, bar):
    """The torch fold with its passes compiled by torch.compile (`compiled_fold`), every layer of a batch at
    once, on batches of several shapes (one compilation for them all), its lists merged as a topk of all or
    in the bar form (`bar`): `update`'s state bit for bit."""
    seed, n_layers, n_keys, top_k, n_batches = CASES["small T, many batches"]
    batches = random_batches(seed + 200, n_layers, n_keys, n_batches)
    compiled = mine(batches, n_layers, n_keys, top_k, "update")
    assert_same_state(compiled, mine(batches, n_layers, n_keys, top_k, "compiled", bar=bar))
