"""One layer's mining result as plain numpy arrays (no torch): the format in which checkpoints and a
run's snapshot are stored, one row per layer, so the web process can read provisional results.

Also the statistics read off the coefficient histogram, in one place for the engine and the web:
the bin edges, the share of positive coefficients and the density.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

SIGNS = (1, -1)  # +1: highest coefficients; −1: most negative
OCTAVES = 21  # magnitude bins per sign: |m| < 2^-9, [2^-9, 2^-8), …, [2^9, 2^10), ≥ 2^10
ZERO_BIN = OCTAVES  # +0.0 (and positive subnormals) sit between the negative and positive bins
DENSITY_OCTAVES = 3  # density: positions within this many octaves of a key's peak |coefficient|
N_BINS = 2 * OCTAVES + 1  # histogram bins (see histogram_edges)
SAMPLES = 2  # band samples kept per key and histogram bin
# A band sample's order key is priority << 32 | sentence (priority: a 31-bit hash of sentence, layer and
# key); the lowest keys of a bin are kept. An empty slot holds the largest int64, above every real key.
EMPTY_SAMPLE = np.iinfo(np.int64).max
# A gated memory's coefficient m = act(x·g)·(x·u) has a gate act(x·g) and an input x·u: its four sign
# quadrants, the gate's sign first (p: ≥ 0, n: < 0). A position's quadrant number is 2·(gate < 0) + (input
# < 0); m's sign in each is the product's: + in pp and nn, − in pn and np (so |m| ranks them all).
QUADRANTS = ("pp", "pn", "np", "nn")
QUADRANT_SIGNS = (1, -1, -1, 1)
QUADRANT_EXAMPLES = 8  # top sentences kept per key and quadrant, by |m| there
# The stored format: one version byte, then an .npz archive. Bump it when the arrays change; a row
# written before the byte existed starts with the zip signature (b"PK") and is read as version 0.
FORMAT_VERSION = 3  # 2: band samples; 3: gated quadrants
_ZIP_SIGNATURE = b"PK"


class MinedFormatError(ValueError):
    """A stored mined layer in a format this version cannot read."""


def histogram_edges() -> list[float]:
    """Bin edges shared by every key: −2^10 … −2^-9, 0, 0, 2^-9 … 2^10 (43 bins).

    Bins 0…20 hold negative coefficients by magnitude (bin 0: m ≤ −2^10, bin 20: −2^-9 < m ≤ −0.0),
    bin 21 holds +0.0 exactly, bins 22…42 positive ones (bin 22: 0 < m < 2^-9, bin 42: m ≥ 2^10).
    A value exactly on an edge goes to the bin of larger magnitude. Bins are read straight off the
    float's sign and exponent bits, which keeps the histogram cheap enough to take over every
    mined position; the positive share is the mass of bins 22…42.
    """
    magnitudes = [2.0**e for e in range(-9, 11)]  # 20 edges per sign
    return [-m for m in reversed(magnitudes)] + [0.0, 0.0] + magnitudes


def positive_share(histogram: np.ndarray, positions: int) -> np.ndarray:
    """Share of positions with m > 0, per key: [keys, bins] → [keys]."""
    return histogram[:, ZERO_BIN + 1 :].sum(axis=-1) / max(positions, 1)


def density(histogram: np.ndarray, positions: int, octaves: int = DENSITY_OCTAVES) -> np.ndarray:
    """Share of positions whose |m| lies in the key's top `octaves` occupied magnitude octaves.

    With the default 3: the positions where the memory fires within about 1/8 of its peak
    |coefficient|, either sign. Exact on the histogram's octave bins; 0 for a key never mined.
    """
    magnitude = histogram[:, :ZERO_BIN][:, ::-1] + histogram[:, ZERO_BIN + 1 :]  # [keys, octaves]
    octave = np.arange(OCTAVES)  # [octaves]
    peak = np.where(magnitude > 0, octave, -1).max(axis=-1, keepdims=True)  # [keys, 1]
    near_peak = (octave > peak - octaves) & (peak >= 0)  # [keys, octaves]
    return (magnitude * near_peak).sum(axis=-1) / max(positions, 1)  # [keys]


@dataclass
class MinedLayer:
    """A layer's running top-T per sign (coefficients, sentences, positions) and key statistics.

    Empty slots have sentence −1 and coefficient −inf (sign +1) or +inf (sign −1).
    """

    coefficient: dict[int, np.ndarray]  # sign → [keys, T] float32
    sentence: dict[int, np.ndarray]  # sign → [keys, T] int32
    position: dict[int, np.ndarray]  # sign → [keys, T] int16 (sentences are at most 4,096 tokens)
    histogram: np.ndarray  # [keys, bins] int64
    total: np.ndarray  # [keys] float64: the sum of every coefficient
    positions: int  # positions mined
    sentences: int  # sentences mined
    # Band samples (examples across the range): per key and histogram bin, the SAMPLES sentences of
    # lowest order key (see EMPTY_SAMPLE) among those whose extreme coefficient — the sentence maximum
    # where it is > 0 (positive bins), the minimum where it is < 0 (negative bins) — falls in the bin.
    sample_order: np.ndarray  # [keys, bins, SAMPLES] int64, EMPTY_SAMPLE where empty
    sample_position: np.ndarray  # [keys, bins, SAMPLES] int16: where the extreme is
    sample_coefficient: np.ndarray  # [keys, bins, SAMPLES] float32: the extreme
    # Gated FFs only (None otherwise): per key and quadrant (QUADRANTS) the positions mined in it, and its
    # top QUADRANT_EXAMPLES sentences by their largest |m| among the quadrant's positions (|m| descending,
    # then sentence ascending; sentence −1 and coefficient 0 where empty), with the input x·u there.
    quadrant_count: np.ndarray | None = None  # [keys, 4] int64
    quadrant_coefficient: np.ndarray | None = None  # [keys, 4, E] float32: m (signed)
    quadrant_sentence: np.ndarray | None = None  # [keys, 4, E] int32
    quadrant_position: np.ndarray | None = None  # [keys, 4, E] int16
    quadrant_input: np.ndarray | None = None  # [keys, 4, E] float32: x·u (the gate is m / (x·u))

    @property
    def sample_sentence(self) -> np.ndarray:
        """[keys, bins, SAMPLES] int64: each band sample's sentence, −1 where empty."""
        return np.where(self.sample_order == EMPTY_SAMPLE, -1, self.sample_order & 0xFFFFFFFF)

    @property
    def gated(self) -> bool:
        return self.quadrant_count is not None

    def quadrant_shares(self) -> np.ndarray:
        """[keys, 4]: the share of mined positions in each quadrant (gated layers only)."""
        return self.quadrant_count / max(self.positions, 1)

    @property
    def top_k(self) -> int:
        return self.coefficient[1].shape[1]

    def to_bytes(self) -> bytes:
        arrays = {
            "histogram": self.histogram,
            "total": self.total,
            "counts": np.array([self.positions, self.sentences]),
            "sample_order": self.sample_order,
            "sample_position": self.sample_position,
            "sample_coefficient": self.sample_coefficient,
        }
        for sign in SIGNS:
            arrays[f"coefficient{sign:+d}"] = self.coefficient[sign]
            arrays[f"sentence{sign:+d}"] = self.sentence[sign]
            arrays[f"position{sign:+d}"] = self.position[sign]
        if self.gated:
            arrays.update({name: getattr(self, name) for name in QUADRANT_ARRAYS})
        buffer = io.BytesIO()
        buffer.write(bytes([FORMAT_VERSION]))
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> MinedLayer:
        if data[:2] == _ZIP_SIGNATURE:
            archive = data  # version 0: no version byte, the arrays of version 1
        elif data[:1] in (b"\x01", b"\x02", bytes([FORMAT_VERSION])):
            archive = data[1:]  # version 1: no band samples (read as empty); 2: no quadrants (None)
        else:
            version = data[0] if data else None
            raise MinedFormatError(
                f"a stored mined layer has format version {version}; this ffmem reads versions 0 to "
                f"{FORMAT_VERSION}. Upgrade ffmem, or delete the run and index it again."
            )
        with np.load(io.BytesIO(archive)) as arrays:
            positions, sentences = (int(n) for n in arrays["counts"])
            keys = arrays["histogram"].shape[0]
            samples = (
                {name: arrays[name] for name in ("sample_order", "sample_position", "sample_coefficient")}
                if "sample_order" in arrays
                else empty_samples(keys)
            )
            return cls(
                coefficient={sign: arrays[f"coefficient{sign:+d}"] for sign in SIGNS},
                sentence={sign: arrays[f"sentence{sign:+d}"] for sign in SIGNS},
                position={sign: arrays[f"position{sign:+d}"] for sign in SIGNS},
                histogram=arrays["histogram"],
                total=arrays["total"],
                positions=positions,
                sentences=sentences,
                **samples,
                **{name: arrays[name] for name in QUADRANT_ARRAYS if name in arrays},
            )

    @classmethod
    def merge(cls, parts: list[MinedLayer]) -> MinedLayer:
        """The layer mined over every part's sentences (parts cover disjoint sentences): per key, the
        top-T of all parts by s·m descending, then sentence ascending — the engine's order."""
        first = parts[0]
        coefficient, sentence, position = {}, {}, {}
        for sign in SIGNS:
            values = np.concatenate([sign * p.coefficient[sign] for p in parts], axis=1)  # [keys, Σ T]
            sentences = np.concatenate([p.sentence[sign] for p in parts], axis=1)  # [keys, Σ T]
            positions = np.concatenate([p.position[sign] for p in parts], axis=1)  # [keys, Σ T]
            tie = np.where(sentences < 0, np.iinfo(np.int64).max, sentences)  # empty slots last
            order = np.lexsort((tie, -values), axis=-1)[:, : first.top_k]  # [keys, T]
            coefficient[sign] = sign * np.take_along_axis(values, order, axis=1)
            sentence[sign] = np.take_along_axis(sentences, order, axis=1)
            position[sign] = np.take_along_axis(positions, order, axis=1)
        quadrants = _merge_quadrants(parts) if first.gated else {}
        sample_order = np.concatenate([p.sample_order for p in parts], axis=-1)  # [keys, bins, Σ S]
        kept = np.argsort(sample_order, axis=-1, kind="stable")[..., :SAMPLES]  # [keys, bins, S]
        return cls(
            coefficient=coefficient,
            sentence=sentence,
            position=position,
            histogram=sum(p.histogram for p in parts),
            total=sum(p.total for p in parts),
            positions=sum(p.positions for p in parts),
            sentences=sum(p.sentences for p in parts),
            sample_order=np.take_along_axis(sample_order, kept, axis=-1),
            **{
                name: np.take_along_axis(
                    np.concatenate([getattr(p, name) for p in parts], axis=-1), kept, axis=-1
                )
                for name in ("sample_position", "sample_coefficient")
            },
            **quadrants,
        )

    def mean(self) -> np.ndarray:
        return self.total / max(self.positions, 1)  # [keys]

    def positive_share(self) -> np.ndarray:
        return positive_share(self.histogram, self.positions)  # [keys]

    def density(self) -> np.ndarray:
        return density(self.histogram, self.positions)  # [keys]


