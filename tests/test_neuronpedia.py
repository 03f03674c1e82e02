"""`ffmem export --format neuronpedia`: Neuronpedia's bulk layout, one source a layer, every line a valid row
of the dataclasses in Neuronpedia's repository (copied into tests/data/neuronpedia with their origin): every
field named, none unknown, each value of its annotated type; and holding what the explorer holds."""

from __future__ import annotations

import gzip
import importlib.util
import json
import types
import typing
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ffmem
from ffmem.cli import cli
from ffmem.store.models import Label

pytestmark = pytest.mark.backends("sqlite", "postgres")

SCHEMA = Path(__file__).parent / "data" / "neuronpedia"
# A file of the layout → the dataclass its rows are (db_models' module and class).
ROWS = {
    "release.jsonl": ("source_release", "SourceRelease"),
    "model.jsonl": ("model", "Model"),
    "sourceset.jsonl": ("source_set", "SourceSet"),
    "source.jsonl": ("source", "Source"),
    "features": ("feature", "Feature"),
    "activations": ("activation", "Activation"),
    "explanations": ("explanation", "Explanation"),
}


def _dataclass(module: str, name: str) -> type:
    spec = importlib.util.spec_from_file_location(f"neuronpedia_{module}", SCHEMA / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, name)


def _conforms(value, annotation) -> bool:
    """Whether a JSON value fits a dataclass field's annotation (a datetime as ISO 8601 text, as orjson
    writes the dataclasses' datetimes)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if annotation is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if annotation is datetime:
        return isinstance(value, str) and datetime.fromisoformat(value) is not None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _lines(path: Path) -> list[dict]:
    opened = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with opened as lines:
        return [json.loads(line) for line in lines]


def test_the_export_is_neuronpedias_layout_and_holds_the_index(explorer_db, db, run, slug, tmp_path):
    db.add(Label(model_id=run.model_id, layer=1, key=4, pattern="a city", tag="semantic", author="ada",
                 created_at=run.started_at))  # fmt: skip
    db.commit()
    out = tmp_path / "np"
    try:
        result = CliRunner().invoke(
            cli, ["export", str(run.id), "--format", "neuronpedia", "--out", str(out), "--db", explorer_db]
        )
    finally:
        db.execute(Label.__table__.delete())
        db.commit()
    assert result.exit_code == 0, result.output
    n_layers, n_keys = run.model.n_layers, run.model.n_keys
    sources = sorted(p.name for p in (out / slug).iterdir())
    assert sources == sorted(f"{layer}-ffmem-mlp" for layer in range(n_layers))
    classes = {name: _dataclass(*where) for name, where in ROWS.items()}
    rows: dict[str, list[dict]] = {name: [] for name in ROWS}
    for source in sources:
        folder = out / slug / source
        for name in ROWS:
            paths = sorted((folder / name).glob("batch-*.jsonl.gz")) if "." not in name else [folder / name]
            assert paths, f"{source}/{name}"
            for path in paths:
                rows[name].extend(_lines(path))
    for name, found in rows.items():
        kind = classes[name]
        hints = typing.get_type_hints(kind)
        for row in found:
            kind(**row)  # every field it requires, none it does not know
            wrong = {field: value for field, value in row.items() if not _conforms(value, hints[field])}
            assert wrong == {}, f"{name}: {wrong}"
    assert len(rows["features"]) == n_layers * n_keys and len(rows["source.jsonl"]) == n_layers
    assert {r["layer"] for r in rows["features"]} == set(sources)

    index = ffmem.open(explorer_db)
    key = index.model().run().key(1, 4)
    feature = next(r for r in rows["features"] if (r["layer"], r["index"]) == ("1-ffmem-mlp", "4"))
    assert feature["pos_str"] == [v.token for v in key.values("raw", 1)]
    assert feature["neg_values"] == pytest.approx([v.logit for v in key.values("raw", -1)])
    assert feature["maxActApprox"] == pytest.approx(key.stats["max_coefficient"])
    assert feature["frac_nonzero"] == pytest.approx(key.stats["positive_share"])
    assert feature["freq_hist_data_bar_heights"] == key.stats["histogram"]
    assert len(feature["freq_hist_data_bar_values"]) == len(key.stats["histogram"])
    assert feature["logits_hist_data_bar_heights"] == key.value_histograms["raw"].counts
    assert feature["hookName"] == "blocks.1.mlp.hook_post"
    activations = [r for r in rows["activations"] if (r["layer"], r["index"]) == ("1-ffmem-mlp", "4")]
    shaded = [t for t in key.triggers if t.shading is not None]
    assert len(activations) == len(shaded) > 0
    for activation, trigger in zip(activations, shaded, strict=True):
        assert len(activation["tokens"]) == len(activation["values"]) == len(trigger.shading)
        assert activation["qualifyingTokenIndex"] == trigger.position
        # m at every token as the run shades it: int8 codes, to within half a step (the largest |m| / 127).
        step = max(abs(v) for v in activation["values"]) / 127
        assert activation["values"][trigger.position] == pytest.approx(
            trigger.coefficient, abs=step / 2 + 1e-6
        )
        assert activation["values"] == pytest.approx(
            [0.0 if v != v else v for v in trigger.shading]
        )  # NaN: 0
        assert activation["dataIndex"] == str(trigger.sentence_index)
        assert "".join(activation["tokens"][: trigger.position + 1]).endswith(trigger.token)
    explanations = [r for r in rows["explanations"] if (r["layer"], r["index"]) == ("1-ffmem-mlp", "4")]
    assert [(r["typeName"], r["description"]) for r in explanations] == [
        ("ffmem", key.explanation.text), ("ffmem-label", "a city"),
    ]  # fmt: skip
    assert f"{key.explanation.score:.4f}" in explanations[0]["notes"]
    index.close()
    assert "wrote run 1 to" in result.output and f"features {n_layers * n_keys:,}" in result.output
