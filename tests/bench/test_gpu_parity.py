"""bench.gpu's parity comparison tells a tie from an error for the quadrant examples as it does for the
top-T slots: two examples of equal |m| (within the tolerance) swapped differ but pass; a sentence that
is not among the reference's examples, or a right sentence at a wrong position, is unexplained and fails."""

from __future__ import annotations

import numpy as np
import pytest

from bench.gpu import compare, verdict
from ffmem.engine.mining.mined_layer import MinedLayer, empty_quadrants, empty_samples
from ffmem.engine.mining.state import MiningState

E = 8  # examples a quadrant (mined_layer.QUADRANT_EXAMPLES)
TIED = np.float32(2.0) * np.float32(1 - 1e-6)  # |m| within bench.gpu's 1e-4 of 2.0: a tie


def state(sentences: list[int], magnitudes: list[float], positions: list[int]) -> MiningState:
    """A one-key gated state whose quadrant pp holds these examples (the rest empty), beside fixed
    top-T lists of both signs."""
    quadrants = empty_quadrants(1)
    n = len(sentences)
    quadrants["quadrant_sentence"][0, 0, :n] = sentences
    quadrants["quadrant_coefficient"][0, 0, :n] = magnitudes  # pp: m > 0
    quadrants["quadrant_position"][0, 0, :n] = positions
    quadrants["quadrant_count"][0] = [6, 2, 1, 1]
    layer = MinedLayer(
        coefficient={1: np.array([[3.0, 1.0]], np.float32), -1: np.array([[-2.0, -1.0]], np.float32)},
        sentence={1: np.array([[4, 9]], np.int32), -1: np.array([[9, 4]], np.int32)},
        position={1: np.array([[1, 3]], np.int16), -1: np.array([[0, 2]], np.int16)},
        histogram=np.zeros((1, 43), np.int64),
        total=np.zeros(1),
        positions=10,
        sentences=2,
        **empty_samples(1),
        **quadrants,
    )
    return MiningState.from_layers([layer])


REFERENCE = ([4, 9], [2.0, TIED], [1, 3])
CASES = {  # got's examples: differing examples, of them unexplained, verdict
    "the same": (REFERENCE, 0, 0, True),
    "a tie swapped": (([9, 4], [TIED, 2.0], [3, 1]), 2, 0, True),
    "a sentence not listed": (([4, 8], [2.0, 1.5], [1, 3]), 1, 1, False),
    "a wrong position": (([4, 9], [2.0, TIED], [2, 3]), 1, 1, False),
    "an example missing": (([4], [2.0], [1]), 1, 1, False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_parity_tells_a_quadrant_tie_from_an_error(case):
    examples, differ, unexplained, passed = CASES[case]
    figures = compare(state(*REFERENCE), state(*examples))
    assert figures["quadrant_examples"] == 2
    assert figures["quadrant_examples_differ"] == differ
    assert figures["quadrant_examples_unexplained"] == unexplained
    assert figures["quadrant_positions_differ"] == 0
    assert figures["slots_differ"] == 0 and figures["slots_unexplained"] == 0
    figures.update(capture_max_abs=0.0, capture_rel=0.0)
    assert verdict(case, figures) is passed
