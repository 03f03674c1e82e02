"""A synthetic index: a finished run of any shape (layers × keys, vocabulary, top-T …) written through the
store's own writers, as the index build writes one, with no model — random but seeded, with realistic sizes
and distributions: coefficients of both signs, token ids spread over the whole vocabulary (ids above 65,535
when it is larger), band samples and shading, statistics with some NULLs, each value's logit histogram,
neighbours, the weight graph, explanations and the arrays of token search. tests/web/test_wide_model.py
checks the pages at a wide shape; bench.scale times them at the shapes of real models.

Every array of a layer comes from `layer_arrays(shape, layer)` (seeded by the shape's seed and the layer),
so a test can compute what a page must show; the run is written one layer at a time (memory-bounded).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
from sqlalchemy import text
from sqlalchemy.orm import Session

from ffmem.engine.explanations.fitting import MAX_PAIRS, MAX_TOKENS
from ffmem.engine.mining.mined_layer import (
    N_BINS,
    QUADRANT_EXAMPLES,
    SAMPLES,
    ZERO_BIN,
    MinedLayer,
    density,
    histogram_edges,
)
from ffmem.engine.mining.mined_layer import positive_share as share_above_zero
from ffmem.store import (
    composition,
    corpora,
    key_examples,
    memory_search,
    memory_writes,
    runs,
    value_histograms,
    vocabularies,
)
from ffmem.store.memory_lists import TOKEN_LISTS

READOUTS = ("raw", "norm")
NEIGHBOURS = 10  # per memory and kind, as engine.neighbours.NEIGHBOURS
LINKS = 10  # per memory and direction, as engine.weight_graph.TOP
HISTOGRAM_BINS = 32  # per value and readout, as engine.projection.HISTOGRAM_BINS


@dataclass(frozen=True)
class Shape:
    """What the synthetic run holds: its model's shape and the run's options."""

    slug: str
    n_layers: int
    n_keys: int
    vocab_size: int
    d_model: int
    top_k: int = 50  # triggers per key and sign
    value_tokens: int = 30  # top and bottom tokens per value and readout
    sentences: int = 1000
    sentence_tokens: int = 24  # the longest sentence; the shortest is half as long
    shaded_triggers: int = 10  # triggers of each sign whose sentences are shaded
    band_bins: int = 8  # occupied histogram bins per key, each with SAMPLES band samples
    token_memories: int = 32  # memories per token and list in the token → memories table (0: none)
    seed: int = 0

    @property
    def memories(self) -> int:
        return self.n_layers * self.n_keys


def token_text(token_id: int) -> str:
    """The synthetic vocabulary's decoded text of a token: unique, every other one with a leading space."""
    return f"{' ' if token_id % 2 == 0 else ''}w{token_id}"


def sentence_tokens(shape: Shape) -> list[list[int]]:
    """Every sentence's token ids (lengths from sentence_tokens / 2 to sentence_tokens)."""
    rng = np.random.default_rng([shape.seed, 1])
    lengths = rng.integers(max(2, shape.sentence_tokens // 2), shape.sentence_tokens + 1, shape.sentences)
    return [rng.integers(0, shape.vocab_size, int(n)).tolist() for n in lengths]


@dataclass
class LayerArrays:
    """One layer as the index build stores it ([keys, …] arrays)."""

    triggers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]  # sign → (coefficient, sentence, position)
    values: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]  # (readout, direction) → (token ids, logits)
    log_z: dict[str, np.ndarray]  # readout → [keys]
    stats: dict[str, np.ndarray]  # store_key_stats' arguments
    mined: MinedLayer  # its triggers, histogram and band samples
    neighbours: dict[str, tuple[np.ndarray, np.ndarray]]  # kind → (memory indices, cosines) [keys, k]
    links: dict[
        str, tuple[np.ndarray, np.ndarray, np.ndarray]
    ]  # direction → (layers, keys, scores) [keys, n]
    histograms: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict
    )  # readout → (low [keys], high [keys], counts [keys, bins]): each value's logits over the vocabulary