QUADRANT_ARRAYS = (
    "quadrant_count", "quadrant_coefficient", "quadrant_sentence", "quadrant_position", "quadrant_input"
)  # fmt: skip


def _merge_quadrants(parts: list[MinedLayer]) -> dict[str, np.ndarray]:
    """The quadrant arrays of merged parts: counts add up; per key and quadrant the top examples of all
    parts by |m| descending, then sentence ascending, empty slots last."""
    joined = {
        name: np.concatenate([getattr(p, name) for p in parts], axis=-1)  # [keys, 4, Σ E]
        for name in QUADRANT_ARRAYS[1:]
    }
    sentence = joined["quadrant_sentence"]
    tie = np.where(sentence < 0, np.iinfo(np.int64).max, sentence)  # [keys, 4, Σ E]
    magnitude = np.where(sentence < 0, -1.0, np.abs(joined["quadrant_coefficient"]))  # [keys, 4, Σ E]
    order = np.lexsort((tie, -magnitude), axis=-1)[..., :QUADRANT_EXAMPLES]  # [keys, 4, E]
    merged = {name: np.take_along_axis(a, order, axis=-1) for name, a in joined.items()}
    return {"quadrant_count": sum(p.quadrant_count for p in parts), **merged}


def empty_quadrants(keys: int) -> dict[str, np.ndarray]:
    """The quadrant arrays of a gated layer with nothing mined."""
    shape = (keys, len(QUADRANTS), QUADRANT_EXAMPLES)
    return {
        "quadrant_count": np.zeros((keys, len(QUADRANTS)), dtype=np.int64),
        "quadrant_coefficient": np.zeros(shape, dtype=np.float32),
        "quadrant_sentence": np.full(shape, -1, dtype=np.int32),
        "quadrant_position": np.zeros(shape, dtype=np.int16),
        "quadrant_input": np.zeros(shape, dtype=np.float32),
    }


def empty_samples(keys: int) -> dict[str, np.ndarray]:
    """The band-sample arrays of a layer with nothing mined (also what a version-1 row reads as)."""
    shape = (keys, N_BINS, SAMPLES)
    return {
        "sample_order": np.full(shape, EMPTY_SAMPLE, dtype=np.int64),
        "sample_position": np.zeros(shape, dtype=np.int16),
        "sample_coefficient": np.zeros(shape, dtype=np.float32),
    }
