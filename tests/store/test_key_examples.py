"""A key's stored shading: int8 codes with a step per sentence, read whole or in the parts its pages show."""

from __future__ import annotations

import numpy as np
import pytest

from ffmem.store import key_examples
from ffmem.store.key_examples import BandSample, StoredExamples, decode_shading


def encode_shading(sentences: list[np.ndarray]) -> bytes:
    """key_examples.encode_shading of these sentences, laid end to end."""
    flat = np.concatenate([np.asarray(s, np.float32) for s in sentences] or [np.zeros(0, np.float32)])
    return key_examples.encode_shading(flat, [len(s) for s in sentences])


LENGTHS = [5, 1, 7, 3, 4, 2]  # 2 positive triggers, 1 negative, 3 band samples


@pytest.fixture
def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    found = [rng.normal(size=n).astype(np.float32) for n in LENGTHS]
    found[2][3] = np.nan  # a position the run does not mine
    found[4][:] = 0.0  # a sentence with nothing to shade
    return found


def stored(arrays) -> StoredExamples:
    samples = [BandSample(bin=b, sentence_index=b, position=0, coefficient=1.0) for b in range(3)]
    return StoredExamples(samples=samples, positive=2, negative=1, data=encode_shading(arrays))


def test_each_value_is_within_half_a_step_of_its_sentence_peak(arrays):
    decoded = decode_shading(encode_shading(arrays), LENGTHS)
    for original, found in zip(arrays, decoded, strict=True):
        assert np.array_equal(np.isnan(found), np.isnan(original))
        peak = np.nanmax(np.abs(original))
        assert np.nanmax(np.abs(found - original)) <= peak / 127 / 2 + 1e-7
        assert np.nanmax(np.abs(found)) == pytest.approx(peak, rel=1e-6)


def test_the_triggers_and_the_samples_alone_equal_their_part_of_the_whole(arrays):
    examples = stored(arrays)
    whole = examples.shading(LENGTHS)
    parts = examples.trigger_shading(LENGTHS[:3]) + examples.sample_shading(LENGTHS[3:])
    assert len(parts) == len(whole)
    for part, found in zip(parts, whole, strict=True):
        np.testing.assert_array_equal(part, found)
    assert examples.steps().shape == (6,)


@pytest.mark.parametrize(
    "read, lengths",
    [("trigger_shading", LENGTHS[:2]), ("sample_shading", LENGTHS[3:5]), ("shading", LENGTHS[:5])],
)
def test_a_wrong_count_of_sentences_is_refused(arrays, read, lengths):
    with pytest.raises(ValueError, match="does not match these sentences"):
        getattr(stored(arrays), read)(lengths)


def test_more_tokens_than_stored_are_refused(arrays):
    with pytest.raises(ValueError, match="does not match these sentences"):
        stored(arrays).sample_shading([100, 1, 1])


def one_sentence_at_a_time(sentences) -> bytes:
    """encode_shading's bytes as written out sentence by sentence (steps, then codes, deflated)."""
    import zlib

    steps, codes = [], []
    for values in sentences:
        values = np.asarray(values, np.float32)
        mined = ~np.isnan(values)
        step = np.float32((float(np.abs(values[mined]).max()) if mined.any() else 0.0) / 127)
        scaled = [np.rint(v / step) if m and step > 0 else 0.0 for v, m in zip(values, mined, strict=True)]
        codes += [int(np.clip(s, -127, 127)) if m else -128 for s, m in zip(scaled, mined, strict=True)]
        steps.append(step)
    return zlib.compress(np.array(steps, np.float32).tobytes() + np.array(codes, np.int8).tobytes())


def test_the_shading_of_many_sentences_at_once_equals_one_at_a_time():
    rng = np.random.default_rng(4)
    sentences = [
        rng.normal(scale=10.0 ** rng.integers(-3, 3), size=n).astype(np.float32)
        for n in rng.integers(0, 9, 60)
    ]
    sentences[3] = np.full(4, np.nan, np.float32)  # nothing mined
    sentences[5] = np.zeros(0, np.float32)  # empty, between others
    sentences[7][::2] = np.nan
    sentences[9] = np.zeros(3, np.float32)  # nothing to shade
    for part in (sentences, sentences[:1], [np.zeros(0, np.float32)], []):
        assert encode_shading(part) == one_sentence_at_a_time(part)


def test_a_layers_band_samples_packed_at_once_read_back_as_each_keys():
    from ffmem.engine.mining.mined_layer import EMPTY_SAMPLE, MinedLayer
    from ffmem.store.key_examples import decode_bands, layer_bands, samples_of

    rng = np.random.default_rng(3)
    keys, bins, slots = 6, 43, 2
    order = rng.integers(0, 2**31, (keys, bins, slots)) << 32 | rng.integers(0, 10**6, (keys, bins, slots))
    order[rng.random((keys, bins, slots)) < 0.7] = EMPTY_SAMPLE  # most cells empty
    order[2] = EMPTY_SAMPLE  # a key with no sample at all
    mined = MinedLayer(
        coefficient={s: np.zeros((keys, 1), np.float32) for s in (1, -1)},
        sentence={s: np.full((keys, 1), -1) for s in (1, -1)},
        position={s: np.zeros((keys, 1), np.int64) for s in (1, -1)},
        histogram=np.zeros((keys, bins), np.int64),
        total=np.zeros(keys),
        positions=0,
        sentences=0,
        sample_order=order,
        sample_position=rng.integers(0, 300, (keys, bins, slots)).astype(np.int16),
        sample_coefficient=rng.normal(size=(keys, bins, slots)).astype(np.float32),
    )
    packed = layer_bands(mined)
    assert [decode_bands(bands) for bands in packed] == [samples_of(mined, key) for key in range(keys)]
    # A PACKED byte and the widths, then 10 B a sample: bin, sentence index (3 B: < 10⁶), position (2 B), m
    assert packed[2] == b"" and packed[0][:3] == bytes([key_examples.PACKED, 3, 2])
    assert sum(map(len, packed)) == 3 * (keys - 1) + 10 * int((order != EMPTY_SAMPLE).sum())


