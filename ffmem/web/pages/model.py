"""The model page: statistics per layer of one index run, and charts across layers."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.store.results import LayerFigures, results_for
from ffmem.web.views import ModelInfo, Provisional, RunInfo, model_info, run_info

LayerSummary = LayerFigures  # the model page's rows are the store's per-layer figures, as they are


class ModelContext(BaseModel):
    """A model's layers in one index run."""

    page: str = "model"
    title: str
    model: ModelInfo
    run: RunInfo
    layers: list[LayerSummary] = Field(description="One row per layer: means over its keys unless named.")
    provisional: Provisional = None


def model_page(session: Session, model: LanguageModel, run: Run) -> ModelContext:
    results = results_for(session, run)
    return ModelContext(
        title=f"{model.slug}: layers",
        model=model_info(model),
        run=run_info(run),
        layers=results.layer_figures(),
        provisional=results.coverage(),
    )
