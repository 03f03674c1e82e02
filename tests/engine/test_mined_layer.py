"""The stored format of a mined layer: a version byte, then the arrays; rows written before the byte
existed still read; an unknown version is refused with what to do."""

from __future__ import annotations

import io

import numpy as np
import pytest

from ffmem.engine.mining.mined_layer import FORMAT_VERSION, MinedFormatError, MinedLayer, empty_samples


def _layer(keys: int = 3, top: int = 2) -> MinedLayer:
    rng = np.random.default_rng(0)
    return MinedLayer(
        coefficient={s: s * rng.random((keys, top), dtype=np.float32) for s in (1, -1)},
        sentence={s: rng.integers(0, 9, (keys, top)) for s in (1, -1)},
        position={s: rng.integers(0, 5, (keys, top)) for s in (1, -1)},
        histogram=rng.integers(0, 4, (keys, 43)),
        total=rng.random(keys),
        positions=17,
        sentences=4,
        sample_order=rng.integers(0, 2**40, (keys, 43, 2)),
        sample_position=rng.integers(0, 5, (keys, 43, 2)).astype(np.int16),
        sample_coefficient=rng.random((keys, 43, 2), dtype=np.float32),
    )


def _same(a: MinedLayer, b: MinedLayer) -> None:
    for sign in (1, -1):
        np.testing.assert_array_equal(a.coefficient[sign], b.coefficient[sign])
        np.testing.assert_array_equal(a.sentence[sign], b.sentence[sign])
        np.testing.assert_array_equal(a.position[sign], b.position[sign])
    np.testing.assert_array_equal(a.histogram, b.histogram)
    for name in ("sample_order", "sample_position", "sample_coefficient"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert (a.positions, a.sentences) == (b.positions, b.sentences)


def test_stored_layers_start_with_the_format_version_and_read_back():
    layer = _layer()
    data = layer.to_bytes()
    assert data[0] == FORMAT_VERSION == 3
    _same(MinedLayer.from_bytes(data), layer)


def test_a_version_2_row_of_an_ungated_layer_still_reads():
    layer = _layer()
    assert not layer.gated
    _same(MinedLayer.from_bytes(b"\x02" + layer.to_bytes()[1:]), layer)


def _without_samples(layer: MinedLayer) -> bytes:
    """The .npz archive of versions 0 and 1: the same arrays without the band samples."""
    without = MinedLayer(**{**vars(layer), **empty_samples(3)})
    archive = np.load(io.BytesIO(without.to_bytes()[1:]))
    buffer = io.BytesIO()
    np.savez(buffer, **{k: archive[k] for k in archive.files if not k.startswith("sample_")})
    return buffer.getvalue()


def test_rows_written_before_the_version_byte_or_the_samples_still_read():
    layer = _layer()
    legacy = _without_samples(layer)  # version 0 was the bare .npz archive, version 1 added the byte
    assert legacy[:2] == b"PK"
    expected = MinedLayer(**{**vars(layer), **empty_samples(3)})  # read with no band samples
    _same(MinedLayer.from_bytes(legacy), expected)
    _same(MinedLayer.from_bytes(b"\x01" + legacy), expected)


def test_an_unknown_version_is_refused_with_what_to_do():
    data = bytes([FORMAT_VERSION + 1]) + _layer().to_bytes()[1:]
    refused = r"format version 4; this ffmem reads versions 0 to 3\. Upgrade"
    with pytest.raises(MinedFormatError, match=refused):
        MinedLayer.from_bytes(data)
