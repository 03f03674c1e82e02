"""The page of two runs side by side (`/m/{model}/compare?a=…&b=…`): what a worker stored of the pair
(ffmem.store.comparison; ffmem.worker.comparison says how each figure is computed), the memories that
changed most, a summary per layer, or — before it is computed — the pair's job, or the runs to pick from.
The statistics' changes are b − a in the order asked (a pair is stored once, the lower run id first)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ffmem.store import comparison, runs
from ffmem.store.db import Session
from ffmem.store.models import Comparison, JobStatus, KeyChange, LanguageModel, Run
from ffmem.web import urls
from ffmem.web.charts import BASE_LAYOUT, NEGATIVE, NEUTRAL, POSITIVE, layer_axis
from ffmem.web.errors import AppError
from ffmem.web.lookups import check_layer, run_or_404
from ffmem.web.views import JobInfo, ModelPage

SORTS = tuple(comparison.SORTS)
SORT_NAMES = {
    "change": "weights moved most (1 − the smaller of key and value cosine), then trigger overlap",
    "overlap": "smallest overlap of the top positive triggers",
    "key": "lowest key cosine",
    "value": "lowest value cosine",
    "mean": "largest change of the mean coefficient",
    "positive_share": "largest change of the positive share",
    "max_coefficient": "largest change of the max coefficient",
    "min_coefficient": "largest change of the min coefficient",
    "density": "largest change of the density",
}
BASIS_NAMES = {
    "sentences": "sentence indices (both runs mined the same corpus)",
    "texts": "trigger texts: each prefix up to and including its trigger token (the corpora differ)",
}
Status = Literal["pick", "missing", "queued", "running", "failed", "done"]


class ComparedRun(BaseModel):
    """One side of the pair."""

    id: int
    model: str = Field(description="Its model's slug.")
    corpus: str
    n_sentences: int
    top_k: int
    weights_sha256: str | None
    url: str = Field(description="Its model page, pinned to the run.")


class RunChoice(BaseModel):
    """A run that can be compared with run a (finished, its model of the same shape)."""

    id: int
    model: str
    corpus: str
    n_sentences: int
    top_k: int
    url: str = Field(description="This page comparing a with it.")


class Compared(BaseModel):
    """What was compared, in words and numbers."""

    basis: str = Field(description="sentences | texts.")
    triggers: str = Field(description="What a trigger is in the overlap.")
    top_t: int = Field(description="Triggers compared per key and sign: the smaller top-T.")
    overlap: str
    keys: str
    values: str
    statistics: str
    same_weights: bool = Field(description="Both models' weight checksums are equal.")
    seconds: float = Field(description="The worker's time for the whole comparison.")


class LayerChange(BaseModel):
    """Means over a layer's memories."""

    layer: int
    mean_overlap: float | None
    mean_negative_overlap: float | None
    mean_key_cosine: float | None
    mean_value_cosine: float | None
    triggers_changed: int = Field(description="Memories whose top positive triggers are not all shared.")


class KeyChangeView(BaseModel):
    """One memory, b against a."""

    layer: int
    key: int
    overlap: float | None = Field(description="|A ∩ B| / max(|A|, |B|) of the top-T positive triggers.")
    negative_overlap: float | None
    key_cosine: float = Field(description="Gated FFs: gate_cosine · up_cosine.")
    gate_cosine: float | None = Field(description="None for plain FFs.")
    up_cosine: float | None
    value_cosine: float
    moved: float = Field(description="1 − min(key_cosine, value_cosine).")
    d_mean: float | None = Field(description="b − a.")
    d_positive_share: float | None
    d_max_coefficient: float | None
    d_min_coefficient: float | None
    d_density: float | None
    url_a: str = Field(description="The memory's key page in run a.")
    url_b: str = Field(description="… in run b.")


class CompareContext(ModelPage):
    """Two runs side by side (the model: run a's)."""

    page: str = "compare"
    a: ComparedRun
    b: ComparedRun | None = Field(description="None until one is picked.")
    status: Status = Field(
        description="pick (no b yet), missing (not computed), queued, running, failed, done."
    )
    job: JobInfo | None = Field(description="The pair's newest comparison job.")
    compared: Compared | None = Field(description="Once done.")
    sort: str
    sorts: dict[str, str] = Field(description="The sorts offered, and what each puts first.")
    limit: int
    layer: int | None = Field(description="Only this layer's memories listed.")
    layers: list[LayerChange]
    keys: list[KeyChangeView] = Field(description="The `limit` memories that changed most by `sort`.")
    choices: list[RunChoice] = Field(description="Runs to compare a with.")
    start_url: str = Field(description="POST a, b here to queue the comparison (a write).")


