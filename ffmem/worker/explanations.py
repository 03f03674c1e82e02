"""The memories' explanations, computed once per run by `compose` (ffmem.worker.composition): for every
memory a short description read off the index (ffmem.engine.explanations.describe: how its top triggers
end, the words that set them apart, its value's top tokens, its shallowness), or written by a local model
when `explainer_url` is set (ffmem.worker.explainer), scored on the run's held-out sentences
(ffmem.worker.held_out), the same ones the census analysis samples (worker/analysis_jobs.py),
`explain_sentences` of them, and stored (ffmem.store.composition). A run with none held out leaves the
explanations unscored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import numpy as np
import torch
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from ffmem.config import Settings
from ffmem.engine.corpus import length_bucketed_batches
from ffmem.engine.errors import FfmemError
from ffmem.engine.explanations import Pattern, PatternScores, describe, document_frequency, word_like
from ffmem.engine.hooks import capture
from ffmem.engine.loading import LoadedModel
from ffmem.store import composition, corpora, memory_reads, vocabularies
from ffmem.store.models import Run
from ffmem.worker.explainer import Evidence, LocalExplainer
from ffmem.worker.held_out import held_out

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
) -> dict:
    """Describe every memory of the run, score the descriptions on held-out sentences and store them."""
    timings = {}
    start = time.perf_counter()
    with sessions() as session:
        run = session.get(Run, run_id)
        if run is None:
            raise FfmemError(f"there is no run {run_id}")
        n_layers, n_keys = run.model.n_layers, run.model.n_keys
        sentences = corpora.load_sentence_tokens(session=session, corpus_id=run.corpus_id)
        vocabulary = vocabularies.stored_texts(session=session, model_id=run.model_id)
        texts = [
            vocabulary.get(i, "") for i in range(max(len(loaded.tokenizer), max(vocabulary, default=0) + 1))
        ]
        shown = vocabularies.vocabulary(session=session, model_id=run.model_id)  # byte tokens as ⟨0x80⟩
        names = [shown.get(i, text) for i, text in enumerate(texts)]
        stats = memory_reads.run_key_stats(
            session=session, run_id=run_id, columns=("layer", "key", "max_coefficient", "shallowness")
        )
        fires_at = torch.full((n_layers, n_keys), float("nan"))
        shallowness = {}
        for layer, key, largest, shallow in stats:
            if largest is not None and largest > 0:
                fires_at[layer, key] = largest / 2
            shallowness[layer, key] = shallow
        frequency = document_frequency(sentences, len(texts))
        words = word_like(texts)
        evidence: list[list[Evidence]] = []
        for layer in tqdm(range(n_layers), desc="describing", unit="layer", disable=not options.progress):
            prefixes = _layer_prefixes(session, run_id, layer, n_keys, sentences)
            value_ids, _ = memory_reads.layer_value_tokens(
                session=session, run_id=run_id, layer=layer, readout="norm", direction=1, n=5
            )
            row = []
            for key in range(n_keys):
                values = value_ids[key].tolist() if key < len(value_ids) else []
                shallow = shallowness.get((layer, key))
                heuristic = describe(prefixes[key], values, shallow, frequency, words, names)
                row.append(Evidence(layer, key, prefixes[key], values, shallow, heuristic))
            evidence.append(row)
    timings["describe_seconds"] = time.perf_counter() - start

    descriptions = {(e.layer, e.key): (HEURISTIC, e.heuristic) for row in evidence for e in row}
    failures = 0
    if options.explainer_url or client is not None:
        start = time.perf_counter()
        explainer = LocalExplainer(
            options.explainer_url,
            options.explainer_model,
            options.explainer_timeout,
            loaded.tokenizer,
            texts,
            client,
        )
        for row in tqdm(evidence, desc="asking the local model", unit="layer", disable=not options.progress):
            for found in row:
                written = explainer.describe(found)
                if written is None:
                    failures += 1
                else:
                    descriptions[found.layer, found.key] = (
                        f"llm:{options.explainer_model or 'default'}",
                        written,
                    )
        timings["explainer_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    with sessions() as session:
        held = held_out(session, session.get(Run, run_id), options.explain_sentences, loaded)
    patterns = [[descriptions[layer, key][1].pattern for key in range(n_keys)] for layer in range(n_layers)]
    scores = score_patterns(loaded, patterns, fires_at, held, options)
    timings["score_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    rows = []
    for layer in range(n_layers):
        for key, score in enumerate(scores[layer]):
            source, description = descriptions[layer, key]
            details = score.details() if held else {"positions": 0, "matches": 0, "auroc": None}
            rows.append(
                (
                    layer,
                    key,
                    source,
                    description.text,
                    score.correlation,
                    description.pattern.to_dict(),
                    details,
                )
            )
    with sessions() as session:
        composition.delete_explanations(session=session, run_id=run_id)
        composition.store_explanations(session=session, run_id=run_id, rows=rows)
        session.commit()
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


def _layer_prefixes(
    session: Session, run_id: int, layer: int, n_keys: int, sentences: list[list[int]]
) -> list[list[list[int]]]:
    """Each key's top positive trigger prefixes (token ids), the strongest first."""
    found = memory_reads.layer_triggers(session=session, run_id=run_id, layer=layer, sign=1)
    prefixes: list[list[list[int]]] = [[] for _ in range(n_keys)]
    for key, sentence, position in zip(
        found.key.tolist(),
        found.entries["sentence_index"].tolist(),
        found.entries["position"].tolist(),
        strict=True,
    ):  # by key, the strongest first
        prefixes[key].append(sentences[sentence][: position + 1])
    return prefixes


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