def _distinct_ids(rng: np.random.Generator, rows: int, n: int, vocab: int) -> np.ndarray:
    """[rows, n] token ids, distinct within each row, uniform over the vocabulary."""
    ids = rng.integers(0, vocab, (rows, n))
    ordered = np.sort(ids, axis=1)
    for row in np.flatnonzero((np.diff(ordered, axis=1) == 0).any(axis=1)):
        ids[row] = rng.choice(vocab, n, replace=False)
    return ids


def _ranked(rng: np.random.Generator, shape: tuple[int, int], loc: float, scale: float) -> np.ndarray:
    """[rows, n] float32, each row sorted descending."""
    return -np.sort(-rng.normal(loc, scale, shape).astype(np.float32), axis=1)


def layer_arrays(shape: Shape, layer: int, lengths: np.ndarray) -> LayerArrays:
    """The layer's arrays (`lengths`: each sentence's length)."""
    rng = np.random.default_rng([shape.seed, 2, layer])
    keys, t, n = shape.n_keys, min(shape.top_k, shape.sentences), shape.value_tokens
    # Triggers: T distinct sentences per key and sign, the strongest first, anywhere in their sentence.
    triggers = {}
    for sign in (1, -1):
        sentence = np.argpartition(rng.random((keys, shape.sentences), np.float32), t - 1, axis=1)[:, :t]
        position = (rng.random((keys, t)) * lengths[sentence]).astype(np.int16)
        scale = rng.lognormal(0.5, 0.6, (keys, 1)).astype(np.float32)  # each key's own range
        magnitude = -np.sort(-np.abs(rng.normal(0.0, 1.0, (keys, t)).astype(np.float32)) * scale, axis=1)
        triggers[sign] = (sign * magnitude, sentence.astype(np.int32), position)
    # Value tokens: the top tokens' logits descending, the bottom ones' ascending; log Z above the top.
    values, log_z = {}, {}
    for readout in READOUTS:
        top = _ranked(rng, (keys, n), 4.0, 1.5) + np.float32(4.0)
        bottom = -_ranked(rng, (keys, n), 4.0, 1.5) - np.float32(4.0)
        values[readout, 1] = (_distinct_ids(rng, keys, n, shape.vocab_size), top)
        values[readout, -1] = (_distinct_ids(rng, keys, n, shape.vocab_size), bottom)
        log_z[readout] = (top[:, 0] + rng.uniform(0.2, 4.0, keys)).astype(np.float32)
    # Statistics: a histogram over every mined position, both signs; the figures read off it.
    positions = int(lengths.sum())
    weights = rng.gamma(0.6, 1.0, (keys, N_BINS)) * (rng.random((keys, N_BINS)) < 0.5)
    weights[:, ZERO_BIN - 3 : ZERO_BIN + 4] += 1.0  # mass near 0 for every key
    histogram = np.floor(weights / weights.sum(axis=1, keepdims=True) * positions).astype(np.int64)
    agreement = rng.integers(0, t + 1, keys)
    next_token_rank = rng.integers(-1, 5000, keys)  # −1: no token after the top trigger (NULL)
    max_prob = np.exp(values["raw", 1][1][:, 0].astype(np.float64) - log_z["raw"])
    stats = dict(
        mean=rng.normal(-0.05, 0.05, keys),
        positive_share=share_above_zero(histogram, positions),
        max_coefficient=triggers[1][0][:, 0].copy(),
        min_coefficient=triggers[-1][0][:, 0].copy(),
        value_norm=rng.lognormal(0.0, 0.3, keys).astype(np.float32),
        histogram=histogram,
        density=density(histogram, positions),
        max_prob=max_prob,
        agreement=agreement,
        next_token_rank=next_token_rank,
    )
    # Band samples: SAMPLES sentences in each of `band_bins` occupied bins.
    order = np.full((keys, N_BINS, SAMPLES), np.iinfo(np.int64).max, np.int64)
    sample_position = np.zeros((keys, N_BINS, SAMPLES), np.int16)
    sample_coefficient = np.zeros((keys, N_BINS, SAMPLES), np.float32)
    bins = np.argsort(-(histogram + rng.random(histogram.shape)), axis=1)[:, : shape.band_bins]  # [keys, B]
    rows = np.arange(keys)[:, None]
    sentences = rng.integers(0, shape.sentences, (keys, shape.band_bins, SAMPLES))
    for slot in range(SAMPLES):
        order[rows, bins, slot] = sentences[:, :, slot]
        sample_position[rows, bins, slot] = (rng.random(bins.shape) * lengths[sentences[:, :, slot]]).astype(
            np.int16
        )
        octave = np.where(bins > ZERO_BIN, bins - ZERO_BIN - 11, ZERO_BIN - bins - 11)  # the bin's lower edge
        magnitude = np.exp2(octave + rng.random(bins.shape)).astype(np.float32)
        signed = np.where(bins > ZERO_BIN, magnitude, -magnitude)
        sample_coefficient[rows, bins, slot] = np.where(bins == ZERO_BIN, 0.0, signed)  # the zero bin: +0
    quadrants = _quadrants(shape, layer, lengths, positions)
    stats["quadrant_shares"] = quadrants["quadrant_count"] / positions
    mined = MinedLayer(
        coefficient={sign: triggers[sign][0] for sign in (1, -1)},
        sentence={sign: triggers[sign][1] for sign in (1, -1)},
        position={sign: triggers[sign][2] for sign in (1, -1)},
        histogram=histogram,
        total=stats["mean"] * positions,
        positions=positions,
        sentences=shape.sentences,
        sample_order=order,
        sample_position=sample_position,
        sample_coefficient=sample_coefficient,
        **quadrants,
    )
    # Neighbours (any layer) and links (earlier layers in, later ones out), strongest first.
    memories = shape.memories
    neighbours = {
        kind: (
            rng.integers(0, memories, (keys, NEIGHBOURS)),
            _ranked(rng, (keys, NEIGHBOURS), 0.2, 0.1).clip(-1, 1),
        )
        for kind in ("key", "value")
    }
    links = {}
    for direction, (low, high) in (("in", (0, layer)), ("out", (layer + 1, shape.n_layers))):
        if low >= high:  # no earlier (later) layer: empty slots
            empty = np.full((keys, LINKS), -1, np.int16)
            links[direction] = (empty, np.zeros((keys, LINKS), np.int32), np.zeros((keys, LINKS), np.float32))
            continue
        scores = _ranked(rng, (keys, LINKS), 0.0, 1.0)
        scores = scores[np.arange(keys)[:, None], np.argsort(-np.abs(scores), axis=1)]
        links[direction] = (
            rng.integers(low, high, (keys, LINKS)).astype(np.int16),
            rng.integers(0, keys, (keys, LINKS)).astype(np.int32),
            scores,
        )
    return LayerArrays(
        triggers, values, log_z, stats, mined, neighbours, links, _histograms(shape, layer, values)
    )


