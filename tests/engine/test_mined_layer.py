"""The stored format of a mined layer: a version byte, then the arrays; rows written before the byte
existed still read; an unknown version is refused with what to do."""

from __future__ import annotations

import numpy as np
import pytest

from ffmem.engine.mined_layer import FORMAT_VERSION, MinedFormatError, MinedLayer


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
    )


def _same(a: MinedLayer, b: MinedLayer) -> None:
    for sign in (1, -1):
        np.testing.assert_array_equal(a.coefficient[sign], b.coefficient[sign])
        np.testing.assert_array_equal(a.sentence[sign], b.sentence[sign])
        np.testing.assert_array_equal(a.position[sign], b.position[sign])
    np.testing.assert_array_equal(a.histogram, b.histogram)
    assert (a.positions, a.sentences) == (b.positions, b.sentences)


def test_stored_layers_start_with_the_format_version_and_read_back():
    layer = _layer()
    data = layer.to_bytes()
    assert data[0] == FORMAT_VERSION == 1
    _same(MinedLayer.from_bytes(data), layer)


def test_rows_written_before_the_version_byte_still_read():
    layer = _layer()
    legacy = layer.to_bytes()[1:]  # version 0 was the bare .npz archive
    assert legacy[:2] == b"PK"
    _same(MinedLayer.from_bytes(legacy), layer)


def test_an_unknown_version_is_refused_with_what_to_do():
    data = bytes([FORMAT_VERSION + 1]) + _layer().to_bytes()[1:]
    refused = r"format version 2; this ffmem reads versions 0 and 1\. Upgrade"
    with pytest.raises(MinedFormatError, match=refused):
        MinedLayer.from_bytes(data)
