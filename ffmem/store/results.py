"""A run's results, one interface for the pages whether the run is stored or still mining.

`results_for(session, run)` gives `StoredResults` (the tables a finished run wrote) or `MiningResults`
(its mined layers so far — the snapshot of its merged shards and the running shards' checkpoints —
merged with numpy; no torch). Both answer the same questions with the same row types (unsaved
`Trigger` rows and unsaved `KeyStats` rows while mining), so no page branches on the run's state. Values are
projected when a run is prepared, so they are final already; triggers and statistics are provisional
until the run is stored, and only a stored run has its sentences shaded (its coefficient at every token).
How far a run still mining has come is ffmem.store.progress's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from sqlalchemy.orm import Session

from ffmem.engine.mining.mined_layer import MinedLayer
from ffmem.store import corpora, key_examples, layer_table, memory_lists, memory_reads, shards
from ffmem.store.key_examples import BandSample, QuadrantExample, StoredExamples
from ffmem.store.memory_lists import TRIGGERS, Trigger, ValueToken
from ffmem.store.models import QUADRANT_COLUMNS, KeyStats, Run, RunStatus


@dataclass(frozen=True)
class LayerFigures:
    """Per-layer statistics over the layer's keys (means unless named otherwise)."""

    layer: int
    keys: int
    positive_share: float | None
    density: float | None
    max_coefficient: float | None  # the largest over the layer's keys
    max_prob: float | None  # the largest value probability over the layer's keys
    mean_max_prob: float | None
    agreement_rate: float | None  # share of keys whose value's top token follows their top trigger
    agreeing_keys: int | None  # keys with at least one trigger followed by a top value token
    value_norm: float | None


@dataclass(frozen=True)
class Quadrants:
    """A gated key's sign quadrants (mined_layer.QUADRANTS order): the share of mined positions in each,
    and each one's top examples (by quadrant, then rank)."""

    shares: list[float]
    examples: list[QuadrantExample]


class RunResults(Protocol):
    """What the pages ask of a run's results."""

    def coverage(self, layer: int | None = None) -> float | None:
        """Share of the corpus the results cover (of one layer, or the least over all); None when stored."""

    def triggers(self, layer: int, key: int, sign: int, limit: int | None = None) -> list[Trigger]:
        """A key's triggers of one sign (+1, −1), strongest first."""

    def value_readouts(self, layer: int, key: int) -> dict[tuple[str, int], list[ValueToken]]:
        """Its value's top (+1) and bottom (−1) tokens per readout: (readout, direction) → rank order."""

    def layer_keys(
        self,
        layer: int,
        *,
        sort: str,
        descending: bool,
        offset: int,
        limit: int,
        token_ids: list[int] | None,
    ) -> tuple[int, list[KeyStats], dict[int, Trigger]]:
        """(keys that pass the filter, one page of their statistics, their top positive triggers)."""

    def key_stats(self, layer: int, key: int) -> KeyStats | None:
        """A key's statistics, its histogram counts included; None when the run has none for it."""

    def band_samples(self, layer: int, key: int) -> list[BandSample]:
        """A key's examples across its coefficient range (key_examples.BandSample), by bin then slot."""

    def shaded_triggers(self, layer: int, key: int) -> tuple[int, int]:
        """How many of a key's first positive and negative triggers have their sentences shaded ((0, 0)
        while the run mines, and for runs stored before 0011)."""

    def trigger_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray]:
        """Those shaded triggers' coefficients at every token of their sentences (of these lengths; NaN
        where the run does not mine): [length] each, positive triggers first."""

    def sample_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray] | None:
        """The band samples' coefficients at every token of their sentences, as `trigger_shading`; None
        when they are not shaded (while the run mines, and for runs stored before 0011)."""

    def quadrants(self, layer: int, key: int) -> Quadrants | None:
        """A gated key's sign quadrants; None for an ungated model (or a run stored before them)."""

    def layer_figures(self) -> list[LayerFigures]:
        """One row per layer for the model page."""


def results_for(session: Session, run: Run) -> RunResults:
    """The stored results of a finished run, the provisional ones of a run still mining."""
    return StoredResults(session, run) if run.status == RunStatus.done else MiningResults(session, run)