def _quadrants(shape: Shape, layer: int, lengths: np.ndarray, positions: int) -> dict[str, np.ndarray]:
    """A gated layer's quadrant arrays (MinedLayer's): Dirichlet shares of the positions, and
    QUADRANT_EXAMPLES sentences a quadrant, |m| descending, the signs of m and the input the quadrant's
    (its own generator: the layer's other arrays stay as they were)."""
    rng = np.random.default_rng([shape.seed, 5, layer])
    keys, e = shape.n_keys, QUADRANT_EXAMPLES
    count = np.floor(rng.dirichlet([0.8] * 4, keys) * positions).astype(np.int64)  # [keys, 4]
    sentence = rng.integers(0, shape.sentences, (keys, 4, e)).astype(np.int32)
    position = (rng.random((keys, 4, e)) * lengths[sentence]).astype(np.int16)
    magnitude = -np.sort(-rng.lognormal(0.0, 0.7, (keys, 4, e)), axis=2).astype(np.float32)
    input_sign = np.array([1, -1, 1, -1], np.float32)[:, None]  # [4, 1]
    gate_sign = np.array([1, 1, -1, -1], np.float32)[:, None]
    magnitude_in = rng.lognormal(0.0, 0.5, (keys, 4, e)).astype(np.float32)
    return {
        "quadrant_count": count,
        "quadrant_coefficient": magnitude * input_sign * gate_sign,
        "quadrant_sentence": sentence,
        "quadrant_position": position,
        "quadrant_input": magnitude_in * input_sign,
    }


