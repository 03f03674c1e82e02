"""Mining equals a brute-force computation, whatever the batch size, split, merge or resume."""

from __future__ import annotations

import random

import pytest
import torch

from ffmem.engine.mining.batches import mine_batches, shard_batches
from ffmem.engine.mining.bins import histogram_bins
from ffmem.engine.mining.corpus import length_bucketed_batches, mined_from
from ffmem.engine.mining.mined_layer import EMPTY_SAMPLE, SAMPLES, MinedLayer, histogram_edges
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.hooks import capture

TOP_K = 5


@pytest.fixture(scope="module")
def sentences(tiny):
    """40 sentences of random token ids, 1 to 30 tokens; a few start with a 'BOS' not to be mined."""
    rng = random.Random(1)
    vocab = tiny.config.vocab_size
    ids = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    first = [1 if i % 7 == 3 and len(s) > 1 else 0 for i, s in enumerate(ids)]
    return ids, first


def brute_force(tiny, ids, first):
    """Each sentence alone, unpadded: per layer the coefficients [pos, keys] of its mined positions."""
    per_sentence = []
    with torch.inference_mode(), capture(tiny.model, tiny.adapter, fields=("coefficients",)) as captured:
        for sentence, start in zip(ids, first, strict=True):
            tiny.model.base_model(input_ids=torch.tensor([sentence]))
            per_sentence.append({layer: c[0, start:].clone() for layer, c in captured.coefficients.items()})
    return per_sentence


def expected_triggers(per_sentence, layer, key, sign):
    """Top-k (coefficient, sentence, position), by s·coefficient desc then sentence asc."""
    rows = []
    for index, coefficients in enumerate(per_sentence):
        column = sign * coefficients[layer][:, key]  # [positions]
        if not len(column):  # nothing mined in this sentence
            continue
        best = column.max()
        position = int(column.argmax())
        rows.append((float(best), index, position))
    rows.sort(key=lambda r: (-r[0], r[1]))
    return rows[:TOP_K]