def compare_page(
    session: Session,
    model: LanguageModel,
    a: int | None,
    b: int | None,
    sort: str,
    limit: int,
    layer: int | None,
) -> CompareContext:
    """Run `a` of the model (default: its newest finished) against run `b` (None: the runs to pick from)."""
    first = run_or_404(session, model, a)
    if layer is not None:
        check_layer(model, layer)
    second = None if b is None else other_run_or_error(session, first, b)
    found = None
    if second is not None:
        found = comparison.get_comparison(session=session, run_a=first.id, run_b=second.id)
    job = None
    if second is not None and found is None:
        job = comparison.comparison_job(session=session, run_a=first.id, run_b=second.id)
    status: Status = "pick" if second is None else "done" if found is not None else "missing"
    if job is not None:
        status = {JobStatus.queued: "queued", JobStatus.running: "running", JobStatus.failed: "failed"}.get(
            job.status, status
        )
    keys, layers, compared = [], [], None
    if found is not None:
        flip = comparison.pair(first.id, second.id)[2]
        rows = comparison.key_changes(
            session=session, comparison_id=found.id, sort=sort, limit=limit, layer=layer
        )
        keys = [key_view(row, first, second, flip) for row in rows]
        layers = [LayerChange(**summary) for summary in found.layers]
        compared = compared_view(found)
    title = f"{model.slug}: run {first.id}" + (
        f" against run {second.id}" if second else " against another run"
    )
    return CompareContext(
        title=title,
        model=model.slug,
        a=run_view(first),
        b=None if second is None else run_view(second),
        status=status,
        job=None if job is None else JobInfo.model_validate(job, from_attributes=True),
        compared=compared,
        sort=sort,
        sorts=SORT_NAMES,
        limit=limit,
        layer=layer,
        layers=layers,
        keys=keys,
        choices=choices(session, first) if second is None else [],
        start_url=urls.start_compare_url(model.slug),
    )


def other_run_or_error(session: Session, first: Run, b: int) -> Run:
    """Run `b`, of any model: 404 when there is none, 400 when it cannot be compared with `first`."""
    second = runs.get_run(session=session, run_id=b)
    if second is None:
        raise AppError(404, "Unknown run", f"There is no run {b}.", field="b")
    reason = comparison.why_not_comparable(first, second)
    if reason:
        raise AppError(400, "Runs not comparable", reason, field="b")
    return second


def run_view(run: Run) -> ComparedRun:
    return ComparedRun(
        id=run.id,
        model=run.model.slug,
        corpus=run.corpus.name,
        n_sentences=run.n_sentences,
        top_k=run.top_k,
        weights_sha256=(run.provenance or {}).get("weights_sha256"),
        url=urls.model_url(run.model.slug, run=run.id),
    )


def choices(session: Session, first: Run) -> list[RunChoice]:
    """Finished runs whose models have run `first`'s shape, newest first."""
    return [
        RunChoice(
            id=run.id,
            model=run.model.slug,
            corpus=run.corpus.name,
            n_sentences=run.n_sentences,
            top_k=run.top_k,
            url=urls.compare_url(first.model.slug, a=first.id, b=run.id),
        )
        for run in comparison.comparable_runs(session=session, run=first)
    ]


def compared_view(found: Comparison) -> Compared:
    details = found.details
    return Compared(
        basis=found.basis,
        triggers=BASIS_NAMES[found.basis],
        top_t=found.top_t,
        overlap=f"|A ∩ B| / max(|A|, |B|) of each key's top {found.top_t} triggers per sign",
        keys=details["keys"],
        values=details["values"],
        statistics="b − a (mean, positive share, max and min coefficient, density)",
        same_weights=bool(details.get("same_weights")),
        seconds=found.seconds,
    )


def key_view(row: KeyChange, first: Run, second: Run, flip: bool) -> KeyChangeView:
    """A stored row as b against a in the order asked (`flip`: stored the other way: negate the changes)."""
    sign = -1.0 if flip else 1.0

    def change(name: str) -> float | None:
        value = getattr(row, f"d_{name}")
        return None if value is None else sign * value + 0.0  # + 0.0: no −0.0

    return KeyChangeView(
        layer=row.layer,
        key=row.key,
        overlap=row.overlap,
        negative_overlap=row.negative_overlap,
        key_cosine=row.key_cosine,
        gate_cosine=row.gate_cosine,
        up_cosine=row.up_cosine,
        value_cosine=row.value_cosine,
        moved=row.moved,
        **{f"d_{name}": change(name) for name in comparison.STATISTICS},
        url_a=urls.key_url(first.model.slug, row.layer, row.key, run=first.id),
        url_b=urls.key_url(second.model.slug, row.layer, row.key, run=second.id),
    )


def start_comparison(session: Session, model: LanguageModel, a: int, b: int) -> None:
    """Queue the comparison of runs `a` (of the model) and `b` (a failed one again; a done one stays)."""
    first = run_or_404(session, model, a)
    second = other_run_or_error(session, first, b)
    comparison.enqueue_comparison(session=session, run_a=first.id, run_b=second.id)


COMPARISON_SERIES = {  # LayerChange field → legend, colour
    "mean_overlap": ("mean trigger overlap (positive)", POSITIVE),
    "mean_key_cosine": ("mean key cosine", NEGATIVE),
    "mean_value_cosine": ("mean value cosine", NEUTRAL),
}


def comparison_layers(layers: list[LayerChange]) -> dict:
    """Two runs side by side, per layer: the mean overlap of the memories' top triggers and the mean
    cosine of their keys and values between the two models (1: unchanged), on one axis up to 1."""
    lowest = min(
        [getattr(s, field) for s in layers for field in COMPARISON_SERIES if getattr(s, field) is not None]
        or [0.0]
    )
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": name,
                "x": [s.layer for s in layers],
                "y": [getattr(s, field) for s in layers],
                "line": {"color": color},
                "hovertemplate": f"layer %{{x}}: %{{y:.4f}}<extra>{name}</extra>",
            }
            for field, (name, color) in COMPARISON_SERIES.items()
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": "per layer: trigger overlap and weight cosines (1 = unchanged)"},
            "xaxis": layer_axis(len(layers)),
            "yaxis": {"range": [min(0.0, lowest) - 0.02, 1.05], "zeroline": True},
            "showlegend": True,
            "legend": {"orientation": "h", "y": -0.25},
            "height": 340,
            "margin": BASE_LAYOUT["margin"] | {"b": 90},
        },
    }