def _histograms(
    shape: Shape, layer: int, values: dict
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each value's logit histogram per readout: from its bottom token's logit to its top one's, a bell of
    the whole vocabulary (its own generator: the layer's other arrays stay as they were)."""
    rng = np.random.default_rng([shape.seed, 4, layer])
    bell = np.exp(-0.5 * ((np.arange(HISTOGRAM_BINS) - 0.45 * HISTOGRAM_BINS) / (HISTOGRAM_BINS / 8)) ** 2)
    found = {}
    for readout in READOUTS:
        low, high = values[readout, -1][1][:, 0], values[readout, 1][1][:, 0]  # [keys] each
        counts = rng.multinomial(shape.vocab_size - 2, bell / bell.sum(), size=shape.n_keys)  # [keys, bins]
        counts[:, 0] += 1  # the bottom token
        counts[:, -1] += 1  # the top token
        found[readout] = (low.copy(), high.copy(), counts)
    return found


def _shading(
    rng: np.random.Generator, arrays: LayerArrays, lengths: np.ndarray, shaded: int
) -> key_examples.LayerShading:
    """store_key_examples' shading: per key, each shaded sentence's coefficient at every token (its
    trigger's or sample's coefficient at its position, smaller ones elsewhere)."""
    mined = arrays.mined
    keys = mined.histogram.shape[0]
    kept = mined.sample_sentence >= 0  # [keys, bins, SAMPLES]: row-major is samples_of's order
    parts = []  # per kind (positive, negative, samples): counts [keys], then sentence, position, coefficient
    for sign in (1, -1):
        coefficient, sentence, position = (a[:, :shaded].reshape(-1) for a in arrays.triggers[sign])
        parts.append((np.full(keys, shaded), sentence, position, coefficient))
    parts.append(
        (
            kept.sum(axis=(1, 2)),
            mined.sample_sentence[kept],
            mined.sample_position[kept],
            mined.sample_coefficient[kept],
        )
    )
    counts = np.stack([part[0] for part in parts], axis=1)  # [keys, 3]
    owner = np.concatenate([np.repeat(np.arange(keys), part[0]) for part in parts])  # [sentences] kind-major
    order = np.argsort(owner, kind="stable")  # key-major, each key's kinds in order
    sentence, position, coefficient = (np.concatenate([part[i] for part in parts])[order] for i in (1, 2, 3))
    spans = lengths[sentence]  # [sentences]
    offsets = np.concatenate([[0], np.cumsum(spans)])  # [sentences + 1]
    values = rng.normal(0.0, 0.3, int(offsets[-1])).astype(np.float32)  # [tokens]
    values[offsets[:-1] + position] = coefficient
    return key_examples.LayerShading(values, offsets, counts)


@dataclass
class Written:
    """What writing the run took: its id, and the seconds of each part."""

    run_id: int
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # this process's CPU time (all threads)
    server_cpu_seconds: dict[str, float] = field(default_factory=dict)  # Postgres's backend's (a local one)


def server_clock(session: Session) -> Callable[[], float]:
    """The CPU seconds so far of the Postgres backend serving the session (read from /proc: a server on
    this machine), or of none (always 0: SQLite's work is this process's)."""
    if session.connection().dialect.name != "postgresql":
        return lambda: 0.0
    pid = session.scalar(text("SELECT pg_backend_pid()"))
    stat = Path(f"/proc/{pid}/stat")
    if not stat.exists():
        return lambda: 0.0
    tick = os.sysconf("SC_CLK_TCK")

    def seconds() -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    return seconds


def write_run(session: Session, shape: Shape, report: Callable[[str], None] | None = None) -> Written:
    """Write a finished run of `shape` (its model, vocabulary and corpus too, each once per database),
    committing a layer at a time."""
    return write_runs([session], shape, report)[0]


def write_runs(
    sessions: Sequence[Session], shape: Shape, report: Callable[[str], None] | None = None
) -> list[Written]:
    """Write the same finished run of `shape` into each session's database (SQLite and Postgres, say), its
    arrays generated once and written to each in turn; one Written per session, whose figures are of all
    the sessions together."""
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    server: dict[str, float] = {}
    clocks = [server_clock(session) for session in sessions]

    def server_seconds() -> float:
        return sum(clock() for clock in clocks)

    clock = [time.process_time(), server_seconds()]

    def timed(name: str, start: float) -> float:
        now, cpu_now, server_now = time.perf_counter(), time.process_time(), server_seconds()
        seconds[name] = seconds.get(name, 0.0) + now - start
        cpu[name] = cpu.get(name, 0.0) + cpu_now - clock[0]
        server[name] = server.get(name, 0.0) + server_now - clock[1]
        clock[:] = cpu_now, server_now
        return now

    start = time.perf_counter()
    texts = [token_text(i) for i in range(shape.vocab_size)]
    token_ids = sentence_tokens(shape)
    lengths = np.array([len(ids) for ids in token_ids])
    run_ids = [_start_run(session, shape, texts, token_ids) for session in sessions]
    targets = list(zip(sessions, run_ids, strict=True))  # (session, its run's id)

    def each(store: Callable[..., object], **arguments) -> None:
        for session, run_id in targets:
            store(session=session, run_id=run_id, **arguments)

    def commit() -> None:
        for session in sessions:
            session.commit()

    start = timed("model, vocabulary, corpus", start)
    rng = np.random.default_rng([shape.seed, 3])
    neighbours = {kind: ([], []) for kind in ("key", "value")}
    links = {direction: ([], [], []) for direction in composition.DIRECTIONS}
    positive = []  # per layer: (memory, sentence, position, coefficient) [keys, T] each
    for layer in range(shape.n_layers):
        arrays = layer_arrays(shape, layer, lengths)
        start = timed("generating", start)
        for (readout, direction), (ids, logits) in arrays.values.items():
            each(
                memory_writes.store_value_tokens, layer=layer, readout=readout, direction=direction,
                token_ids=ids, logits=logits, log_z=arrays.log_z[readout],
            )  # fmt: skip
        start = timed("value tokens", start)
        each(value_histograms.store_value_histograms, layer=layer, histograms=arrays.histograms)
        start = timed("value histograms", start)
        for sign, (coefficient, sentence, position) in arrays.triggers.items():
            each(
                memory_writes.store_triggers, layer=layer, sign=sign, coefficients=coefficient,
                sentence_index=sentence, position=position,
            )  # fmt: skip
        coefficient, sentence, position = arrays.triggers[1]
        memory = layer * shape.n_keys + np.arange(shape.n_keys)[:, None].repeat(sentence.shape[1], axis=1)
        positive.append((memory, sentence, position, coefficient))
        start = timed("triggers", start)
        each(memory_writes.store_key_stats, layer=layer, **arrays.stats)
        start = timed("key stats", start)
        shading = _shading(rng, arrays, lengths, min(shape.shaded_triggers, shape.top_k, shape.sentences))
        start = timed("generating", start)
        each(key_examples.store_key_examples, layer=layer, mined=arrays.mined, shading=shading)
        commit()
        start = timed("key examples", start)
        for kind, (indices, cosines) in arrays.neighbours.items():
            neighbours[kind][0].append(indices)
            neighbours[kind][1].append(cosines)
        for direction, parts in arrays.links.items():
            for kept, part in zip(links[direction], parts, strict=True):
                kept.append(part)
        if report:
            report(f"layer {layer + 1}/{shape.n_layers} written")
    flat = (np.concatenate([a.ravel() for a in part]) for part in zip(*positive, strict=True))
    memory, sentence, position, coefficient = flat
    each(
        memory_writes.store_sentence_triggers, memory=memory, sentence_index=sentence, position=position,
        coefficient=coefficient,
    )  # fmt: skip
    commit()
    start = timed("triggers", start)
    stacked = {kind: (np.concatenate(i), np.concatenate(c)) for kind, (i, c) in neighbours.items()}
    each(
        memory_search.store_neighbours, n_keys=shape.n_keys, neighbours=stacked,
        baselines={kind: [(20_000, 0.05, 0.2)] * shape.n_layers for kind in stacked},
    )  # fmt: skip
    commit()
    start = timed("neighbours", start)
    each(
        composition.store_links,
        links={direction: tuple(np.stack(part) for part in parts) for direction, parts in links.items()},
    )
    commit()
    start = timed("links", start)
    explanations = _explanations(shape, lengths)
    for _ in range(shape.n_layers):  # a layer's rows made (generating), then stored
        rows = list(islice(explanations, shape.n_keys))
        start = timed("generating", start)
        each(composition.store_explanations, rows=rows)
        start = timed("explanations", start)
    commit()
    start = timed("explanations", start)
    if shape.token_memories:
        for readout in READOUTS:
            memories, scores = token_table(shape, readout)
            start = timed("generating", start)
            each(memory_search.store_token_memories, readout=readout, memories=memories, scores=scores)
            start = timed("token table", start)
        commit()
        start = timed("token table", start)
    each(runs.finish_run, n_tokens=int(lengths.sum()))
    commit()
    timed("closing", start)
    return [Written(run_id, seconds, cpu, server) for run_id in run_ids]


def _start_run(session: Session, shape: Shape, texts: list[str], token_ids: list[list[int]]) -> int:
    """The run's model, vocabulary and corpus (each once per database) and the run itself, running: its id."""
    model = runs.upsert_model(
        session=session,
        slug=shape.slug,
        source=f"synthetic:{shape.slug}",
        revision=None,
        architecture="SyntheticForCausalLM",
        family="llama",
        n_layers=shape.n_layers,
        n_keys=shape.n_keys,
        d_model=shape.d_model,
        vocab_size=shape.vocab_size,
        activation="silu",
        gated=True,
    )
    vocabularies.store_vocabulary(
        session=session, model_id=model.id, texts=texts, pieces=[t.replace(" ", "Ġ") for t in texts]
    )
    fingerprint = f"synthetic-{shape.slug}-{shape.sentences}-{shape.sentence_tokens}-{shape.seed}"
    corpus = corpora.find_corpus(session=session, fingerprint=fingerprint)
    if corpus is None:
        corpus = corpora.store_corpus(
            session=session,
            name="synthetic",
            source="synthetic",
            source_sha256="0" * 64,
            fingerprint=fingerprint,
            tokenizer=shape.slug,
            max_tokens=shape.sentence_tokens,
            skipped={},
            sentences=(_sentence(ids, texts) for ids in token_ids),
        )
    run = runs.create_run(
        session=session,
        model_id=model.id,
        corpus_id=corpus.id,
        top_k=shape.top_k,
        n_value_tokens=shape.value_tokens,
        n_sentences=shape.sentences,
        dtype="float32",
        device="cpu",
        package_version="synthetic",
        provenance={"first_position": True, "synthetic": shape.slug},
        histogram_edges=histogram_edges(),
    )
    session.commit()
    return run.id


def _sentence(ids: list[int], texts: list[str]) -> tuple[str, list[int], list[tuple[int, int]], int]:
    """(text, token ids, offsets, first position) of a sentence of these tokens."""
    offsets, at = [], 0
    for token_id in ids:
        offsets.append((at, at + len(texts[token_id])))
        at += len(texts[token_id])
    return "".join(texts[t] for t in ids), ids, offsets, 0


def _explanation_draws(shape: Shape) -> Iterator[tuple[np.ndarray, ...]]:
    """Each layer's random draws for its explanations: tokens, weights, pairs' previous tokens, scores."""
    rng = np.random.default_rng([shape.seed, 4])
    n, pairs = MAX_TOKENS, MAX_PAIRS
    for _ in range(shape.n_layers):
        finals = rng.integers(0, shape.vocab_size, (shape.n_keys, n))
        weights = rng.normal(0.0, 0.5, (shape.n_keys, n + pairs))
        before = rng.integers(0, shape.vocab_size, (shape.n_keys, pairs))
        yield finals, weights, before, rng.uniform(-0.1, 0.9, shape.n_keys)


def explanation_scores(shape: Shape, layer: int) -> np.ndarray:
    """[keys] the scores of a layer's explanations as stored (NaN: every 10th key's, stored unscored)."""
    for at, (_, _, _, scores) in enumerate(_explanation_draws(shape)):
        if at == layer:
            return np.where(np.arange(shape.n_keys) % 10 == 0, np.nan, scores)
    raise ValueError(f"the shape has no layer {layer}")


def _explanations(shape: Shape, lengths: np.ndarray) -> Iterator[tuple]:
    """One explanation per memory: (layer, key, source, text, score, pattern, details); the pattern a token
    table of the explainer's size (explanations.MAX_TOKENS tokens, MAX_PAIRS pairs; weights to 3 digits).
    A layer at a time in numpy: the texts joined as string arrays, the patterns' lists views of the
    layer's arrays, one details dict for all (few objects for the collector to walk)."""
    n, pairs = MAX_TOKENS, MAX_PAIRS
    details = {"positions": int(lengths.sum()) // 10, "matches": 40, "auroc": 0.7}
    signs = np.where(np.arange(shape.n_keys) % 2, 1, -1).tolist()  # [keys]
    for layer, (finals, weights, before, scores) in enumerate(_explanation_draws(shape)):
        digits = 10.0 ** (2 - np.floor(np.log10(np.abs(weights))))  # [keys, n + pairs]: 3 significant
        three = np.round(weights * digits) / digits  # as float(f"{w:.3g}"), 5 million at once
        texts = _explanation_texts(finals, three)  # [keys]
        tables = np.stack([before, finals[:, :pairs]], axis=2)  # [keys, pairs, 2]: (previous, token)
        scores = np.where(np.arange(shape.n_keys) % 10 == 0, None, scores.astype(object)).tolist()
        for key, (said, sign, score) in enumerate(zip(texts, signs, scores, strict=True)):
            pattern = {
                "sign": sign,
                "final": finals[key],
                "weights": three[key, :n],
                "pairs": tables[key],
                "pair_weights": three[key, n:],
            }
            yield layer, key, "heuristic", said, score, pattern, details


def _explanation_texts(finals: np.ndarray, three: np.ndarray, shown: int = 6) -> list[str]:
    """[keys] a layer's texts: its `shown` first tokens with their weights (3 digits, signed), the count of
    the others, the last token as what it promotes; numpy's string functions over the layer at once."""
    add = np.strings.add
    weights = np.array([format(w, "+.3g") for w in three[:, :shown].ravel().tolist()])
    weights = weights.reshape(len(finals), shown)  # [keys, shown]
    ids = finals[:, :shown].astype(str)  # [keys, shown]
    text = np.full(len(finals), "strongest (m > 0) at ")
    for at in range(shown):
        text = add(add(add(add(text, ", “w" if at else "“w"), ids[:, at]), "” "), weights[:, at])
    last = finals[:, -1]  # [keys]: token_text's form, a leading space on even ids
    promoted = add(np.where(last % 2 == 0, " w", "w"), last.astype(str))
    text = add(add(add(text, f"; {finals.shape[1] - shown} more weighed; promotes “"), promoted), "”")
    return text.tolist()


def token_table(shape: Shape, readout: str) -> tuple[np.ndarray, np.ndarray]:
    """One readout's token → memories table as the worker stores it: (memories, scores) [vocab, lists,
    depth] in memory_lists.TOKEN_LISTS order — distinct memories per list; logits falling (promoting) or
    rising (suppressing) from the first, log-probabilities likewise, below 0."""
    rng = np.random.default_rng([shape.seed, 5, READOUTS.index(readout)])
    vocab, depth, n = shape.vocab_size, shape.token_memories, shape.memories
    start = rng.integers(0, n, (vocab, len(TOKEN_LISTS), 1)).astype(np.int32)
    stride = rng.integers(1, max(2, n // depth), (vocab, len(TOKEN_LISTS), 1)).astype(np.int32)
    # distinct while depth · stride < n; below 2 n < 2**31, so int32 all along (a tenth of int64's time)
    memories = (start + stride * np.arange(depth, dtype=np.int32)) % np.int32(n)  # [vocab, lists, depth]
    steps = rng.exponential(0.05, (vocab, len(TOKEN_LISTS), depth)).astype(np.float32).cumsum(axis=2)
    scores = np.empty_like(steps)  # [vocab, lists, depth]
    for index, (by, direction) in enumerate(TOKEN_LISTS):
        # logits about 0; log-probabilities −3 (strong) to −20 (weak): center + direction · (8 − step)
        center = np.float32(0.0 if by == "logit" else -11.5)
        part = np.subtract(np.float32(8.0), steps[:, index], out=scores[:, index])  # [vocab, depth]
        if direction < 0:
            np.negative(part, out=part)
        np.add(part, center, out=part)
    return memories, scores
