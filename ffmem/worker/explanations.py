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
from ffmem.engine.explanations.description import Description, describe
from ffmem.engine.explanations.fitting import (
    CorpusCounts,
    Pattern,
    dominant_sign,
    fit_patterns,
    previous_tokens,
)
from ffmem.engine.explanations.protocol import (
    POLARITIES,
)
from ffmem.engine.mining.mined_layer import QUADRANT_SIGNS, QUADRANTS
from ffmem.engine.model.loaded import LoadedModel
from ffmem.store import composition, corpora, memory_reads, vocabularies
from ffmem.store.bulk import collector_paused
from ffmem.store.key_examples import layer_shading
from ffmem.store.models import Run
from ffmem.store.specs import CompositionSpec, RunSpec
from ffmem.worker.explainer import PROMPT_PREFIXES, PROMPT_TOKENS, Evidence, LocalExplainer
from ffmem.worker.explanation_scores import (
    HEURISTIC,
    median,
    protocol_summary,
    quadrant_summary,
    score_patterns,
    simulation_scores,
)
from ffmem.worker.fitting_positions import by_key, key_positions, layer_positions
from ffmem.worker.held_out import held_out
from ffmem.worker.leases import Heartbeat, checked_commit

if TYPE_CHECKING:
    from ffmem.worker.index import IndexOptions


