"""Two finished runs side by side, computed once per pair by a worker (a job of kind "comparison") and
stored in `comparisons` / `key_changes` (ffmem.store.comparison); the page reads only those.

Per memory (b against a):
- the overlap of its top triggers, |A ∩ B| / max(|A|, |B|) over the first T of each run's top-T (T the
  smaller top-T of the two), positive and negative apart. In one corpus a trigger is its sentence index;
  across corpora its text: the prefix up to and including the trigger token (the same sentence in two
  corpora is then the same trigger when the key peaks at the same place in it);
- the change of its statistics (b − a: mean coefficient, positive share, max and min coefficient,
  density);
- the cosine of its key and of its value between the two runs' models (ffmem.engine.relations.comparison: a
  gated FF's key is its gate and up rows, compared apart and as their product), read from the weights: runs
  store neither their keys nor their values, and storing them (2 × 106 MB of keys for SmolLM2-135M)
  for the few pairs anyone compares would cost more than loading the two models once here. The models
  are loaded one after the other (`weights(run_id)`), never both at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from sqlalchemy.orm import sessionmaker

from ffmem.engine.errors import FfmemError
from ffmem.engine.relations.comparison import MemoryWeights, overlap, weight_cosines
from ffmem.store import comparison, corpora
from ffmem.store.models import Run

LAYER_MEANS = ("overlap", "negative_overlap", "key_cosine", "value_cosine")


def compare_runs(
    sessions: sessionmaker, run_a: int, run_b: int, weights: Callable[[int], MemoryWeights]
) -> int:
    """Compare two finished runs (either order) and store the result, replacing any; its id.
    `weights(run_id)`: the key and value rows of the model that built the run."""
    low, high, _ = comparison.pair(run_a, run_b)
    seconds = {}
    start = time.perf_counter()
    with sessions() as session:
        a, b = session.get(Run, low), session.get(Run, high)
        if a is None or b is None:
            raise FfmemError(f"run {low if a is None else high} does not exist (any more)")
        reason = comparison.why_not_comparable(a, b)
        if reason:
            raise FfmemError(reason)
        basis = comparison.basis(a, b)
        top_t = min(a.top_k, b.top_k)
        n_layers, n_keys, gated = a.model.n_layers, a.model.n_keys, a.model.gated
        overlaps = trigger_overlaps(session, a, b, basis, top_t)
        stats = [
            comparison.key_statistics(session=session, run_id=run.id, n_layers=n_layers, n_keys=n_keys)
            for run in (a, b)
        ]
        checksums = [run.provenance.get("weights_sha256") for run in (a, b)]
    seconds["triggers_and_statistics"] = time.perf_counter() - start

    start = time.perf_counter()
    first = weights(low)
    cosines = weight_cosines(first, weights(high))
    seconds["weights"] = time.perf_counter() - start

    changes = {
        "overlap": overlaps[1],
        "negative_overlap": overlaps[-1],
        "key_cosine": cosines.key,
        "gate_cosine": _or_nan(cosines.gate, cosines.key),
        "up_cosine": _or_nan(cosines.up, cosines.key),
        "value_cosine": cosines.value,
        "moved": cosines.moved,
        **{f"d_{name}": stats[1][name] - stats[0][name] for name in comparison.STATISTICS},
    }
    layers = [
        {"layer": layer}
        | {f"mean_{name}": _mean(changes[name][layer]) for name in LAYER_MEANS}
        | {"triggers_changed": int(np.sum(changes["overlap"][layer] < 1))}
        for layer in range(n_layers)
    ]
    details = {
        "keys": "gate and up rows: cos(g)·cos(u), and each apart" if gated else "key rows: cos(k)",
        "values": "value rows: cos(v)",
        "statistics": "b − a",
        "weights_sha256": checksums,
        "same_weights": checksums[0] is not None and checksums[0] == checksums[1],
        "seconds": seconds,
    }
    start = time.perf_counter()
    with sessions() as session:
        stored = comparison.store_comparison(
            session=session,
            run_a=low,
            run_b=high,
            basis=basis,
            top_t=top_t,
            layers=layers,
            details=details,
            seconds=sum(seconds.values()) + (time.perf_counter() - start),
            changes=changes,
        )
        session.commit()
    return stored


def trigger_overlaps(session, a: Run, b: Run, basis: str, top_t: int) -> dict[int, np.ndarray]:
    """sign (1, −1) → each key's trigger overlap between the runs, [layers, keys] (NaN: no triggers)."""
    n_layers, n_keys = a.model.n_layers, a.model.n_keys
    found = {sign: np.full((n_layers, n_keys), np.nan) for sign in (1, -1)}
    texts = [
        corpora.get_sentences(session=session, corpus_id=run.corpus_id, indices=range(run.corpus.n_sentences))
        if basis == "texts"
        else None
        for run in (a, b)
    ]
    for layer in range(n_layers):
        sets = []
        for run, sentences in zip((a, b), texts, strict=True):
            by_key: dict[tuple[int, int], list] = {}
            rows = comparison.top_triggers(session=session, run_id=run.id, layer=layer, top_t=top_t)
            for key, sign, sentence, position in rows:
                if sentences is None:
                    trigger = sentence
                else:  # the prefix up to and including the trigger token
                    trigger = sentences[sentence].text[: sentences[sentence].offsets[position][1]]
                by_key.setdefault((key, sign), []).append(trigger)
            sets.append(by_key)
        for sign in (1, -1):
            for key in range(n_keys):
                share = overlap(sets[0].get((key, sign), ()), sets[1].get((key, sign), ()))
                if share is not None:
                    found[sign][layer, key] = share
    return found


def _or_nan(array: np.ndarray | None, like: np.ndarray) -> np.ndarray:
    return np.full_like(like, np.nan) if array is None else array


def _mean(values: np.ndarray) -> float | None:
    kept = values[~np.isnan(values)]
    return float(kept.mean()) if kept.size else None
