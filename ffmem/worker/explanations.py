"""The memories' explanations, computed once per run by `compose` (ffmem.worker.composition): for every
memory a token table fitted on its shaded sentences (ffmem.engine.explanations.fitting.fit_pattern; on its top
triggers alone for runs stored before the shading) and a short description of it (`describe`: the tokens
and pairs that move its coefficient, its value's top tokens, its shallowness), or one written by a local
model when `explainer_url` is set (ffmem.worker.explainer), scored on the run's held-out sentences
(ffmem.worker.held_out), the same ones the census analysis samples (worker/analysis_jobs.py),
`explain_sentences` of them, and stored (ffmem.store.composition). A run with none held out leaves the
explanations unscored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
import numpy as np
import torch
from sqlalchemy.orm import sessionmaker
from tqdm.auto import tqdm

from ffmem.config import Settings
from ffmem.engine.errors import FfmemError
from ffmem.engine.explanations.description import describe
from ffmem.engine.explanations.fitting import (
    START,
    CorpusCounts,
    Pattern,
    dominant_sign,
    fit_pattern,
    previous_tokens,
)
from ffmem.engine.explanations.scoring import PatternScores
from ffmem.engine.mining.corpus import length_bucketed_batches
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.store import composition, corpora, memory_reads, vocabularies
from ffmem.store.key_examples import StoredExamples, layer_shading
from ffmem.store.models import Run
from ffmem.store.specs import CompositionSpec, RunSpec
from ffmem.worker.explainer import PROMPT_PREFIXES, PROMPT_TOKENS, Evidence, LocalExplainer
from ffmem.worker.held_out import held_out
from ffmem.worker.leases import Heartbeat, checked_commit

if TYPE_CHECKING:
    from ffmem.worker.index import IndexOptions

HEURISTIC = "heuristic"


@dataclass
class ExplanationOptions:
    """How the explanations are written and scored (`compose` takes them): held-out sentences, batch size, the
    optional local explainer; besides the run and its model (defaults: the settings of the same names)."""

    explain_sentences: int = Settings.model_fields["explain_sentences"].default
    batch_tokens: int = Settings.model_fields["batch_tokens"].default
    explainer_url: str = ""
    explainer_model: str = ""
    explainer_timeout: float = Settings.model_fields["explainer_timeout"].default
    progress: bool = False

    @classmethod
    def of(cls, spec: RunSpec | CompositionSpec, worker: IndexOptions) -> ExplanationOptions:
        """An index or composition job's: what its spec says, with the explainer its worker reaches."""
        return cls(
            explain_sentences=spec.explain_sentences,
            batch_tokens=spec.batch_tokens,
            explainer_url=worker.explainer_url,
            explainer_model=spec.explainer_model,
            explainer_timeout=worker.explainer_timeout,
            progress=worker.progress,
        )

    @classmethod
    def from_settings(cls, settings: Settings, progress: bool = False) -> ExplanationOptions:
        return cls(
            explain_sentences=settings.explain_sentences,
            batch_tokens=settings.batch_tokens,
            explainer_url=settings.explainer_url,
            explainer_model=settings.explainer_model,
            explainer_timeout=settings.explainer_timeout,
            progress=progress,
        )


