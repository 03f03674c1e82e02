"""The scoring of a run's explanations (ffmem.worker.explanations): the protocol's two passes over the
held-out sentences (ffmem.engine.explanations.protocol: each side's top records, then the scores of them
and the random records), the local model's simulation score where it described a side, and the figures of
a run (per layer quartiles, medians by depth) that its explanations step stores."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from ffmem.engine.explanations.fitting import Pattern
from ffmem.engine.explanations.protocol import (
    POLARITIES,
    ProtocolScore,
    ProtocolScores,
    TopRecords,
    random_records,
)
from ffmem.engine.mining.corpus import length_bucketed_batches
from ffmem.engine.mining.mined_layer import QUADRANTS
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.worker.explainer import LocalExplainer

if TYPE_CHECKING:
    from ffmem.worker.explanations import ExplanationOptions

HEURISTIC = "heuristic"  # the source of a description read off the index
SCORE_NAMES = ("pooled", "pooled_control", "random", "random_control", "auroc", "auroc_control")


def protocol_summary(scores: list, signs: np.ndarray) -> dict:
    """The protocol's figures over a run (`scores[side][layer][key]`): for each layer, the quartiles of each
    score of its memories' dominant sides and of their controls ("layers"), and the medians over every
    memory and each depth third ("medians")."""
    names = SCORE_NAMES
    found = {name: [] for name in names}  # [layer] arrays
    for layer, layer_signs in enumerate(signs):
        chosen = [scores[POLARITIES.index(int(sign))][layer][key] for key, sign in enumerate(layer_signs)]
        for name in names:
            values = [getattr(score, name) for score in chosen]
            found[name].append(np.array([v for v in values if v is not None], dtype=np.float64))
    layers = [
        {"layer": layer} | {name: _quartiles(found[name][layer]) for name in names}
        for layer in range(len(signs))
    ]
    thirds = np.array_split(np.arange(len(signs)), 3) if len(signs) >= 3 else [np.arange(len(signs))]
    medians = {
        name: {
            "all": median(np.concatenate(found[name]) if found[name] else np.zeros(0)),
            "thirds": [
                median(np.concatenate([found[name][i] for i in part]) if len(part) else np.zeros(0))
                for part in thirds
            ],
        }
        for name in names
    }
    return {"layers": layers, "medians": medians}


def quadrant_summary(scores: list | None) -> dict:
    """A gated run's quadrant figures (`scores[quadrant][layer][key]`): per quadrant (QUADRANTS), the
    medians of each score over every memory scored in it and over each depth third ("quadrant_medians");
    empty for an ungated run."""
    if not scores:
        return {}
    found = {}
    for number, by_layer in enumerate(scores):
        n_layers = len(by_layer)
        thirds = np.array_split(np.arange(n_layers), 3) if n_layers >= 3 else [np.arange(n_layers)]
        found[QUADRANTS[number]] = {
            name: {
                "all": median(_values(by_layer, range(n_layers), name)),
                "thirds": [median(_values(by_layer, part, name)) for part in thirds],
            }
            for name in SCORE_NAMES
        }
    return {"quadrant_medians": found}


def _values(by_layer: list, layers, name: str) -> np.ndarray:
    """[n] the defined values of one score of the memories of some layers."""
    chosen = (getattr(score, name) for layer in layers for score in by_layer[layer])
    return np.array([v for v in chosen if v is not None], dtype=np.float64)


def _quartiles(values: np.ndarray) -> list[float] | None:
    """[first quartile, median, third quartile], rounded; None without any."""
    return [round(float(q), 4) for q in np.quantile(values, [0.25, 0.5, 0.75])] if values.size else None


def median(values: np.ndarray) -> float | None:
    return round(float(np.median(values)), 4) if values.size else None


def score_patterns(
    loaded: LoadedModel,
    patterns: list[list[list[Pattern]]],
    fires_at: torch.Tensor,
    held_out: list,
    options: ExplanationOptions,
    quadrants: list[list[list[Pattern]]] | None = None,
) -> tuple[list[list[list[ProtocolScore]]], torch.Tensor, list[list[list[ProtocolScore]]] | None]:
    """Each side's pattern scored by the protocol (ffmem.engine.explanations.protocol) on the held-out
    sentences, `patterns[side][layer][key]`: a first pass finds each side's top records, a second scores
    them and the random records (positions from a sentence's first mined one, and never position 0, where
    the attention sink gives some keys outsized coefficients); with a gated model's `quadrants[quadrant]
    [layer][key]`, the second pass captures the inputs x·u too and scores each quadrant's pattern on the
    positions in it. ([side][layer][key] scores, the top records: [sides, layers, count, keys] held-out
    sentence numbers, −1 where fewer, and [quadrant][layer][key] scores or None)."""
    n_sides, n_layers, n_keys = fires_at.shape
    random = random_records(len(held_out), options.random_records or len(held_out))
    top = TopRecords(n_layers, n_keys, options.top_records, random, len(held_out))
    if held_out:
        _forward(loaded, held_out, range(len(held_out)), options, top.update, with_ids=False)
    wanted = sorted(set(random.tolist()) | set(top.records().unique().tolist()) - {-1})
    quadrants = quadrants if loaded.adapter.gates is not None else None
    scores = ProtocolScores(
        patterns, fires_at, top.records(), random, len(held_out), loaded.device, quadrants=quadrants
    )
    if wanted:
        _forward(loaded, held_out, wanted, options, scores.update, with_ids=True, inputs=bool(quadrants))
    found = [[scores.scores(side, layer) for layer in range(n_layers)] for side in range(n_sides)]
    in_quadrants = None
    if quadrants:
        in_quadrants = [
            [scores.quadrant_scores(number, layer) for layer in range(n_layers)]
            for number in range(len(quadrants))
        ]
    return found, top.records(), in_quadrants


def simulation_scores(
    loaded: LoadedModel,
    explainer: LocalExplainer,
    descriptions: dict,
    top: torch.Tensor,
    held_out: list,
    options: ExplanationOptions,
) -> dict[tuple[int, int, int], float | None]:
    """(side, layer, key) → the Pearson correlation of the local model's simulation with sign · m over the
    side's first `simulated_records` top records and as many random ones (OpenAI's simulation score),
    for each side it described; None where it gave no simulation or either never varies."""
    count = options.simulated_records
    random = random_records(len(held_out), options.random_records or len(held_out))[:count].tolist()
    wanted = {}  # (side, layer, key) → its records
    for (layer, key), sides in descriptions.items():
        for side, (source, _) in enumerate(sides):
            if source != HEURISTIC:
                own = [r for r in top[side, layer, :count, key].tolist() if r >= 0]
                wanted[side, layer, key] = own + random
    if not wanted:
        return {}
    keys_of = {}  # layer → the keys whose coefficients are read
    for _, layer, key in wanted:
        keys_of.setdefault(layer, set()).add(key)
    keys_of = {layer: torch.tensor(sorted(keys)) for layer, keys in keys_of.items()}
    coefficients = {}  # (layer, record) → [positions, keys of the layer] at its mined positions

    def fold(layer, found, mined, sentences):  # found: [batch, pos, keys]
        if layer in keys_of:
            for row, record in enumerate(sentences.tolist()):
                coefficients[layer, record] = found[row][mined[row]][:, keys_of[layer]].double().cpu()

    records = sorted({r for chosen in wanted.values() for r in chosen})
    _forward(loaded, held_out, records, options, fold, with_ids=False)
    found = {}
    for (side, layer, key), chosen in wanted.items():
        column = int(torch.searchsorted(keys_of[layer], key))
        shown = [held_out[r].token_ids for r in chosen]
        simulated = explainer.simulate(descriptions[layer, key][side][1].text, shown)
        if simulated is None:
            found[side, layer, key] = None
            continue
        x, y = [], []
        for r, row in zip(chosen, simulated, strict=True):
            first = max(held_out[r].first_position, 1)
            x.extend(row[first:])
            y.extend((POLARITIES[side] * coefficients[layer, r][:, column]).tolist())
        found[side, layer, key] = _correlation(np.array(x), np.array(y))
    return found


def _correlation(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 2 or len(x) != len(y) or x.std() < 1e-12 or y.std() < 1e-12:
        return None
    return round(float(np.corrcoef(x, y)[0, 1]), 4)


def _forward(
    loaded: LoadedModel,
    held_out: list,
    chosen,
    options: ExplanationOptions,
    fold,
    *,
    with_ids: bool,
    inputs: bool = False,
):
    """The chosen held-out sentences through the model, each layer's [batch, pos, keys] coefficients
    handed to `fold(layer, coefficients, [input_ids,] mined, sentences[, inputs])` (sentences: [batch]
    their numbers among `held_out`; with `inputs`, a gated layer's inputs x·u [batch, pos, keys] too)."""
    chosen = list(chosen)
    ids = [held_out[i].token_ids for i in chosen]
    first = [max(held_out[i].first_position, 1) for i in chosen]
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    batches = list(
        length_bucketed_batches(ids, first, indices=chosen, batch_tokens=options.batch_tokens, pad_id=pad)
    )
    current = []

    def folded(layer: int, coefficients: torch.Tensor) -> None:  # coefficients: [batch, pos, keys]
        batch = current[0]
        if inputs:
            fold(
                layer,
                coefficients,
                batch.input_ids,
                batch.mined,
                batch.sentence_index,
                captured.inputs[layer],
            )
        elif with_ids:
            fold(layer, coefficients, batch.input_ids, batch.mined, batch.sentence_index)
        else:
            fold(layer, coefficients, batch.mined, batch.sentence_index)

    fields = ("coefficients", "inputs") if inputs else ("coefficients",)
    with (
        loaded.lock,
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, fields=fields, on_coefficients=folded) as captured,
    ):
        for batch in tqdm(batches, desc="scoring explanations", unit="batch", disable=not options.progress):
            current[:] = [batch.to(loaded.device)]
            loaded.model.base_model(
                input_ids=current[0].input_ids, attention_mask=current[0].attention_mask, use_cache=False
            )
