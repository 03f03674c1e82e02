"""The home page: the indexed models and their runs, the recent jobs, where a newcomer goes next, and the
form that starts an index run."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import jobs, runs
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel
from ffmem.web import urls
from ffmem.web.pages.corpora import CorpusChoice
from ffmem.web.views import JobInfo, ModelInfo, RunInfo, model_info, run_info

EXAMPLE_PROMPT = "The capital of France is"


class ModelEntry(BaseModel):
    """A model and its index runs, the newest first."""

    model: ModelInfo
    runs: list[RunInfo]


class StartHere(BaseModel):
    """Where a newcomer goes next: pages of the first model whose index can be browsed."""

    model: str = Field(description="The model's slug.")
    prompt: str = Field(description="An example prompt for the live view.")
    live_view: str = Field(description="That prompt traced.")
    search: str = Field(description="The model's search page.")
    analysis: str = Field(description="The paper's analyses on the model.")
    layers: str = Field(description="The model page: statistics per layer.")
    top_layer: str = Field(
        description="The last layer's keys, those whose triggers' next tokens are their value's top first."
    )


class HomeContext(BaseModel):
    """The indexed models and their runs, and the newest jobs."""

    page: str = "home"
    title: str
    models: list[ModelEntry]
    jobs: list[JobInfo] = Field(description="The newest first.")
    start: StartHere | None = Field(None, description="Null until a model has an index to browse.")
    corpora: list[CorpusChoice] = Field(
        [], description="The bundled corpus and the uploaded ones, for the index form."
    )


def home_page(session: Session, offered: list[CorpusChoice] | None = None) -> HomeContext:
    """`offered`: the corpora the index form offers (ffmem/web/pages/corpora.py)."""
    models = runs.list_models(session=session)
    entries = [ModelEntry(model=model_info(m), runs=[run_info(r) for r in reversed(m.runs)]) for m in models]
    recent = [JobInfo.model_validate(job, from_attributes=True) for job in jobs.recent_jobs(session=session)]
    return HomeContext(
        title="ffmem: feed-forward memories",
        models=entries,
        jobs=recent,
        start=start_here(session, models),
        corpora=offered or [],
    )


def start_here(session: Session, models: list[LanguageModel]) -> StartHere | None:
    """The next steps for a newcomer, on the first model with a finished index run."""
    for model in models:
        if runs.latest_finished_run(session=session, model_id=model.id) is not None:
            slug = model.slug
            return StartHere(
                model=slug,
                prompt=EXAMPLE_PROMPT,
                live_view=urls.trace_url(slug, text=EXAMPLE_PROMPT),
                search=urls.search_url(slug),
                analysis=urls.analysis_url(slug),
                layers=urls.model_url(slug),
                top_layer=urls.layer_url(slug, model.n_layers - 1, sort="agreement", order="desc"),
            )
    return None