def mine(tiny, ids, first, batch_tokens, shard_sentences=1000, shards=None):
    state = MiningState(tiny.n_layers, tiny.n_keys, TOP_K)
    n_shards = -(-len(ids) // shard_sentences)
    for shard in shards if shards is not None else range(n_shards):
        batches = shard_batches(
            ids, first, shard=shard, shard_sentences=shard_sentences, batch_tokens=batch_tokens, pad_id=0
        )
        mine_batches(tiny, batches, state)
    return state


def reference_bins(values: torch.Tensor) -> torch.Tensor:
    """Histogram bins by bucketize with the documented convention (edges go to the larger magnitude)."""
    edges = torch.tensor(histogram_edges(), dtype=torch.float64)
    neg = torch.bucketize(values.double(), edges, right=False)
    pos = torch.bucketize(values.double(), edges, right=True)
    reference = torch.where(torch.signbit(values), torch.clamp(neg, max=20), torch.clamp(pos, min=22))
    reference[values == 0] = 21  # +0.0 has a bin of its own
    return reference


def sample_priority(sentence: int, memory: int) -> int:
    """The documented 31-bit hash of (sentence, memory = layer · keys + key), in Python integers."""
    x = (sentence * 2654435761 % 2**32) ^ (memory * 2246822519 % 2**32)
    x ^= x >> 16
    x = x * 0x45D9F3B % 2**32
    x ^= x >> 16
    return x >> 1


def expected_samples(per_sentence, layer, key, n_keys):
    """Per bin, the SAMPLES (priority, sentence) lowest of the sentences whose maximum (> 0) or minimum
    (< 0) falls in it: {bin: [(sentence, position, extreme), …]}."""
    candidates = {}
    for index, coefficients in enumerate(per_sentence):
        column = coefficients[layer][:, key]  # [positions]
        if not len(column):
            continue
        for sign, extreme, where in ((1, column.max(), column.argmax()), (-1, column.min(), column.argmin())):
            if sign * extreme > 0:
                band = int(reference_bins(extreme.reshape(1))[0])
                order = (sample_priority(index, layer * n_keys + key), index)
                candidates.setdefault(band, []).append((order, index, int(where), float(extreme)))
    return {band: [c[1:] for c in sorted(rows)[:SAMPLES]] for band, rows in candidates.items()}


def assert_samples_match_brute_force(state, per_sentence, first):
    for layer in range(state.n_layers):
        mined = state.layer(layer)
        sentence = mined.sample_sentence  # [keys, bins, S]
        for key in range(state.n_keys):
            expected = expected_samples(per_sentence, layer, key, state.n_keys)
            for band in range(sentence.shape[1]):
                want = expected.get(band, [])
                got = [s for s in sentence[key, band].tolist() if s >= 0]
                assert got == [w[0] for w in want], f"layer {layer} key {key} bin {band}"
                positions = mined.sample_position[key, band, : len(want)].tolist()
                assert positions == [w[1] + first[w[0]] for w in want]
                coefficients = mined.sample_coefficient[key, band, : len(want)]
                assert coefficients == pytest.approx([w[2] for w in want], rel=1e-5, abs=1e-4)
                assert (reference_bins(torch.from_numpy(coefficients)) == band).all()  # in its band


def assert_matches_brute_force(state, per_sentence, first):
    n_layers, n_keys = state.n_layers, state.n_keys
    assert_samples_match_brute_force(state, per_sentence, first)
    for layer in range(n_layers):
        for sign in (1, -1):
            coefficients, sentence, position = state.triggers(layer, sign)  # [keys, T]
            for key in range(n_keys):
                expected = expected_triggers(per_sentence, layer, key, sign)
                got_sentences = sentence[key].tolist()
                assert got_sentences == [e[1] for e in expected], f"layer {layer} key {key} sign {sign}"
                got_positions = position[key].tolist()
                assert got_positions == [e[2] + first[e[1]] for e in expected]
                want = torch.tensor([sign * e[0] for e in expected])
                diff = (coefficients[key] - want).abs().max()
                assert torch.allclose(coefficients[key], want, rtol=1e-5, atol=1e-4), f"max diff {diff}"
        every = torch.cat([c[layer] for c in per_sentence])  # [positions, keys]
        mean_diff = (state.mean(layer) - every.double().mean(0)).abs().max()
        assert mean_diff < 1e-4, f"max |mean − brute force| = {mean_diff}"
        assert torch.equal(state.positive_share(layer), (every > 0).double().mean(0))
        reference = reference_bins(every)
        counts = torch.stack([torch.bincount(reference[:, k], minlength=43) for k in range(n_keys)])
        assert torch.equal(state.histogram[layer], counts)
    assert state.positions == sum(len(c[0]) for c in per_sentence)


@pytest.mark.parametrize("batch_tokens", [30, 64, 257, 10_000])
def test_mining_equals_brute_force_for_any_batch_size(tiny, sentences, batch_tokens):
    ids, first = sentences
    state = mine(tiny, ids, first, batch_tokens)
    assert_matches_brute_force(state, brute_force(tiny, ids, first), first)


def test_without_the_first_position_position_0_is_in_no_trigger_and_no_statistic(tiny, sentences):
    """The default policy (no BOS, first_position off): mining from position 1 equals brute force over
    positions ≥ 1, statistics included; a one-token sentence has nothing mined and is no trigger."""
    ids, bos_first = sentences
    first = mined_from(bos_first, first_position=False)
    assert first == [1] * len(ids) and mined_from(bos_first, first_position=True) == bos_first
    one_token = {index for index, s in enumerate(ids) if len(s) == 1}
    assert one_token  # the fixture has some: their rows in a batch are all unmined
    for batch_tokens, shard_sentences in ((30, 1000), (10_000, 1000), (100, 16)):
        state = mine(tiny, ids, first, batch_tokens, shard_sentences=shard_sentences)
        assert_matches_brute_force(state, brute_force(tiny, ids, first), first)
        assert state.positions == sum(len(s) - 1 for s in ids) and state.sentences == len(ids)
        for layer in range(state.n_layers):
            for sign in (1, -1):
                _, sentence, position = state.triggers(layer, sign)
                assert position.ge(1).all() and not set(sentence.flatten().tolist()) & one_token


def test_a_sentence_with_nothing_mined_never_outranks_an_empty_slot(tiny):
    ids = [[5], [7, 8, 9], [11]]
    state = mine(tiny, ids, mined_from([0, 0, 0], first_position=False), 100)
    coefficients, sentence, _ = state.triggers(0, 1)
    assert sentence[:, 0].eq(1).all() and sentence[:, 1:].eq(-1).all()
    assert torch.isinf(coefficients[:, 1:]).all() and state.positions == 2


def test_two_shards_mined_apart_and_merged_equal_one_pass(tiny, sentences):
    ids, first = sentences
    one = mine(tiny, ids, first, 100, shard_sentences=16)
    a = mine(tiny, ids, first, 100, shard_sentences=16, shards=[0, 2])
    b = mine(tiny, ids, first, 100, shard_sentences=16, shards=[1])
    layers = [
        MinedLayer.merge([b.layer(layer), a.layer(layer)]) for layer in range(one.n_layers)
    ]  # any order
    merged = MiningState.from_layers(layers)  # what the worker stores as the run's snapshot
    assert_same_state(one, merged)
    assert_matches_brute_force(merged, brute_force(tiny, ids, first), first)


def test_checkpoint_and_resume_equal_one_pass(tiny, sentences, tmp_path):
    ids, first = sentences
    one = mine(tiny, ids, first, 100, shard_sentences=16)
    partial = mine(tiny, ids, first, 100, shard_sentences=16, shards=[0])
    saved = [partial.layer(layer).to_bytes() for layer in range(partial.n_layers)]  # what a checkpoint stores
    resumed = MiningState.from_layers([MinedLayer.from_bytes(data) for data in saved])
    for shard in (1, 2):
        mine_batches(
            tiny,
            shard_batches(ids, first, shard=shard, shard_sentences=16, batch_tokens=100, pad_id=0),
            resumed,
        )
    assert_same_state(one, resumed)


def test_numpy_merge_of_mined_layers_equals_the_engine_merge(tiny, sentences):
    """The web's provisional view merges stored layers with numpy; it must agree with the engine."""
    ids, first = sentences
    parts = [mine(tiny, ids, first, 100, shard_sentences=16, shards=[shard]) for shard in (0, 1, 2)]
    engine = mine(tiny, ids, first, 100, shard_sentences=16)
    for layer in range(engine.n_layers):
        merged = MinedLayer.merge([part.layer(layer) for part in parts])
        expected = engine.layer(layer)
        for sign in (1, -1):
            assert (merged.sentence[sign] == expected.sentence[sign]).all()
            assert (merged.position[sign] == expected.position[sign]).all()
            assert (merged.coefficient[sign] == expected.coefficient[sign]).all()
        assert (merged.histogram == expected.histogram).all() and merged.positions == expected.positions
        assert (merged.sample_order == expected.sample_order).all()
        assert (merged.sample_position == expected.sample_position).all()
        assert (merged.sample_coefficient == expected.sample_coefficient).all()
        assert merged.density() == pytest.approx(engine.density(layer).numpy())
        assert merged.positive_share() == pytest.approx(engine.positive_share(layer).numpy())


def assert_same_state(a: MiningState, b: MiningState):
    for sign in (1, -1):
        for layer in range(a.n_layers):
            ca, sa, pa = a.triggers(layer, sign)
            cb, sb, pb = b.triggers(layer, sign)
            assert torch.equal(sa, sb) and torch.equal(pa, pb)
            assert (ca - cb).abs().max() < 1e-5
    assert torch.equal(a.histogram, b.histogram)
    assert torch.equal(a.sample_order, b.sample_order) and a.sample_order.ne(EMPTY_SAMPLE).any()
    assert torch.equal(a.sample_position, b.sample_position)
    assert (a.sample_coefficient - b.sample_coefficient).abs().max() < 1e-5
    assert (a.total - b.total).abs().max() < 1e-4
    assert (a.positions, a.sentences) == (b.positions, b.sentences)


def test_fewer_sentences_than_top_k_leave_empty_slots(tiny, sentences):
    ids, first = sentences
    state = mine(tiny, ids[:3], first[:3], 100)
    _, sentence, _ = state.triggers(0, 1)
    assert sentence[:, :3].ge(0).all() and sentence[:, 3:].eq(-1).all()


def test_histogram_bins_follow_the_edges():
    values = [
        -5000.0,
        -1024.0,
        -1000.0,
        -1.0,
        -0.5,
        -1e-4,
        -0.0,
        0.0,
        1e-4,
        2.0**-9,
        0.75,
        1.0,
        1023.0,
        1024.0,
        1e6,
    ]
    expected = [0, 0, 1, 10, 11, 20, 20, 21, 22, 23, 31, 32, 41, 42, 42]
    assert histogram_bins(torch.tensor(values)[:, None])[:, 0].tolist() == expected


def test_length_bucketing_pads_little_and_respects_the_budget():
    rng = random.Random(0)
    ids = [[1] * rng.randint(3, 128) for _ in range(2048)]
    batches = list(
        length_bucketed_batches(ids, [0] * len(ids), indices=range(len(ids)), batch_tokens=4096, pad_id=0)
    )
    real = sum(b.real_tokens for b in batches)
    computed = sum(b.computed_tokens for b in batches)
    assert real == sum(map(len, ids))
    assert all(b.computed_tokens <= 4096 for b in batches)
    assert real / computed >= 0.9, f"padding efficiency {real / computed:.3f}"
    assert all(b.real_tokens >= 0.9 * b.computed_tokens for b in batches)  # also per batch, small shards too
    assert sorted(int(i) for b in batches for i in b.sentence_index) == list(range(2048))


def synthetic_corpus(n_sentences: int, n_layers: int, n_keys: int, seed: int):
    """Random coefficients with many ties, per sentence and layer [positions, keys], first positions
    included (some unmined: a huge value there must never count), and a few sentences with nothing mined."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 100.0, 2048.0])  # few values: ties everywhere
    lengths = torch.randint(1, 13, (n_sentences,), generator=generator).tolist()
    first = [int(i % 5 == 0 or length == 1 and i % 3 == 0) for i, length in enumerate(lengths)]
    full = []
    for length in lengths:
        pick = torch.randint(0, len(values), (n_layers, length, n_keys), generator=generator)
        sign = torch.randint(0, 2, (n_layers, length, n_keys), generator=generator) * 2 - 1
        full.append(values[pick] * sign + 0.0)  # [layers, pos, keys]; + 0.0: no −0.0
    for coefficients, start in zip(full, first, strict=True):
        coefficients[:, :start] = 5000.0  # an unmined first position: above every mined coefficient
    return full, first


# The two folds of a batch into the state: the compiled one a CPU runs (`update`), the torch one of
# other devices (`fold_tensors`, run here on the CPU). Both must give the brute-force state.
FOLDS = ("update", "fold_tensors")


def mine_synthetic(full, first, n_keys: int, batch_tokens: int, fold: str = "update") -> MiningState:
    """Feed the synthetic coefficients to the state's `fold` batch by batch, padding set to garbage."""
    n_layers = full[0].shape[0]
    state = MiningState(n_layers, n_keys, TOP_K)
    ids = [[1] * c.shape[1] for c in full]
    batches = length_bucketed_batches(
        ids, first, indices=range(len(ids)), batch_tokens=batch_tokens, pad_id=0
    )
    for batch in batches:
        rows, width = batch.input_ids.shape
        for layer in range(n_layers):
            coefficients = torch.full((rows, width, n_keys), -7777.0)  # [batch, pos, keys]: padding
            for row, sentence in enumerate(batch.sentence_index.tolist()):
                length = full[sentence].shape[1]
                coefficients[row, :length] = full[sentence][layer]
            getattr(state, fold)(layer, coefficients, batch)
        state.count(batch)
    return state


@pytest.mark.parametrize("fold", FOLDS)
@pytest.mark.parametrize("batch_tokens", [24, 200, 5000])
def test_update_equals_a_simple_reference_on_random_coefficients_with_ties(batch_tokens, fold):
    """Many batches of tied coefficients: the top-T (most keys skip the merge once it is full), the band
    samples, the histogram and the sum equal brute force, and the states of any batch size are equal."""
    n_layers, n_keys = 2, 6
    full, first = synthetic_corpus(300, n_layers, n_keys, seed=3)
    state = mine_synthetic(full, first, n_keys, batch_tokens, fold)
    per_sentence = [
        {layer: coefficients[layer, start:] for layer in range(n_layers)}
        for coefficients, start in zip(full, first, strict=True)
    ]
    assert_matches_brute_force(state, per_sentence, first)
    one_batch = mine_synthetic(full, first, n_keys, 10**6)
    for layer in range(n_layers):
        got, want = state.layer(layer), one_batch.layer(layer)
        for name in ("histogram", "total", "sample_order", "sample_position", "sample_coefficient"):
            assert (getattr(got, name) == getattr(want, name)).all(), name
        for sign in (1, -1):
            for name in ("coefficient", "sentence", "position"):
                assert (getattr(got, name)[sign] == getattr(want, name)[sign]).all(), (name, sign)


def test_the_compiled_and_the_torch_fold_give_the_same_state():
    """Real-sized layers (300 keys, so that every thread has a block) of continuous coefficients with the
    NaN-free extremes of SwiGLU: both folds keep the same top-T, positions, samples and histogram."""
    n_layers, n_keys = 3, 300
    generator = torch.Generator().manual_seed(5)
    scale = torch.rand(n_keys, generator=generator)  # [keys]
    full = [
        torch.randn(n_layers, int(length), n_keys, generator=generator) * scale
        for length in torch.randint(1, 40, (500,), generator=generator)
    ]
    first = [i % 2 for i in range(len(full))]
    compiled, tensors = (mine_synthetic(full, first, n_keys, 600, fold) for fold in FOLDS)
    assert_same_state(compiled, tensors)
    assert torch.equal(compiled.sample_coefficient, tensors.sample_coefficient)
    for sign in (1, -1):
        assert torch.equal(compiled.top[sign].order, tensors.top[sign].order)


def test_a_nan_coefficient_is_its_sentences_extreme_in_both_folds():
    """As torch's amax and argmax have it: a sentence with a NaN has NaN as its maximum and minimum, at the
    NaN's first position; it ranks first in the maxima's top-T (a NaN's order key is above every other),
    negated it ranks below every entry of the minima's, and it is no band sample."""
    n_layers, n_keys = 1, 4
    generator = torch.Generator().manual_seed(2)
    full = [torch.randn(n_layers, 6, n_keys, generator=generator) for _ in range(12)]
    full[3][0, 2, 1] = full[3][0, 4, 1] = float("nan")
    first = [0] * len(full)
    compiled, tensors = (mine_synthetic(full, first, n_keys, 30, fold) for fold in FOLDS)
    coefficient, sentence, position = compiled.triggers(0, 1)
    assert sentence[1, 0] == 3 and position[1, 0] == 2 and coefficient[1, 0].isnan()
    assert 3 not in compiled.triggers(0, -1)[1][1]
    for sign in (1, -1):
        assert torch.equal(compiled.top[sign].order, tensors.top[sign].order)
        assert torch.equal(compiled.top[sign].position, tensors.top[sign].position)
    assert torch.equal(compiled.histogram, tensors.histogram)
    assert torch.equal(compiled.sample_order, tensors.sample_order)
    assert not (compiled.sample_order[0, 1] & 0xFFFFFFFF).eq(3).any()


@pytest.mark.parametrize("fold", FOLDS)
def test_the_histogram_counts_every_mined_coefficient_in_its_bin(fold):
    """Signed zeros, subnormals, infinities and both ends of the range: update counts each coefficient in
    the bin histogram_bins gives it (−0.0 in bin 20, a positive subnormal with +0.0 in bin 21)."""
    values = torch.tensor(
        [-float("inf"), -5000.0, -1024.0, -1.0, -1e-4, -1e-40, -0.0, 0.0, 1e-40, 2.0**-9, 0.75, 1024.0, 1e6]
    )
    values = torch.cat([values, float("inf") * torch.ones(1)])
    n_keys = 3
    coefficients = torch.stack([values.roll(k) for k in range(n_keys)], dim=-1)[None]  # [1, pos, keys]
    mined = torch.ones(1, len(values), dtype=torch.bool)
    mined[0, 0] = False  # not counted
    batch = length_bucketed_batches([[1] * len(values)], [1], indices=[0], batch_tokens=100, pad_id=0)
    batch = next(iter(batch))
    assert torch.equal(batch.mined, mined)
    state = MiningState(1, n_keys, TOP_K)
    getattr(state, fold)(0, coefficients.clone(), batch)
    want = torch.stack(
        [torch.bincount(histogram_bins(coefficients[0, 1:, k]).long(), minlength=43) for k in range(n_keys)]
    )
    assert torch.equal(state.histogram[0], want)