def store_explanations(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ExplanationOptions,
    client: httpx.Client | None = None,
    lease: Heartbeat | None = None,
) -> dict:
    """Describe every memory of the run, score the descriptions on held-out sentences and store them
    (committed after `lease` is checked, when there is one); what was stored, with each part's seconds.
    A layer at a time: its memories' evidence is gathered, described (and, with a local explainer, sent
    to it) and let go, so that what stays for every memory (131,072 at Llama-3.2-1B) is its description."""
    timings = {}
    start = time.perf_counter()
    run = _RunInputs.read(sessions, run_id, loaded)
    explainer = None
    if options.explainer_url or client is not None:
        explainer = LocalExplainer(
            options.explainer_url,
            options.explainer_model,
            options.explainer_timeout,
            loaded.tokenizer,
            run.texts,
            client,
        )
    timings["describe_seconds"] = time.perf_counter() - start
    descriptions, failures = _describe_layers(sessions, run, explainer, options, timings)

    start = time.perf_counter()
    with sessions() as session:
        held = held_out(session, session.get(Run, run_id), options.explain_sentences, loaded)
    n_layers, n_keys = run.signs.shape
    patterns = [[descriptions[layer, key][1].pattern for key in range(n_keys)] for layer in range(n_layers)]
    scores = score_patterns(loaded, patterns, run.fires_at, held, options)
    timings["score_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    rows = _rows(descriptions, scores, scored=bool(held))
    with sessions() as session:
        composition.delete_explanations(session=session, run_id=run_id)
        composition.store_explanations(session=session, run_id=run_id, rows=rows)
        checked_commit(session, lease)
        summary = composition.explanation_summary(session=session, run_id=run_id)
    timings["store_seconds"] = time.perf_counter() - start
    correlations = np.array([r[4] for r in rows if r[4] is not None], dtype=np.float64)
    aurocs = np.array([r[6]["auroc"] for r in rows if r[6]["auroc"] is not None], dtype=np.float64)
    return (
        summary
        | timings
        | {
            "held_out_sentences": len(held),
            "held_out_positions": scores[0][0].positions if held and scores and scores[0] else 0,
            "median_score": float(np.median(correlations)) if correlations.size else None,
            "median_auroc": float(np.median(aurocs)) if aurocs.size else None,
            "explainer_failures": failures,
        }
    )


@dataclass
class _RunInputs:
    """What describing a run's memories reads once: its corpus, its vocabulary (as text and as shown), and
    per memory its dominant sign, the coefficient it counts as firing at, its shallowness."""

    run_id: int
    sentences: list[list[int]]
    texts: list[str]  # [vocab]: each token's text
    names: list[str]  # [vocab]: each token as the pages show it (byte tokens as ⟨0x80⟩)
    signs: np.ndarray  # [layers, keys] int64: ±1
    fires_at: torch.Tensor  # [layers, keys]: half the strongest coefficient of the dominant sign (NaN: none)
    shallowness: dict[tuple[int, int], float | None]
    counts: CorpusCounts

    @classmethod
    def read(cls, sessions: sessionmaker, run_id: int, loaded: LoadedModel) -> _RunInputs:
        with sessions() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise FfmemError(f"there is no run {run_id}")
            n_layers, n_keys = run.model.n_layers, run.model.n_keys
            sentences = corpora.load_sentence_tokens(session=session, corpus_id=run.corpus_id)
            vocabulary = vocabularies.stored_texts(session=session, model_id=run.model_id)
            size = max(len(loaded.tokenizer), max(vocabulary, default=0) + 1)
            texts = [vocabulary.get(i, "") for i in range(size)]
            shown = vocabularies.vocabulary(session=session, model_id=run.model_id)
            stats = memory_reads.run_key_stats(
                session=session,
                run_id=run_id,
                columns=("layer", "key", "max_coefficient", "min_coefficient", "shallowness"),
            )
        signs = np.ones((n_layers, n_keys), dtype=np.int64)
        fires_at = torch.full((n_layers, n_keys), float("nan"))
        shallowness = {}
        for layer, key, largest, smallest, shallow in stats:
            signs[layer, key] = sign = dominant_sign(largest, smallest)
            strongest = largest if sign > 0 else smallest
            if strongest is not None and sign * strongest > 0:
                fires_at[layer, key] = sign * strongest / 2
            shallowness[layer, key] = shallow
        names = [shown.get(i, text) for i, text in enumerate(texts)]
        return cls(
            run_id,
            sentences,
            texts,
            names,
            signs,
            fires_at,
            shallowness,
            CorpusCounts.of(sentences, len(texts)),
        )


def _describe_layers(
    sessions: sessionmaker,
    run: _RunInputs,
    explainer: LocalExplainer | None,
    options: ExplanationOptions,
    timings: dict[str, float],
) -> tuple[dict[tuple[int, int], tuple[str, object]], int]:
    """Every memory's description, a layer at a time: (source, description) by (layer, key), and how many
    the local explainer failed to write (those keep the heuristic one)."""
    descriptions, failures = {}, 0
    n_layers, n_keys = run.signs.shape
    for layer in tqdm(range(n_layers), desc="describing", unit="layer", disable=not options.progress):
        start = time.perf_counter()
        evidence = _layer_evidence(sessions, run, layer)
        for found in evidence:
            descriptions[found.layer, found.key] = (HEURISTIC, found.heuristic)
        timings["describe_seconds"] += time.perf_counter() - start
        if explainer is not None:
            start = time.perf_counter()
            for found in evidence:
                written = explainer.describe(found)
                if written is None:
                    failures += 1
                else:
                    source = f"llm:{options.explainer_model or 'default'}"
                    descriptions[found.layer, found.key] = (source, written)
            timings["explainer_seconds"] = timings.get("explainer_seconds", 0.0) + time.perf_counter() - start
    return descriptions, failures


def _layer_evidence(sessions: sessionmaker, run: _RunInputs, layer: int) -> list[Evidence]:
    """What describes each memory of one layer: its pattern fitted on its shaded sentences, its value's
    top tokens, its shallowness, the ends of its strongest trigger prefixes, the heuristic description."""
    n_keys = run.signs.shape[1]
    with sessions() as session:
        triggers = {
            sign: memory_reads.layer_triggers(session=session, run_id=run.run_id, layer=layer, sign=sign)
            for sign in (1, -1)
        }
        shaded = layer_shading(session=session, run_id=run.run_id, layer=layer)
        value_ids, _ = memory_reads.layer_value_tokens(
            session=session, run_id=run.run_id, layer=layer, readout="norm", direction=1, n=5
        )
    by_key = {sign: _by_key(found, n_keys) for sign, found in triggers.items()}
    evidence = []
    for key in range(n_keys):
        sign = int(run.signs[layer, key])
        found = {s: by_key[s][key] for s in (1, -1)}
        pattern = fit_pattern(*_fitting_positions(shaded.get(key), found, run.sentences), sign, run.counts)
        values = value_ids[key].tolist() if key < len(value_ids) else []
        shallow = run.shallowness.get((layer, key))
        prefixes = [  # what a prompt shows: the ends of the strongest trigger prefixes
            run.sentences[s][max(p + 1 - PROMPT_TOKENS, 0) : p + 1]
            for s, p, _ in found[sign][:PROMPT_PREFIXES]
        ]
        heuristic = describe(pattern, values, shallow, run.names)
        evidence.append(Evidence(layer, key, prefixes, values, shallow, heuristic))
    return evidence


def _rows(descriptions: dict, scores: list, *, scored: bool) -> list[tuple]:
    """The stored rows: (layer, key, source, text, correlation, pattern, score details) of every memory."""
    rows = []
    for layer, layer_scores in enumerate(scores):
        for key, score in enumerate(layer_scores):
            source, description = descriptions[layer, key]
            details = score.details() if scored else {"positions": 0, "matches": 0, "auroc": None}
            pattern = description.pattern.to_dict()
            rows.append((layer, key, source, description.text, score.correlation, pattern, details))
    return rows


def _by_key(found, n_keys: int) -> list[list[tuple[int, int, float]]]:
    """A layer's triggers of one sign as (sentence, position, coefficient) per key, the strongest first."""
    triggers: list[list[tuple[int, int, float]]] = [[] for _ in range(n_keys)]
    for key, sentence, position, coefficient in zip(
        found.key.tolist(),
        found.entries["sentence_index"].tolist(),
        found.entries["position"].tolist(),
        found.entries["coefficient"].tolist(),
        strict=True,
    ):
        triggers[key].append((sentence, position, coefficient))
    return triggers


def _fitting_positions(
    stored: StoredExamples | None, triggers: dict[int, list], sentences: list[list[int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, previous tokens, coefficients) of the mined positions a memory's pattern is fitted on:
    every mined token of its shaded sentences (its first positive and negative triggers', its band
    samples'; each sentence once), or — for a run stored before the shading — its top triggers of both
    signs alone."""
    if stored is None:
        found = [(s, p, c) for sign in (1, -1) for s, p, c in triggers[sign]]
        tokens = np.array([sentences[s][p] for s, p, _ in found], dtype=np.int64)
        previous = np.array([sentences[s][p - 1] if p else START for s, p, _ in found], dtype=np.int64)
        return tokens, previous, np.array([c for _, _, c in found], dtype=np.float64)
    shown = [s for s, _, _ in triggers[1][: stored.positive]] + [
        s for s, _, _ in triggers[-1][: stored.negative]
    ]
    shown += [sample.sentence_index for sample in stored.samples]
    arrays = stored.shading([len(sentences[s]) for s in shown])
    tokens, previous, m, seen = [], [], [], set()
    for sentence, values in zip(shown, arrays, strict=True):
        if sentence in seen:
            continue
        seen.add(sentence)
        ids = np.asarray(sentences[sentence], dtype=np.int64)
        mined = ~np.isnan(values)  # [len]
        tokens.append(ids[mined])
        previous.append(previous_tokens(ids)[mined])
        m.append(values[mined].astype(np.float64))
    if not m:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    return np.concatenate(tokens), np.concatenate(previous), np.concatenate(m)


def score_patterns(
    loaded: LoadedModel,
    patterns: list[list[Pattern]],
    fires_at: torch.Tensor,
    held_out: list,
    options: ExplanationOptions,
):
    """Each pattern's PatternScore on the held-out sentences (positions from the sentence's first mined
    one, and never position 0, where the attention sink gives some keys outsized coefficients)."""
    scores = PatternScores(patterns, fires_at, device=loaded.device)
    if held_out:
        ids = [s.token_ids for s in held_out]
        first = [max(s.first_position, 1) for s in held_out]
        pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
        batches = list(
            length_bucketed_batches(
                ids, first, indices=range(len(ids)), batch_tokens=options.batch_tokens, pad_id=pad
            )
        )
        current = []

        def fold(layer: int, coefficients: torch.Tensor) -> None:
            batch = current[0]
            scores.update(
                layer, coefficients, batch.input_ids, batch.mined
            )  # coefficients: [batch, pos, keys]

        with (
            loaded.lock,
            torch.inference_mode(),
            capture(loaded.model, loaded.adapter, fields=("coefficients",), on_coefficients=fold),
        ):
            for batch in tqdm(
                batches, desc="scoring explanations", unit="batch", disable=not options.progress
            ):
                current[:] = [batch.to(loaded.device)]
                loaded.model.base_model(
                    input_ids=current[0].input_ids, attention_mask=current[0].attention_mask, use_cache=False
                )
    return [scores.scores(layer) for layer in range(len(patterns))]