class StoredResults:
    """A finished run's results, read from its tables; a key's lists (triggers, value tokens) in one read."""

    def __init__(self, session: Session, run: Run) -> None:
        self.session, self.run = session, run
        self._lists: dict[tuple[int, int], dict[tuple[str, int], bytes]] = {}
        self._examples: dict[tuple[int, int], StoredExamples | None] = {}

    def _key_lists(self, layer: int, key: int) -> dict[tuple[str, int], bytes]:
        if (layer, key) not in self._lists:
            where = dict(session=self.session, run_id=self.run.id, layer=layer, key=key)
            self._lists[layer, key] = memory_reads.key_lists(**where)
        return self._lists[layer, key]

    def coverage(self, layer: int | None = None) -> float | None:
        return None

    def triggers(self, layer: int, key: int, sign: int, limit: int | None = None) -> list[Trigger]:
        data = self._key_lists(layer, key).get((TRIGGERS, sign))
        where = dict(run_id=self.run.id, layer=layer, key=key, sign=sign, limit=limit)
        return memory_lists.triggers_of(data, **where) if data else []

    def value_readouts(self, layer: int, key: int) -> dict[tuple[str, int], list[ValueToken]]:
        lists = self._key_lists(layer, key)
        return memory_lists.value_readouts(lists, run_id=self.run.id, layer=layer, key=key)

    def layer_keys(self, layer, *, sort, descending, offset, limit, token_ids):
        where = dict(session=self.session, run_id=self.run.id, layer=layer)
        total, stats = layer_table.layer_keys(
            **where, sort=sort, descending=descending, offset=offset, limit=limit, token_ids=token_ids
        )
        return total, stats, memory_reads.top_triggers(**where, keys=[s.key for s in stats])

    def key_stats(self, layer: int, key: int) -> KeyStats | None:
        return memory_reads.get_key_stats(session=self.session, run_id=self.run.id, layer=layer, key=key)

    def _key_examples(self, layer: int, key: int) -> StoredExamples | None:
        if (layer, key) not in self._examples:
            where = dict(session=self.session, run_id=self.run.id, layer=layer, key=key)
            self._examples[layer, key] = key_examples.key_examples(**where)
        return self._examples[layer, key]

    def band_samples(self, layer: int, key: int) -> list[BandSample]:
        found = self._key_examples(layer, key)
        return found.samples if found else []

    def shaded_triggers(self, layer: int, key: int) -> tuple[int, int]:
        found = self._key_examples(layer, key)
        return (found.positive, found.negative) if found else (0, 0)

    def trigger_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray]:
        found = self._key_examples(layer, key)
        return found.trigger_shading(lengths) if found else []

    def sample_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray] | None:
        found = self._key_examples(layer, key)
        return found.sample_shading(lengths) if found else None

    def quadrants(self, layer: int, key: int) -> Quadrants | None:
        stats, found = self.key_stats(layer, key), self._key_examples(layer, key)
        if stats is None or stats.dominant_quadrant is None or found is None or found.quadrants is None:
            return None
        return Quadrants(shares=quadrant_shares(stats), examples=found.quadrants)

    def layer_figures(self) -> list[LayerFigures]:
        figures = []
        for row in memory_reads.layer_summaries(session=self.session, run_id=self.run.id):
            values = row._asdict()
            if not values.pop("keys_with_agreement"):
                values["agreeing_keys"] = None  # runs stored before agreement was counted
            figures.append(LayerFigures(**values))
        return figures