@dataclass
class ExplanationOptions:
    """How the explanations are written and scored (`compose` takes them): held-out sentences, the protocol's
    top and random records (0 random records: every held-out sentence), batch size, the optional local
    explainer; besides the run and its model (defaults: the settings of the same names)."""

    explain_sentences: int = Settings.model_fields["explain_sentences"].default
    top_records: int = Settings.model_fields["explain_top_records"].default
    random_records: int = Settings.model_fields["explain_random_records"].default
    quadrants: bool = Settings.model_fields["explain_quadrants"].default  # a gated model's, each described
    batch_tokens: int = Settings.model_fields["batch_tokens"].default
    explainer_url: str = ""
    explainer_model: str = ""
    explainer_timeout: float = Settings.model_fields["explainer_timeout"].default
    simulated_records: int = Settings.model_fields["explainer_simulated_records"].default
    progress: bool = False

    @classmethod
    def of(cls, spec: RunSpec | CompositionSpec, worker: IndexOptions) -> ExplanationOptions:
        """An index or composition job's: what its spec says, with the explainer its worker reaches."""
        return cls(
            explain_sentences=spec.explain_sentences,
            top_records=spec.explain_top_records,
            random_records=spec.explain_random_records,
            quadrants=spec.explain_quadrants,
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
            top_records=settings.explain_top_records,
            random_records=settings.explain_random_records,
            quadrants=settings.explain_quadrants,
            batch_tokens=settings.batch_tokens,
            explainer_url=settings.explainer_url,
            explainer_model=settings.explainer_model,
            explainer_timeout=settings.explainer_timeout,
            simulated_records=settings.explainer_simulated_records,
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
    """Describe both sides of every memory of the run, score each by the protocol on held-out sentences
    and store them (committed after `lease` is checked, when there is one); what was stored, with each
    part's seconds. A layer at a time: its memories' evidence is gathered, described (and, with a local
    explainer, sent to it) and let go, so that what stays for every memory is its descriptions. The
    cycle collector is paused meanwhile: the step's hundreds of thousands of patterns, descriptions and
    scores make no cycles, but their allocations would run it again and again over every object the
    process holds (a sixth of the step)."""
    with collector_paused():
        return _explain(sessions, run_id, loaded, options, client, lease)


def _explain(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ExplanationOptions,
    client: httpx.Client | None,
    lease: Heartbeat | None,
) -> dict:
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
    descriptions, quadrants, failures = _describe_layers(sessions, run, explainer, options, timings)

    start = time.perf_counter()
    with sessions() as session:
        held = held_out(session, session.get(Run, run_id), options.explain_sentences, loaded)
    n_layers, n_keys = run.signs.shape
    patterns = [
        [[descriptions[layer, key][side][1].pattern for key in range(n_keys)] for layer in range(n_layers)]
        for side in range(len(POLARITIES))
    ]
    in_quadrants = None
    if quadrants:  # a gated model's: each quadrant's pattern (an empty one where it has no examples)
        in_quadrants = [
            [
                [_quadrant_pattern(quadrants.get((layer, key)), number) for key in range(n_keys)]
                for layer in range(n_layers)
            ]
            for number in range(len(QUADRANTS))
        ]
    scores, top, quadrant_scores = score_patterns(loaded, patterns, run.fires_at, held, options, in_quadrants)
    timings["score_seconds"] = time.perf_counter() - start
    simulated = {}
    if explainer is not None and options.simulated_records and held:
        start = time.perf_counter()
        simulated = simulation_scores(loaded, explainer, descriptions, top, held, options)
        timings["simulation_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    rows = _rows(descriptions, scores, run.signs, simulated, scored=bool(held))
    if quadrants:
        _add_quadrants(rows, quadrants, quadrant_scores if held else None)
    with sessions() as session:
        composition.delete_explanations(session=session, run_id=run_id)
        composition.store_explanations(session=session, run_id=run_id, rows=rows)
        checked_commit(session, lease)
        summary = composition.explanation_summary(session=session, run_id=run_id)
    timings["store_seconds"] = time.perf_counter() - start
    return (
        summary
        | timings
        | {
            "held_out_sentences": len(held),
            "top_records": options.top_records,
            "random_records": min(options.random_records or len(held), len(held)),
            "explainer_failures": failures,
            "explainer_sides": len(descriptions) * len(POLARITIES) if explainer is not None else 0,
            "explainer_gave_up": explainer is not None and explainer.gave_up,
            "simulated_sides": sum(r is not None for r in simulated.values()),
            "simulation_failures": sum(r is None for r in simulated.values()),
            "median_simulation": median(np.array([r for r in simulated.values() if r is not None])),
        }
        | protocol_summary(scores, run.signs)
        | quadrant_summary(quadrant_scores if held else None)
    )


def _quadrant_pattern(found: list | None, number: int) -> Pattern:
    """A memory's pattern of one quadrant, or an empty one (which matches nothing) where it has none."""
    described = found[number] if found is not None else None
    return described.pattern if described is not None else Pattern(sign=QUADRANT_SIGNS[number])


def _add_quadrants(rows: list[tuple], quadrants: dict, scores: list | None) -> None:
    """Each gated memory's row's details gain "quadrants": per quadrant with examples (as QUADRANTS), its
    name, the sign of m there, its description and its scores (None: unscored), as
    ffmem.store.composition.explanation_quadrants reads them back."""
    for layer, key, *_, details in rows:
        found = quadrants.get((layer, key))
        if found is None:
            continue
        details["quadrants"] = [
            {
                "quadrant": QUADRANTS[number],
                "sign": QUADRANT_SIGNS[number],
                "text": described.text,
                "scores": scores[number][layer][key].to_dict() if scores is not None else None,
            }
            for number, described in enumerate(found)
            if described is not None
        ]


@dataclass
class _RunInputs:
    """What describing a run's memories reads once: its corpus, its vocabulary (as text and as shown), and
    per memory its dominant sign, the coefficient each side counts as firing at, its shallowness."""

    run_id: int
    sentences: list[list[int]]
    texts: list[str]  # [vocab]: each token's text
    names: list[str]  # [vocab]: each token as the pages show it (byte tokens as ⟨0x80⟩)
    signs: np.ndarray  # [layers, keys] int64: ±1
    fires_at: torch.Tensor  # [sides, layers, keys]: half the side's strongest sign · m (NaN: none)
    shallowness: dict[tuple[int, int], float | None]
    counts: CorpusCounts
    tokens: np.ndarray  # [corpus tokens] int64: every sentence's tokens, one after another
    previous: np.ndarray  # [corpus tokens] int64: each one's previous token (START at a sentence's first)
    starts: np.ndarray  # [sentences + 1] int64: where each sentence begins in them (and their end)

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
        fires_at = torch.full((len(POLARITIES), n_layers, n_keys), float("nan"))
        shallowness = {}
        for layer, key, largest, smallest, shallow in stats:
            signs[layer, key] = dominant_sign(largest, smallest)
            for side, strongest in enumerate((largest, smallest)):
                if strongest is not None and POLARITIES[side] * strongest > 0:
                    fires_at[side, layer, key] = POLARITIES[side] * strongest / 2
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
            *_flat(sentences),
        )


def _flat(sentences: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The corpus's tokens one after another, each one's previous token, each sentence's start ([n + 1])."""
    ids = [np.asarray(s, dtype=np.int64) for s in sentences]
    starts = np.cumsum([0] + [len(s) for s in ids])
    if not starts[-1]:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), starts
    return np.concatenate(ids), np.concatenate([previous_tokens(s) for s in ids]), starts


def _describe_layers(
    sessions: sessionmaker,
    run: _RunInputs,
    explainer: LocalExplainer | None,
    options: ExplanationOptions,
    timings: dict[str, float],
) -> tuple[dict[tuple[int, int], list[tuple[str, Description]]], dict, int]:
    """Every memory's descriptions, a layer at a time: [(source, description) of each side, as
    POLARITIES] by (layer, key); a gated memory's quadrant descriptions ([Description or None] as
    QUADRANTS) by (layer, key); and how many the local explainer failed to write (those keep the heuristic
    one)."""
    descriptions, quadrants, failures = {}, {}, 0
    n_layers, n_keys = run.signs.shape
    for layer in tqdm(range(n_layers), desc="describing", unit="layer", disable=not options.progress):
        start = time.perf_counter()
        evidence, in_quadrants = _layer_evidence(sessions, run, layer, options.quadrants)
        quadrants.update({(layer, key): found for key, found in in_quadrants.items()})
        for found in evidence:
            descriptions.setdefault((found.layer, found.key), [None, None])[POLARITIES.index(found.sign)] = (
                HEURISTIC,
                found.heuristic,
            )
        timings["describe_seconds"] += time.perf_counter() - start
        if explainer is not None:
            start = time.perf_counter()
            for found in evidence:
                written = explainer.describe(found)
                if written is None:
                    failures += 1
                else:
                    source = f"llm:{options.explainer_model or 'default'}"
                    descriptions[found.layer, found.key][POLARITIES.index(found.sign)] = (source, written)
            timings["explainer_seconds"] = timings.get("explainer_seconds", 0.0) + time.perf_counter() - start
    return descriptions, quadrants, failures


def _layer_evidence(
    sessions: sessionmaker, run: _RunInputs, layer: int, quadrants: bool
) -> tuple[list[Evidence], dict[int, list[Description | None]]]:
    """What describes each side of each memory of one layer: its pattern fitted on its own records, the
    tokens its value writes on that side (the top tokens for m > 0, the bottom ones for m < 0), its
    shallowness, the ends of its strongest trigger prefixes of that sign, the heuristic description; and
    for a gated layer, key → each quadrant's heuristic description (None where it has no examples)."""
    n_keys = run.signs.shape[1]
    with sessions() as session:
        triggers = {
            sign: memory_reads.layer_triggers(session=session, run_id=run.run_id, layer=layer, sign=sign)
            for sign in POLARITIES
        }
        shaded = layer_shading(session=session, run_id=run.run_id, layer=layer, quadrants=quadrants)
        written = {
            sign: memory_reads.layer_value_tokens(
                session=session, run_id=run.run_id, layer=layer, readout="norm", direction=sign, n=5
            )[0]
            for sign in POLARITIES
        }
    if all(key in shaded for key in range(n_keys)):
        laid = layer_positions(shaded, triggers, run, n_keys)
        fitted = (laid.tokens, laid.previous, laid.m, laid.lengths, laid.signs)
        in_quadrants = laid.quadrants  # [keys] the quadrants each key has a pattern of
        keyed = {sign: by_key(found, n_keys, PROMPT_PREFIXES) for sign, found in triggers.items()}
    else:  # a run stored before the shading (or a key without it): key by key
        keyed = {sign: by_key(found, n_keys) for sign, found in triggers.items()}
        fitted, in_quadrants = key_positions(shaded, keyed, run, n_keys)
    patterns = iter(fit_patterns(*fitted, run.counts))
    evidence, quadrants = [], {}
    for key in range(n_keys):
        found = {s: keyed[s][key] for s in POLARITIES}
        shallow = run.shallowness.get((layer, key))
        for sign in POLARITIES:
            pattern = next(patterns)
            values = written[sign][key].tolist() if key < len(written[sign]) else []
            prefixes = [  # what a prompt shows: the ends of the strongest trigger prefixes
                run.sentences[s][max(p + 1 - PROMPT_TOKENS, 0) : p + 1]
                for s, p, _ in found[sign][:PROMPT_PREFIXES]
            ]
            heuristic = describe(pattern, values, shallow, run.names)
            suppressed = written[-sign][key].tolist() if key < len(written[-sign]) else []
            evidence.append(Evidence(layer, key, sign, prefixes, values, shallow, heuristic, suppressed))
        for number in in_quadrants[key]:
            sign = QUADRANT_SIGNS[number]
            values = written[sign][key].tolist() if key < len(written[sign]) else []
            quadrants.setdefault(key, [None] * len(QUADRANTS))[number] = describe(
                next(patterns), values, shallow, run.names
            )
    return evidence, quadrants


def _rows(
    descriptions: dict, scores: list, signs: np.ndarray, simulated: dict, *, scored: bool
) -> list[tuple]:
    """The stored rows: (layer, key, source, text, score, pattern, details) of every memory, its dominant
    side's description, pattern and pooled score first; `details` names that side ("sign") and holds both
    sides' sources, descriptions (the dominant's is the row's text) and scores ("polarities"; with the
    local model's simulation score where it simulated the side, `simulated`: (side, layer, key) → r):
    ffmem.store.composition.explanation_sides reads them back."""
    rows = []
    for layer, layer_signs in enumerate(signs):
        for key, sign in enumerate(layer_signs):
            sides = []
            for side, polarity in enumerate(POLARITIES):
                source, description = descriptions[layer, key][side]
                score = scores[side][layer][key].to_dict() if scored else None
                if score is not None and (side, layer, key) in simulated:
                    score["simulation"] = simulated[side, layer, key]
                sides.append({"sign": polarity, "source": source, "text": description.text, "scores": score})
            dominant = POLARITIES.index(int(sign))
            source, description = descriptions[layer, key][dominant]
            protocol = sides[dominant]["scores"]
            del sides[dominant]["text"]  # the row's text: stored once
            details = {
                "positions": protocol["top_positions"] + protocol["random_positions"] if protocol else 0,
                "matches": protocol["matches"] if protocol else 0,
                "auroc": protocol["auroc"] if protocol else None,
                "sign": int(sign),
                "polarities": sides,
            }
            score = protocol["pooled"] if protocol else None
            rows.append((layer, key, source, description.text, score, description.pattern.to_dict(), details))
    return rows
