"""The scoring protocol's arithmetic alone (a benchmark, not a test) at SmolLM2's shape: LAYERS layers (the
first argument) × 1,536 keys, 1,000 held-out records of 26 tokens, patterns of 64 tokens + 16 pairs, both
sides and their controls; random coefficients in place of the model's (no model, no database).

    .venv/bin/python -m bench.protocol_arithmetic 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ffmem.engine.explanations.fitting import Pattern
from ffmem.engine.explanations.protocol import POLARITIES, ProtocolScores, TopRecords, random_records

KEYS, RECORDS, TOKENS, BATCH = 1536, 1000, 26, 150  # keys a layer; held-out records, their length, a batch


def patterns(rng: np.random.Generator, sign: int) -> list[Pattern]:
    return [
        Pattern(
            sign=sign,
            final=rng.choice(2000, 64, replace=False).tolist(),
            weights=rng.normal(size=64).round(3).tolist(),
            pairs=rng.integers(0, 2000, (16, 2)).tolist(),
            pair_weights=rng.normal(size=16).round(3).tolist(),
        )
        for _ in range(KEYS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("layers", type=int, nargs="?", default=3, help="layers of 1,536 keys (default 3)")
    layers = parser.parse_args().layers
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    sides = [[patterns(rng, sign) for _ in range(layers)] for sign in POLARITIES]
    ids = torch.from_numpy(rng.zipf(1.3, (RECORDS, TOKENS)) % 2000)  # [records, tokens]
    random = random_records(RECORDS, 20)
    batches = [torch.arange(i, min(i + BATCH, RECORDS)) for i in range(0, RECORDS, BATCH)]
    valid = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    valid[:, 0] = False  # position 0 is never scored
    start, cpu = time.perf_counter(), time.process_time()
    top = TopRecords(layers, KEYS, 20, random, RECORDS)
    for chosen in batches:
        for layer in range(layers):
            top.update(layer, torch.randn(len(chosen), TOKENS, KEYS), valid[: len(chosen)], chosen)
    first = time.perf_counter()
    scores = ProtocolScores(sides, torch.ones(2, layers, KEYS), top.records(), random, RECORDS)
    for chosen in batches:
        for layer in range(layers):
            coefficients = torch.randn(len(chosen), TOKENS, KEYS)  # [batch, tokens, keys]
            scores.update(layer, coefficients, ids[chosen], valid[: len(chosen)], chosen)
    second = time.perf_counter()
    for side in range(len(POLARITIES)):
        for layer in range(layers):
            scores.scores(side, layer)
    end = time.perf_counter()
    print(
        f"{layers} layers: first pass {first - start:.1f} s, second {second - first:.1f} s, "
        f"scores {end - second:.1f} s; wall {end - start:.1f} s, CPU {time.process_time() - cpu:.1f} s "
        f"({torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
