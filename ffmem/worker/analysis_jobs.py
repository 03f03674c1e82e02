"""The paper's analyses on a finished index run (`ffmem analyze`), stored per run in `analyses`:

- "agreement" (Figs. 4, 5), from the stored key statistics: per layer, the share of keys whose value's
  top token is the token after their top trigger, and the distribution of that token's rank;
- "census" (Figs. 7–11): the run's held-out sentences (ffmem.worker.held_out), one
  random prefix each, through ffmem.engine.paper.analyses.census;
- "token_removal" (Fig. 3): for a sample of keys per layer, their top trigger prefixes without their
  first and without their last token (ffmem.engine.paper.analyses.token_removal); per layer the mean changes,
  and per sampled key (in key_stats, read with the key page's statistics) the mean changes and a
  shallowness score: the share of its coefficient that removing the last token takes away (0–1).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
from sqlalchemy.orm import Session, sessionmaker
from stop_words import get_stop_words

from ffmem.engine.errors import FfmemError
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.paper.analyses import census, token_removal
from ffmem.store import analyses, corpora, memory_reads, vocabularies
from ffmem.store.models import Run, RunStatus
from ffmem.store.specs import AnalysisSpec
from ffmem.worker.held_out import held_out

RANK_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class AnalysisOptions:
    """What `analyze` computes (the job's spec) and how: prefixes per forward batch, a progress bar."""

    spec: AnalysisSpec
    batch: int = 8
    progress: bool = True

    def recorded(self) -> dict:
        """What each stored analysis records of how it was computed (`Analysis.options`)."""
        return self.spec.model_dump() | {"batch": self.batch, "progress": self.progress}


Report = Callable[[str, int, int], None]  # (analysis, batches done, batches in all)


def analyze(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: AnalysisOptions,
    report: Report | None = None,
) -> dict[str, float]:
    """Compute and store every analysis of run `run_id`, each in its own transaction; seconds per
    analysis. `report(analysis, done, total)` after each batch (a job renews its lease there)."""
    report = report or (lambda name, done, total: None)
    seconds = {}
    with sessions() as session:
        run = session.get(Run, run_id)
        if run is None or run.status != RunStatus.done:
            raise FfmemError(f"run {run_id} is not a finished index run")
        for name, compute in (
            ("agreement", _agreement),
            ("census", _census),
            ("token_removal", _token_removal),
        ):
            start = time.perf_counter()
            report(name, 0, 1)
            data = compute(session, run, loaded, options, partial(report, name))
            seconds[name] = time.perf_counter() - start
            analyses.store_analysis(
                session=session,
                run_id=run.id,
                name=name,
                options=options.recorded(),
                data=data,
                seconds=seconds[name],
            )
            session.commit()
    return seconds


def _agreement(session: Session, run: Run, loaded: LoadedModel, options: AnalysisOptions, report) -> dict:
    """Figs. 4–5 from the key statistics: rank 0 of the top trigger's next token is agreement."""
    rows = memory_reads.run_key_stats(session=session, run_id=run.id, columns=("layer", "next_token_rank"))
    by_layer: dict[int, list[int]] = {}
    for layer, rank in rows:
        if rank is not None and rank >= 0:
            by_layer.setdefault(layer, []).append(rank)
    layers = range(run.model.n_layers)
    ranks = [np.array(by_layer.get(layer, []), dtype=np.int64) for layer in layers]
    return {
        "keys": [int(r.size) for r in ranks],
        "agreement": [float((r == 0).mean()) if r.size else None for r in ranks],
        "baseline": 1 / run.model.vocab_size,
        "rank_quantiles": {
            str(q): [float(np.quantile(r, q)) if r.size else None for r in ranks] for q in RANK_QUANTILES
        },
        "rank_below": {
            str(n): [float((r < n).mean()) if r.size else None for r in ranks] for n in (1, 10, 100, 1000)
        },
    }


def _census(session: Session, run: Run, loaded: LoadedModel, options: AnalysisOptions, report) -> dict:
    corpus = run.corpus
    source = corpus.name if corpus.name == "wiki-vital" else corpus.source
    rng = random.Random(options.spec.seed)
    prefixes = [
        s.token_ids[: rng.randrange(s.first_position, len(s.token_ids)) + 1]
        for s in held_out(session, run, options.spec.examples, loaded)
        if len(s.token_ids) > s.first_position
    ]
    if not prefixes:
        raise FfmemError(
            f"{source} has no sentences beyond the {run.corpus.n_sentences:,} the run read, and it held none "
            "out of mining: none is held out"
        )
    value_top = torch.from_numpy(value_top_tokens(session, run.id, run.model.n_layers))  # [layers, 2, d_ff]
    stop = set(get_stop_words("en"))
    texts = vocabularies.stored_texts(session=session, model_id=run.model_id)
    stop_ids = {token_id for token_id, text in texts.items() if text.strip().lower() in stop}
    found = census(
        loaded, prefixes, value_top, stop_ids, batch=options.batch, progress=options.progress, on_batch=report
    )
    return asdict(found)


def _token_removal(session: Session, run: Run, loaded: LoadedModel, options: AnalysisOptions, report) -> dict:
    """Per layer the mean changes over the sampled keys' triggers; per key, stored in key_stats."""
    rng = random.Random(options.spec.seed)
    n_layers, n_keys = run.model.n_layers, run.model.n_keys
    triggers = [
        (layer, key, trigger)
        for layer in range(n_layers)
        for key in sorted(rng.sample(range(n_keys), min(options.spec.keys, n_keys)))
        for trigger in memory_reads.get_triggers(
            session=session, run_id=run.id, layer=layer, key=key, sign=1, limit=options.spec.triggers
        )
    ]
    sentences = corpora.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for _, _, t in triggers]
    )
    items = [
        (layer, key, sentences[t.sentence_index].token_ids[: t.position + 1]) for layer, key, t in triggers
    ]
    with loaded.lock:  # the tokenizer is shared with live traces
        first_position = 1 if loaded.bos_prepended else 0
    first, last = token_removal(
        loaded, items, first_position=first_position, batch=4 * options.batch,
        progress=options.progress, on_batch=report,
    )  # fmt: skip
    by_key: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    for (layer, key, _), first_change, last_change in zip(items, first, last, strict=True):
        firsts, lasts = by_key.setdefault((layer, key), ([], []))
        firsts += [] if first_change is None else [first_change]
        lasts += [] if last_change is None else [last_change]
    changes = {
        memory: (
            _mean(firsts),
            _mean(lasts),
            None if not lasts else float(np.clip(-np.mean(lasts), 0.0, 1.0)),
        )
        for memory, (firsts, lasts) in by_key.items()
    }
    analyses.store_token_removal(session=session, run_id=run.id, changes=changes)

    def layer_mean(which: int, layer: int) -> float | None:
        return _mean([x for (lay, _), values in by_key.items() if lay == layer for x in values[which]])

    return {
        "first": [layer_mean(0, layer) for layer in range(n_layers)],
        "last": [layer_mean(1, layer) for layer in range(n_layers)],
        "prefixes": len(items),
    }


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def value_top_tokens(session: Session, run_id: int, n_layers: int) -> np.ndarray:
    """[layers, 2, d_ff]: each value's top raw token (index 0, for m > 0) and bottom one (1, for m < 0)."""
    return np.stack(
        [
            np.concatenate(
                [
                    memory_reads.layer_value_tokens(
                        session=session, run_id=run_id, layer=layer, readout="raw", direction=direction, n=1
                    )[0].T  # [1, d_ff]
                    for direction in (1, -1)
                ]
            )
            for layer in range(n_layers)
        ]
    )
