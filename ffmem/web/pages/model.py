"""The model page: statistics per layer of one index run, and charts across layers."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import analyses
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import LayerFigures, results_for
from ffmem.web.charts import BASE_LAYOUT, NEUTRAL, POSITIVE, layer_axis
from ffmem.web.views import ModelInfo, Provisional, RunInfo, model_info, run_info

LayerSummary = LayerFigures  # the model page's rows are the store's per-layer figures, as they are

Quartiles = list[float] | None  # [first quartile, median, third quartile]; null: none scored


class LayerExplanationScores(BaseModel):
    """A layer's explanation scores by the scoring protocol, over its memories' stronger sides, each
    beside its control (another memory's pattern of the layer scored the same way: chance)."""

    layer: int
    pooled: Quartiles = Field(description="Pooled Pearson over top and random held-out records, 1:1.")
    pooled_control: Quartiles
    random: Quartiles = Field(description="Pearson over the random records alone.")
    random_control: Quartiles
    auroc: Quartiles = Field(description="AUROC of the match for the positions where the memory fires.")
    auroc_control: Quartiles


class QuadrantMedian(BaseModel):
    """One score's median over the memories scored in a quadrant: all layers, then each depth third."""

    all: float | None = Field(description="Over every layer (null: no memory scored).")
    thirds: list[float | None] = Field(description="Over the lower, middle and upper third of the layers.")


class QuadrantExplanationScores(BaseModel):
    """A gated run's explanations of one sign quadrant (each memory's quadrant described and scored on its
    own records), each score beside its control."""

    quadrant: str = Field(description="pp, pn, np or nn: the gate's sign, then the input's (p: ≥ 0, n: < 0).")
    pooled: QuadrantMedian
    pooled_control: QuadrantMedian
    random: QuadrantMedian
    random_control: QuadrantMedian
    auroc: QuadrantMedian
    auroc_control: QuadrantMedian


class ExplanationScores(BaseModel):
    """How well the run's automatic explanations predict their memories (ffmem.worker.explanations)."""

    top_records: int = Field(description="Top held-out records per memory and side.")
    random_records: int = Field(description="Random held-out records, the same for every memory.")
    held_out_sentences: int
    layers: list[LayerExplanationScores]
    quadrants: list[QuadrantExplanationScores] | None = Field(
        None,
        description="A gated run explained per quadrant: each quadrant's medians with their controls "
        "(null: an ungated model, or a run explained without quadrants).",
    )


class DepthThird(BaseModel):
    """The output scores of a run's TokenChange sample in one depth third (ffmem.worker.token_changes)."""

    third: str = Field(description="lower, middle or upper layers.")
    memories: int
    overlap: float | None = Field(description="Median top-10 overlap of VocabProj with TokenChange.")
    spearman: float | None = Field(description="Median rank correlation of the value's logits with it.")
    control_overlap: float | None = Field(description="The same of the control memories.")
    control_spearman: float | None


class ModelContext(BaseModel):
    """A model's layers in one index run."""

    page: str = "model"
    title: str
    model: ModelInfo
    run: RunInfo
    layers: list[LayerSummary] = Field(description="One row per layer: means over its keys unless named.")
    explanations: ExplanationScores | None = Field(
        None,
        description="Per layer, its explanations' scores with their controls (null: none by the protocol).",
    )
    provisional: Provisional = None
    token_change: list[DepthThird] | None = Field(
        None, description="What values write, measured on the run's sample, per depth third (null: none)."
    )


def model_page(session: Session, model: LanguageModel, run: Run) -> ModelContext:
    results = results_for(session, run)
    return ModelContext(
        title=f"{model.slug}: layers",
        model=model_info(model),
        run=run_info(run),
        layers=results.layer_figures(),
        explanations=explanation_scores(session, run),
        provisional=results.coverage(),
        token_change=depth_thirds(session, run),
    )


def depth_thirds(session: Session, run: Run) -> list[DepthThird] | None:
    """The run's TokenChange medians per depth third, as its token_change step stored them."""
    found = analyses.stored_analyses(session=session, run_id=run.id).get("token_change")
    if found is None:
        return None
    return [DepthThird(third=name, **figures) for name, figures in found.data["thirds"].items()]


def explanation_scores(session: Session, run: Run) -> ExplanationScores | None:
    """The explanations step's figures as stored with the run's analyses (None: explained before the
    scoring protocol, or not yet)."""
    found = analyses.stored_analyses(session=session, run_id=run.id).get("explanations")
    data = found.data if found is not None else {}
    if "layers" not in data:
        return None
    return ExplanationScores(
        top_records=data["top_records"],
        random_records=data["random_records"],
        held_out_sentences=data["held_out_sentences"],
        layers=data["layers"],
        quadrants=[
            QuadrantExplanationScores(quadrant=quadrant, **medians)
            for quadrant, medians in data.get("quadrant_medians", {}).items()
        ]
        or None,
    )


LAYER_SERIES = {
    "positive_share": "share of positive coefficients (m > 0)",
    "density": "density (|m| near each key's peak)",
    "max_prob": "max value probability",
    "agreement_rate": "agreement rate (value's top token = next token)",
}
SHARES = ("positive_share", "density", "agreement_rate")  # drawn as percentages


def layer_lines(layers: list[LayerSummary], field: str) -> dict:
    """One statistic across layers, as a line with markers, on an honest y-axis: from 0; the positive
    share over 0–100% with 50% marked, so a layer at 50.3% does not look far from one at 49.8%."""
    values = [getattr(s, field) for s in layers]
    top = max((v for v in values if v is not None), default=0.0)
    yaxis: dict = {"range": [0, 1.15 * top if top > 0 else 0.05 if field in SHARES else 1], "zeroline": True}
    shapes = []
    if field == "positive_share":
        yaxis["range"] = [0, 1]
        shapes = [
            {
                "type": "line",
                "xref": "paper",
                "x0": 0,
                "x1": 1,
                "y0": 0.5,
                "y1": 0.5,
                "line": {"color": NEUTRAL, "width": 1, "dash": "dot"},
            }
        ]
    if field in SHARES:
        yaxis["tickformat"] = ".0%" if field == "positive_share" else ".1%"
    hover = "%{y:.2%}" if field in SHARES else "%{y:.4g}"
    return {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": [s.layer for s in layers],
                "y": values,
                "line": {"color": POSITIVE},
                "hovertemplate": "layer %{x}: " + hover + "<extra></extra>",
            }
        ],
        "layout": BASE_LAYOUT
        | {
            "title": {"text": LAYER_SERIES[field]},
            "xaxis": layer_axis(len(layers)),
            "yaxis": yaxis,
            "shapes": shapes,
            "height": 280,
        },
    }
