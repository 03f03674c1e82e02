"""The corpus-independent work of an index on a CPU, new over old as ratios of one run (not a test):
`make bench` runs it.

1. Neighbours (ffmem.engine.relations.neighbours.nearest): the bf16 pools rescored exactly
   (ffmem.engine.relations.bf16_cosines) over the float32 block products (`nearest_on_device`, the path
   every CPU took before), by key and by value, on every memory of the default model (46,080 on
   SmolLM2-135M); the same neighbours (rows that differ, the largest similarity difference) and the rows
   recomputed whole.
2. Fitting (ffmem.engine.explanations.fitting): one layer's patterns at once (`fit_patterns`) over one
   call a pattern (`fit_pattern`, as the worker fitted them before), on random positions of the default
   index's shape (`--positions` a side, 2 × 1,536 sides), the same patterns.

Seconds are CPU seconds of this process (`time.process_time`) with one torch thread: on a shared machine a
ratio of one run says more than either time. Figures go into bench-results.json under "relations".
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench import harness
from ffmem.engine.explanations.fitting import CorpusCounts, fit_pattern, fit_patterns
from ffmem.engine.model.loading import load_model
from ffmem.engine.relations import bf16_cosines
from ffmem.engine.relations.neighbours import key_factors, nearest, nearest_on_device, value_factors


def _seconds(run):
    start = time.process_time()
    found = run()
    return time.process_time() - start, found


def neighbours(loaded) -> dict:
    whole = []
    recompute = bf16_cosines._exact_row
    bf16_cosines._exact_row = lambda *a: whole.append(a[2]) or recompute(*a)
    results = {}
    try:
        with torch.inference_mode():
            for kind, factors in (("key", key_factors), ("value", value_factors)):
                rows = factors(loaded)
                whole.clear()
                new_seconds, (index, similarity) = _seconds(lambda rows=rows: nearest(rows, 10))
                old_seconds, (old_index, old_similarity) = _seconds(
                    lambda rows=rows: nearest_on_device(rows, 10)
                )
                results[kind] = {
                    "old_seconds": round(old_seconds, 2),
                    "new_seconds": round(new_seconds, 2),
                    "ratio": round(old_seconds / new_seconds, 2),
                    "rows_differing": int((index != old_index).any(dim=1).sum()),
                    "max_similarity_difference": float((similarity - old_similarity).abs().max()),
                    "rows_recomputed_whole": len(whole),
                }
                harness.log(f"neighbours by {kind}: {results[kind]}")
    finally:
        bf16_cosines._exact_row = recompute
    return results


def fitting(positions: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab, sides = 49_152, 2 * 1536
    corpus = [rng.integers(0, vocab, 30).tolist() for _ in range(2000)]
    counts = CorpusCounts.of(corpus, vocab)
    lengths = rng.integers(positions // 2, 2 * positions, sides)
    signs = np.tile([1, -1], sides // 2)
    tokens = rng.choice(np.concatenate(corpus), lengths.sum())  # as the corpus has them
    previous = np.where(rng.random(len(tokens)) < 0.05, -1, rng.choice(np.concatenate(corpus), len(tokens)))
    m = rng.standard_normal(len(tokens)) + (tokens % 7 == 0)
    ends = np.cumsum(lengths)

    def one_by_one():
        return [
            fit_pattern(tokens[e - n : e], previous[e - n : e], m[e - n : e], int(s), counts)
            for e, n, s in zip(ends, lengths, signs, strict=True)
        ]

    old_seconds, old = _seconds(one_by_one)
    new_seconds, new = _seconds(lambda: fit_patterns(tokens, previous, m, lengths, signs, counts))
    results = {
        "positions": int(lengths.sum()),
        "old_seconds": round(old_seconds, 2),
        "new_seconds": round(new_seconds, 2),
        "ratio": round(old_seconds / new_seconds, 2),
        "same_patterns": all(a.to_dict() == b.to_dict() for a, b in zip(old, new, strict=True)),
    }
    harness.log(f"fitting one layer: {results}")
    return results


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--positions", type=int, default=700, help="fitting positions a side (median)")
    parser.add_argument("--cache", default="data/cache", help="the model cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"fitting": fitting(args.positions)}
    results["neighbours"] = neighbours(load_model(device="cpu", cache_dir=args.cache))
    harness.record(args, "relations", results)


if __name__ == "__main__":
    main()
