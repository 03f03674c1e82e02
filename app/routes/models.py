"""Home (models and their runs) and the model page (statistics across layers)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app import pages
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