def test_a_layers_flat_shading_cuts_into_each_keys_sentences():
    """LayerShading.key: key after key, each key's positive triggers, negative ones and samples."""
    rng = np.random.default_rng(5)
    counts = np.array([[2, 1, 3], [0, 0, 0], [1, 0, 2], [0, 2, 0]])  # [keys, 3]; key 1 shades nothing
    sentences = [rng.normal(size=n).astype(np.float32) for n in rng.integers(0, 6, int(counts.sum()))]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])])
    shading = key_examples.LayerShading(np.concatenate(sentences), offsets, counts)
    first = 0
    for key, n in enumerate(counts.sum(axis=1)):
        values, lengths = shading.key(key)
        mine = sentences[first : first + n]
        assert lengths.tolist() == [len(s) for s in mine]
        np.testing.assert_array_equal(values, np.concatenate(mine or [np.zeros(0, np.float32)]))
        assert key_examples.encode_shading(values, lengths) == encode_shading(mine)
        first += n


def test_a_layers_shading_at_once_is_each_keys_byte_for_byte():
    """Issue 41: store_key_examples encodes a layer's shading at once; each key's bytes are what
    encode_shading gives that key alone (NaN, all-zero and empty sentences, keys with no sentence)."""
    rng = np.random.default_rng(3)
    counts = np.array([[2, 1, 3], [0, 0, 0], [1, 1, 0], [0, 2, 4]])  # [keys, 3]
    lengths = rng.integers(0, 9, int(counts.sum()))  # [sentences], some empty
    values = rng.normal(0, 2, int(lengths.sum())).astype(np.float32)  # [tokens]
    values[rng.random(len(values)) < 0.2] = np.nan
    values[: lengths[0]] = 0.0  # a sentence of zeros: step 0
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # [sentences + 1]
    shading = key_examples.LayerShading(values, offsets, counts)
    alone = [key_examples.encode_shading(*shading.key(key)) for key in range(len(counts))]
    assert key_examples.encode_layer_shading(shading) == alone
    for key, data in enumerate(alone):
        part, widths = shading.key(key)
        decoded = key_examples.decode_shading(data, widths.tolist())
        assert len(decoded) == len(widths) and all(len(d) == n for d, n in zip(decoded, widths, strict=True))
        if len(part):
            np.testing.assert_array_equal(np.isnan(np.concatenate(decoded)), np.isnan(part))


def test_band_samples_and_quadrant_examples_pack_and_old_blobs_read():
    """Issue 41: a key's band samples and quadrant examples are packed as narrow as the layer needs (a
    PACKED byte, the widths); blobs stored before 0031 (fixed records) still read as they were written."""
    from ffmem.store.key_examples import BAND, PACKED, QUADRANT_EXAMPLE, _pack, decode_bands

    counts = np.array([2, 0, 1])  # [keys]
    bands = _pack(
        (
            np.array([3, 40, 7]),
            np.array([5, 70_000, 9]),
            np.array([1, 2, 300]),
            np.array([0.5, -2, 8], np.float32),
        ),
        1,
        counts,
    )
    assert [b[:3] for b in bands] == [bytes([PACKED, 3, 2]), b"", bytes([PACKED, 3, 2])]  # widths 3, 2
    assert [len(b) for b in bands] == [3 + 2 * 10, 0, 3 + 10]
    assert [decode_bands(b) for b in bands] == [
        [BandSample(3, 5, 1, 0.5), BandSample(40, 70_000, 2, -2.0)],
        [],
        [BandSample(7, 9, 300, 8.0)],
    ]
    old = np.array([(3, 5, 1, 0.5), (40, 70_000, 2, -2.0)], BAND).tobytes()
    assert decode_bands(old) == decode_bands(bands[0])
    (quadrants,) = _pack(
        (np.array([0, 3]), np.array([4, 6]), np.array([1, 2]), np.array([1.5, -1], np.float32),
         np.array([0.5, 2], np.float32)),
        2,
        np.array([2]),
    )  # fmt: skip
    assert len(quadrants) == 3 + 2 * (1 + 1 + 1 + 8)
    old = np.array([(0, 4, 1, 1.5, 0.5), (3, 6, 2, -1.0, 2.0)], QUADRANT_EXAMPLE).tobytes()
    expected = [
        key_examples.QuadrantExample(0, 4, 1, 1.5, 0.5),
        key_examples.QuadrantExample(3, 6, 2, -1.0, 2.0),
    ]
    assert key_examples.decode_quadrant_examples(quadrants) == expected
    assert key_examples.decode_quadrant_examples(old) == expected