class MiningResults:
    """A run still mining: its mined layers so far, merged with numpy once per layer and request."""

    def __init__(self, session: Session, run: Run) -> None:
        self.session, self.run = session, run
        self._mined: dict[int, MinedLayer | None] = {}

    def mined(self, layer: int) -> MinedLayer | None:
        """The layer as mined so far, over every stored part; None before the first checkpoint."""
        if layer not in self._mined:
            parts = shards.layer_parts(session=self.session, run_id=self.run.id, layer=layer)
            mined = [MinedLayer.from_bytes(data) for data in parts]
            merged = mined[0] if len(mined) == 1 else MinedLayer.merge(mined) if mined else None
            self._mined[layer] = merged
        return self._mined[layer]

    def coverage(self, layer: int | None = None) -> float | None:
        layers = range(self.run.model.n_layers) if layer is None else [layer]
        shares = [self._share(self.mined(n)) for n in layers]
        return min(shares) if shares else 0.0

    def _share(self, mined: MinedLayer | None) -> float:
        return 0.0 if mined is None or not self.run.n_sentences else mined.sentences / self.run.n_sentences

    def value_readouts(self, layer: int, key: int) -> dict[tuple[str, int], list[ValueToken]]:
        where = dict(run_id=self.run.id, layer=layer, key=key)
        lists = memory_reads.key_lists(session=self.session, **where, kinds=memory_lists.READOUTS)
        return memory_lists.value_readouts(lists, **where)

    def triggers(self, layer: int, key: int, sign: int, limit: int | None = None) -> list[Trigger]:
        mined = self.mined(layer)
        if mined is None:
            return []
        sentence = mined.sentence[sign][key]  # [T]
        rows = [
            Trigger(
                run_id=self.run.id,
                layer=layer,
                key=key,
                sign=sign,
                rank=rank,
                sentence_index=int(sentence[rank]),
                position=int(mined.position[sign][key, rank]),
                coefficient=float(mined.coefficient[sign][key, rank]),
            )
            for rank in range(len(sentence))
            if sentence[rank] >= 0
        ]
        return rows[:limit] if limit is not None else rows

    def layer_keys(self, layer, *, sort, descending, offset, limit, token_ids):
        mined = self.mined(layer)
        if mined is None:
            return 0, [], {}
        n_keys = mined.histogram.shape[0]
        high, low = extremes(mined)
        probs = self._max_probs(layer, n_keys)
        unknown = np.full(n_keys, np.nan)
        columns = {
            "key": np.arange(n_keys, dtype=float),
            "max_coefficient": high,
            "min_coefficient": low,
            "positive_share": mined.positive_share(),
            "density": mined.density(),
            "agreement": unknown,
            "max_prob": probs,
            "next_token_rank": unknown,
            "value_norm": unknown,
            "explanation": unknown,  # explained once the run is stored
        }
        shares = mined.quadrant_shares() if mined.gated else np.full((n_keys, 4), np.nan)  # [keys, 4]
        columns.update(zip(QUADRANT_COLUMNS, shares.T, strict=True))
        columns["dominant_quadrant"] = shares.argmax(axis=1).astype(float) if mined.gated else unknown
        if sort not in columns:
            raise ValueError(f"unknown sort {sort!r}; choose from {', '.join(layer_table.KEY_SORTS)}")
        keys = np.arange(n_keys)
        if token_ids is not None:
            promoting = memory_reads.promoting_keys(
                session=self.session, run_id=self.run.id, layer=layer, token_ids=token_ids
            )
            keys = np.array(promoting, dtype=np.int64)
        value = columns[sort][keys]  # NULLs (NaN) last, then by value, then by key
        missing = np.isnan(value)
        primary = np.where(missing, 0.0, -value if descending else value)
        within = (
            -shares.max(axis=1)[keys] if sort == "dominant_quadrant" else np.zeros(len(keys))
        )  # largest first
        page = keys[np.lexsort((keys, within, primary, missing))][offset : offset + limit]
        rows = [self._key_stats(mined, layer, int(key), probs[key]) for key in page]
        tops = {}
        for row in rows:
            found = self.triggers(layer, row.key, 1, limit=1)
            if found:
                tops[row.key] = found[0]
        return len(keys), rows, tops

    def band_samples(self, layer: int, key: int) -> list[BandSample]:
        mined = self.mined(layer)
        return [] if mined is None else key_examples.samples_of(mined, key)

    def shaded_triggers(self, layer: int, key: int) -> tuple[int, int]:
        return 0, 0

    def trigger_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray]:
        return []

    def sample_shading(self, layer: int, key: int, lengths: Sequence[int]) -> list[np.ndarray] | None:
        return None

    def quadrants(self, layer: int, key: int) -> Quadrants | None:
        mined = self.mined(layer)
        if mined is None or not mined.gated:
            return None
        shares = mined.quadrant_shares()[key].tolist()
        return Quadrants(shares=shares, examples=key_examples.quadrant_examples_of(mined, key))

    def key_stats(self, layer: int, key: int) -> KeyStats | None:
        """What is known so far; agreement over every positive trigger so far (no next-token rank or
        value norm until the run is stored)."""
        mined = self.mined(layer)
        if mined is None:
            return None
        raw_top = memory_reads.get_value_tokens(
            session=self.session, run_id=self.run.id, layer=layer, key=key, readout="raw", direction=1
        )
        stats = self._key_stats(mined, layer, key, raw_top[0].prob if raw_top else math.nan)
        positive = self.triggers(layer, key, 1)
        sentences = corpora.get_sentences(
            session=self.session, corpus_id=self.run.corpus_id, indices=[t.sentence_index for t in positive]
        )
        top_ids = {v.token_id for v in raw_top}
        following = [_next_token(sentences[t.sentence_index].token_ids, t.position) for t in positive]
        stats.agreement = sum(token in top_ids for token in following if token is not None)
        return stats

    def _key_stats(self, mined: MinedLayer, layer: int, key: int, max_prob: float) -> KeyStats:
        high, low = (float(x[key]) for x in extremes(mined))
        shares = mined.quadrant_shares()[key].tolist() if mined.gated else [None] * 4
        return KeyStats(
            run_id=self.run.id,
            layer=layer,
            key=key,
            mean=float(mined.mean()[key]),
            positive_share=float(mined.positive_share()[key]),
            max_coefficient=None if math.isnan(high) else high,
            min_coefficient=None if math.isnan(low) else low,
            value_norm=None,
            histogram=mined.histogram[key].tolist(),
            density=float(mined.density()[key]),
            max_prob=None if math.isnan(max_prob) else float(max_prob),
            agreement=None,
            next_token_rank=None,
            **dict(zip(QUADRANT_COLUMNS, shares, strict=True)),
            dominant_quadrant=int(np.argmax(shares)) if mined.gated else None,
        )

    def _max_probs(self, layer: int, n_keys: int) -> np.ndarray:
        """Each key's value's top raw probability (projected at prepare): [keys], NaN if not yet."""
        _, probs = memory_reads.layer_value_tokens(
            session=self.session, run_id=self.run.id, layer=layer, readout="raw", direction=1, n=1
        )
        return probs[:, 0] if probs.size else np.full(n_keys, np.nan)

    def layer_figures(self) -> list[LayerFigures]:
        figures = []
        for layer in range(self.run.model.n_layers):
            mined = self.mined(layer)
            if mined is None:
                continue
            high, _ = extremes(mined)
            probs = self._max_probs(layer, mined.histogram.shape[0])
            figures.append(
                LayerFigures(
                    layer=layer,
                    keys=mined.histogram.shape[0],
                    positive_share=float(mined.positive_share().mean()),
                    density=float(mined.density().mean()),
                    max_coefficient=None if np.isnan(high).all() else float(np.nanmax(high)),
                    max_prob=None if np.isnan(probs).all() else float(np.nanmax(probs)),
                    mean_max_prob=None if np.isnan(probs).all() else float(np.nanmean(probs)),
                    agreement_rate=None,
                    agreeing_keys=None,
                    value_norm=None,
                )
            )
        return figures


def has_results(session: Session, run: Run) -> bool:
    """Whether the run has anything the pages can show: stored, or mined so far."""
    return run.status == RunStatus.done or shards.has_layers(session=session, run_id=run.id)


def quadrant_shares(stats: KeyStats) -> list[float]:
    """A stored key's four quadrant shares, in mined_layer.QUADRANTS order."""
    return [getattr(stats, column) for column in QUADRANT_COLUMNS]


def extremes(mined: MinedLayer) -> tuple[np.ndarray, np.ndarray]:
    """(max, min) coefficient per key so far, NaN where no sentence was mined: [keys] each."""
    top, bottom = mined.coefficient[1][:, 0], mined.coefficient[-1][:, 0]
    return np.where(np.isfinite(top), top, np.nan), np.where(np.isfinite(bottom), bottom, np.nan)


def _next_token(token_ids: list[int], position: int) -> int | None:
    return token_ids[position + 1] if position + 1 < len(token_ids) else None
