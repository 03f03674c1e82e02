"""Home (models and their runs) and the model page (statistics across layers)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app import analysis_page, pages
from app.rendering import render
from app.routes import SessionDep, page

router = APIRouter()
RunQuery = Annotated[
    int | None, Query(ge=1, le=2**31 - 1, description="Pin an index run (default: the newest finished one).")
]


@page(router, "/", "home")
def home(request: Request, session: SessionDep):
    """The indexed models and their index runs."""
    return render(request, "home.html", pages.home_page(session))


@page(router, "/m/{model}", "model")
def model(request: Request, session: SessionDep, model: str, run: RunQuery = None):
    """One model: statistics per layer, and charts across layers."""
    return render(request, "model.html", pages.model_page(session, model, run))


@page(router, "/m/{model}/analysis", "analysis")
def analysis(request: Request, session: SessionDep, model: str, run: RunQuery = None):
    """The paper's analyses (Figs. 3–11) on an index run, beside the paper's own values."""
    return render(request, "analysis.html", analysis_page.analysis_page(session, model, run))
