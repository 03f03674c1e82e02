"""What a route needs, resolved once per request as FastAPI dependencies (as full-stack-fastapi-template's
`api/deps.py`): the database session, the settings, and the lookups of ffmem/web/lookups.py — the model of
the path's `{model}`, the index run (`?run=`, else the newest), the path's `{layer}` and `{key}`, and a job,
each checked to exist. A route receives them and never looks them up itself; a lookup that fails answers
with its AppError (a 404, or a 503 with Retry-After and a link while the index is being built) before the
route runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from sqlalchemy.orm import Session

from ffmem.config import Settings
from ffmem.store.models import Job, LanguageModel, Run
from ffmem.web.errors import AppError
from ffmem.web.lookups import check_key, check_layer, model_or_404, run_or_404


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A read session on the app's database, closed after the response. Async, so that FastAPI runs it on
    the event loop, not twice in the thread pool: opening a session does no I/O (the route's first query,
    in its thread, takes a connection); closing it hands the connection back."""
    with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def get_settings(request: Request) -> Settings:
    """The app's settings (ffmem/config.py), as `create_app` was given them."""
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


def get_model(session: SessionDep, model: str) -> LanguageModel:
    """The model of the path's `{model}` slug."""
    return model_or_404(session, model)


ModelDep = Annotated[LanguageModel, Depends(get_model)]

RunQuery = Annotated[
    int | None, Query(ge=1, le=2**31 - 1, description="Pin an index run (default: the newest finished one).")
]


def get_pinned(run: RunQuery = None) -> int | None:
    """The index run the URL pins (`?run=`), if it pins one."""
    return run


PinnedDep = Annotated[int | None, Depends(get_pinned)]


def get_run(session: SessionDep, model: ModelDep, pinned: PinnedDep) -> Run:
    """The pinned run of the model, else its newest finished one, else the one being built (provisional)."""
    return run_or_404(session, model, pinned)


RunDep = Annotated[Run, Depends(get_run)]


def get_layer(model: ModelDep, layer: int) -> int:
    """The path's `{layer}`, one the model has."""
    check_layer(model, layer)
    return layer


LayerDep = Annotated[int, Depends(get_layer)]


def get_key(model: ModelDep, layer: LayerDep, key: int) -> int:
    """The path's `{key}`, one the layer has (the layer checked first)."""
    check_key(model, layer, key)
    return key


KeyDep = Annotated[int, Depends(get_key)]

# Job ids are the database's 32-bit integers: a larger one is a 400, not an overflow in the query.
JobId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The job's number.")]


def get_job(session: SessionDep, job_id: JobId) -> Job:
    """The job of the path's `{job_id}`."""
    job = session.get(Job, job_id)
    if job is None:
        raise AppError(404, "Unknown job", f"There is no job {job_id}.")
    return job


JobDep = Annotated[Job, Depends(get_job)]
