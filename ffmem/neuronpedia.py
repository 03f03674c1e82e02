"""`ffmem export --format neuronpedia`: a run in Neuronpedia's bulk layout, what its importer reads for neuron
dashboards (hijohnnylin/neuronpedia: apps/webapp/app/api/admin/import, the rows of
utils/neuronpedia-utils/neuronpedia_utils/db_models; a copy in tests/data/neuronpedia), one source a layer:

    <model>/<layer>-ffmem-mlp/release.jsonl, model.jsonl, sourceset.jsonl, source.jsonl
    <model>/<layer>-ffmem-mlp/features/batch-<n>.jsonl.gz       a Feature a memory (its value's logits,
                                                                  coefficient histogram, nearest memories)
    <model>/<layer>-ffmem-mlp/activations/batch-<n>.jsonl.gz    an Activation per shaded top trigger
    <model>/<layer>-ffmem-mlp/explanations/batch-<n>.jsonl.gz   its explanation (with its score) and label

A memory is a Neuronpedia "feature" whose activation is its coefficient m (TransformerLens'
blocks.L.mlp.hook_post). What each field holds, and what does not map, is docs/neuronpedia.md. Every read is
ffmem.api's (the explorer's own).
"""

from __future__ import annotations

import gzip
import math
from datetime import timezone
from pathlib import Path

from ffmem import api
from ffmem.engine.errors import FfmemError
from ffmem.store.db import json_dumps

SET_NAME = "ffmem-mlp"
CREATOR = "ffmem"  # Neuronpedia's creatorId / authorId: a user of the instance importing it
BATCH = 256  # features a batch file


def export_neuronpedia(*, url: str, run_id: int, folder: Path) -> dict[str, int]:
    """Write run `run_id` of the index at `url` in Neuronpedia's layout under `folder`; rows per kind."""
    with api.open(url) as index:
        run = _find_run(index, run_id)
        model = run.model
        created = (run.finished_at or run.started_at).replace(tzinfo=timezone.utc).isoformat()
        written = {"sources": 0, "features": 0, "activations": 0, "explanations": 0}
        for layer in run.layers:
            source = folder / model.slug / _source_id(layer.layer)
            (source / "features").mkdir(parents=True, exist_ok=True)
            (source / "activations").mkdir(exist_ok=True)
            (source / "explanations").mkdir(exist_ok=True)
            for name, row in _metadata(run, layer.layer, created).items():
                (source / f"{name}.jsonl").write_text(json_dumps(row) + "\n")
            written["sources"] += 1
            for batch, start in enumerate(range(0, len(layer), BATCH)):
                keys = [layer.key(k) for k in range(start, min(start + BATCH, len(layer)))]
                features = [feature(key, created) for key in keys]
                activations = [row for key in keys for row in activation_rows(key, created)]
                explanations = [row for key in keys for row in explanation_rows(key, created)]
                for kind, rows in (
                    ("features", features), ("activations", activations), ("explanations", explanations),
                ):  # fmt: skip
                    _write(source / kind / f"batch-{batch}.jsonl.gz", rows)
                    written[kind] += len(rows)
    return written


def _find_run(index: api.Index, run_id: int) -> api.Run:
    for model in index.models:
        for run in model.runs:
            if run.id == run_id:
                if run.status != "done":
                    raise FfmemError(f"run {run_id} is {run.status}: only a finished run exports")
                return run
    raise FfmemError(f"there is no run {run_id}")


def _source_id(layer: int) -> str:
    return f"{layer}-{SET_NAME}"


def _write(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=5) as out:
        for row in rows:
            out.write(json_dumps(row) + "\n")


def _metadata(run: api.Run, layer: int, created: str) -> dict[str, dict]:
    """release.jsonl, model.jsonl, sourceset.jsonl and source.jsonl of one layer's source."""
    model = run.model
    release = f"ffmem-{model.slug}"
    return {
        "release": {
            "name": release,
            "description": f"Feed-forward memories of {model.slug} (ffmem run {run.id} over {run.corpus})",
            "descriptionShort": f"{model.slug} FF memories",
            "creatorName": CREATOR,
            "creatorNameShort": CREATOR,
            "creatorId": CREATOR,
            "urls": [],
            "createdAt": created,
        },
        "model": {
            "id": model.slug,
            "instruct": "instruct" in model.slug.lower() or model.slug.lower().endswith("-it"),
            "creatorId": CREATOR,
            "displayNameShort": model.slug,
            "displayName": model.slug,
            "dimension": model.d_model,
            "inferenceEnabled": False,
            "layers": model.n_layers,
            "neuronsPerLayer": model.n_keys,
            "createdAt": created,
            "updatedAt": created,
        },
        "sourceset": {
            "modelId": model.slug,
            "name": SET_NAME,
            "creatorId": CREATOR,
            "hasDashboards": True,
            "visibility": "PUBLIC",
            "description": f"FF memories - {model.n_keys} keys a layer (coefficient m = act(x·k))",
            "creatorName": CREATOR,
            "releaseName": release,
            "createdAt": created,
        },
        "source": {
            "id": _source_id(layer),
            "modelId": model.slug,
            "setName": SET_NAME,
            "creatorId": CREATOR,
            "hasDashboards": True,
            "inferenceEnabled": False,
            "visibility": "PUBLIC",
            "num_prompts": run.n_sentences,
            "dataset": run.corpus,
            "notes": f"ffmem run {run.id}: top {run.top_k} triggers a key, {run.n_tokens} positions mined",
            "createdAt": created,
        },
    }


