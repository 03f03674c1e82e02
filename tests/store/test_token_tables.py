"""Explanations written in bulk: every pattern's token table packed at once is byte for byte what packing it
alone gives (the per-memory packer below, the layout of revision 0032: ids as wide as the pattern needs),
and a table stored before (revision 0024's layout, ids in int32) reads as it was written."""

from __future__ import annotations

import numpy as np
import pytest

from ffmem.store import composition


def packed_alone(pattern: dict) -> bytes:
    """One pattern's TOKEN_TABLE bytes, a memory at a time: the header (0x40 + 4 · width + sign + 1 in a
    byte, tokens and pairs uint16), the ids in `width` bytes little-endian (the fewest of 1 to 4 whose
    all-ones, −1, is above every id), the weights float16 (clipped to ±65,504), the pairs' ids in `width`
    bytes, their weights float16."""
    ids = [*pattern["final"], *(i for pair in pattern["pairs"] for i in pair)]
    width = next(w for w in (1, 2, 3, 4) if max(ids, default=0) + 1 < 256**w)
    header = bytes([0x40 + 4 * width + pattern["sign"] + 1])
    header += len(pattern["final"]).to_bytes(2, "little") + len(pattern["pairs"]).to_bytes(2, "little")
    limit = 65_504.0

    def packed_ids(values) -> bytes:
        return b"".join((i % 256**width).to_bytes(width, "little") for i in values)

    return (
        header
        + packed_ids(pattern["final"])
        + np.clip(np.asarray(pattern["weights"], np.float64), -limit, limit).astype("<f2").tobytes()
        + packed_ids(i for pair in pattern["pairs"] for i in pair)
        + np.clip(np.asarray(pattern["pair_weights"], np.float64), -limit, limit).astype("<f2").tobytes()
    )


def stored_before_0032(pattern: dict) -> bytes:
    """Revision 0024's layout: the header (sign int8, tokens and pairs uint16), the ids int32, the weights
    float16, the pairs' ids int32, their weights float16."""
    header = np.array(
        [(pattern["sign"], len(pattern["final"]), len(pattern["pairs"]))], composition.TOKEN_TABLE_HEADER
    )
    parts = [
        np.asarray(pattern["final"], np.int64).astype("<i4"),
        np.asarray(pattern["weights"], np.float64).astype("<f2"),
        np.asarray(pattern["pairs"], np.int64).reshape(-1).astype("<i4"),
        np.asarray(pattern["pair_weights"], np.float64).astype("<f2"),
    ]
    return header.tobytes() + b"".join(part.tobytes() for part in parts)


def random_patterns(rng: np.random.Generator, count: int) -> list[dict]:
    """Patterns of 0–64 tokens and 0–16 pairs, ids past 65,535, weights of every size (some beyond
    float16's range, infinite or NaN)."""
    patterns = []
    for _ in range(count):
        n, p = int(rng.integers(0, 65)), int(rng.integers(0, 17))
        weights = rng.normal(0.0, 10.0 ** rng.integers(-3, 7), n + p)  # [n + p]
        weights[rng.random(n + p) < 0.02] = np.inf
        weights[rng.random(n + p) < 0.02] = -np.inf
        weights[rng.random(n + p) < 0.01] = np.nan
        patterns.append(
            {
                "sign": int(rng.choice([-1, 1])),
                "final": rng.integers(0, 10 ** int(rng.integers(2, 10)), n).tolist(),  # 1 to 4 B ids
                "weights": weights[:n].tolist(),
                "pairs": rng.integers(-1, 10 ** int(rng.integers(2, 7)), (p, 2)).tolist(),  # −1: the start
                "pair_weights": weights[n:].tolist(),
            }
        )
    return patterns


@pytest.mark.parametrize("seed", range(3))
def test_token_tables_packed_at_once_are_each_patterns_alone_byte_for_byte(seed):
    patterns = random_patterns(np.random.default_rng(seed), 2000)
    packed = composition.pack_token_tables(patterns)
    assert packed == [packed_alone(pattern) for pattern in patterns]
    for pattern, data in zip(patterns[:200], packed, strict=False):  # and they read back
        found = composition.unpack_token_table(data)
        assert found["sign"] == pattern["sign"]
        assert found["final"] == pattern["final"] and found["pairs"] == pattern["pairs"]
        before = composition.unpack_token_table(stored_before_0032(found))  # as a table stored before reads
        assert repr(before) == repr(found)  # (NaN weights too)
    assert {data[0] for data in packed} == {0x40 + 4 * w + s + 1 for w in (1, 2, 3, 4) for s in (-1, 1)}
    same = [
        {
            "sign": 1,
            "final": [7] * 64,
            "weights": [0.5] * 64,
            "pairs": [[1, 2]] * 16,
            "pair_weights": [2.0] * 16,
        }
    ]
    assert composition.pack_token_tables(same * 3) == [packed_alone(same[0])] * 3  # one size: one array
    assert composition.pack_token_tables([]) == []


def test_a_pattern_without_a_weight_a_token_is_refused():
    pattern = {"sign": 1, "final": [1, 2], "weights": [0.5], "pairs": [], "pair_weights": []}
    with pytest.raises(ValueError, match="one weight a token"):
        composition.pack_token_tables([pattern])