def bar_values(edges: list[float]) -> list[float]:
    """A value per histogram bin (bins = edges + 1: below the first edge, between each two, above the last):
    the outer edge for the outer bins, the middle of its edges for the others."""
    inner = [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)]
    return [edges[0], *inner, edges[-1]]


def feature(key: api.Key, created: str) -> dict:
    """The Feature row of one memory."""
    stats = key.stats or {}
    top, bottom = key.values("raw", 1), key.values("raw", -1)
    same_layer = [n for n in key.neighbours if n.kind == "value" and n.layer == key.layer]
    raw = (key.value_histograms or {}).get("raw")
    histogram = stats.get("histogram") or []
    return {
        "modelId": key.run.model.slug,
        "layer": _source_id(key.layer),
        "index": str(key.key),
        "creatorId": CREATOR,
        "createdAt": created,
        "maxActApprox": _number(stats.get("max_coefficient")) or 0.0,
        "hasVector": False,
        "hookName": f"blocks.{key.layer}.mlp.hook_post",
        "topkCosSimIndices": [n.key for n in same_layer],
        "topkCosSimValues": [n.cosine for n in same_layer],
        "neg_str": [v.token for v in bottom],
        "neg_values": [v.logit for v in bottom],
        "pos_str": [v.token for v in top],
        "pos_values": [v.logit for v in top],
        "frac_nonzero": _number(stats.get("positive_share")) or 0.0,
        "freq_hist_data_bar_heights": [float(c) for c in histogram],
        "freq_hist_data_bar_values": bar_values(key.run.stored.histogram_edges) if histogram else [],
        "logits_hist_data_bar_heights": [float(c) for c in raw.counts] if raw else [],
        "logits_hist_data_bar_values": [(a + b) / 2 for a, b in zip(raw.edges, raw.edges[1:], strict=False)]
        if raw
        else [],
        "sourceSetName": SET_NAME,
    }


def activation_rows(key: api.Key, created: str) -> list[dict]:
    """An Activation per top positive trigger whose sentence the run shades: its tokens and m at each."""
    texts = key.run.model.vocabulary
    sentences = key.run.sentences([t.sentence_index for t in key.triggers if t.shading is not None])
    rows = []
    for trigger in key.triggers:
        if trigger.shading is None:
            continue
        values = [_number(v) or 0.0 for v in trigger.shading]  # NaN (a position not mined, e.g. BOS): 0
        peak = max(range(len(values)), key=values.__getitem__)
        rows.append(
            {
                "id": f"{key.run.model.slug}-{key.layer}-{key.key}-{trigger.rank}",
                "tokens": [texts.get(t, "") for t in sentences[trigger.sentence_index].token_ids],
                "index": str(key.key),
                "layer": _source_id(key.layer),
                "modelId": key.run.model.slug,
                "maxValue": values[peak],
                "maxValueTokenIndex": peak,
                "minValue": min(values),
                "values": values,
                "creatorId": CREATOR,
                "dataSource": key.run.corpus,
                "dataIndex": str(trigger.sentence_index),
                "createdAt": created,
                "qualifyingTokenIndex": trigger.position,
            }
        )
    return rows


def explanation_rows(key: api.Key, created: str) -> list[dict]:
    """The memory's automatic explanation (its score in the notes) and its label, where it has them."""
    base = {
        "modelId": key.run.model.slug,
        "layer": _source_id(key.layer),
        "index": str(key.key),
        "authorId": CREATOR,
        "createdAt": created,
    }
    rows = []
    found = key.explanation
    if found is not None:
        score = "none" if found.score is None else f"{found.score:.4f}"
        rows.append(
            {
                **base,
                "id": f"{key.run.model.slug}-{key.layer}-{key.key}-explanation",
                "description": found.text,
                "typeName": "ffmem",
                "explanationModelName": found.source,
                "notes": f"score (Pearson r of the pattern with m on held-out positions): {score}",
            }
        )
    if key.label is not None:
        label = key.label
        rows.append(
            {
                **base,
                "id": f"{key.run.model.slug}-{key.layer}-{key.key}-label",
                "description": label.pattern,
                "typeName": "ffmem-label",
                "notes": f"a person's label by {label.author}" + (f" ({label.tag})" if label.tag else ""),
            }
        )
    return rows


def _number(value) -> float | None:
    """A float JSON can hold: None for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)
