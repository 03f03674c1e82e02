"""The live worker's HTTP face: GET /health and a POST route per request of ffmem.engine.live.protocol, each
run by the executor (ffmem/worker/live_executor.py).

Every refusal is in the app's error shape `{"ok": false, "error", "status"}` (with `"field"` when one
request field is at fault, e.g. a bad `target`: the app shows the message next to it); a 503 (busy, or the
requested model still loading) carries Retry-After.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ffmem.engine.errors import FfmemError
from ffmem.engine.live.protocol import (
    AblationAnswer,
    AblationRequest,
    CircuitAnswer,
    CircuitRequest,
    CoefficientsAnswer,
    CoefficientsRequest,
    TokenChangeReport,
    TokenChangeRequest,
    TokenMemoriesAnswer,
    TokenMemoriesRequest,
    TraceAnswer,
    TraceRequest,
)
from ffmem.engine.model.loaded import ModelLoadError
from ffmem.worker.live_executor import Live, LiveError

log = logging.getLogger("ffmem.worker")


def create_live_app(live: Live) -> FastAPI:
    """The worker's HTTP face: GET /health, POST /trace, /circuit, /coefficients, /ablation,
    /token-change, /token-memories."""
    app = FastAPI(title="ffmem live worker", version="0.1.0")
    app.state.live = live

    @app.get("/health")
    def health() -> dict:
        """What the worker holds and how busy it is."""
        return live.health()

    @app.post(TraceRequest.path)
    async def trace_prompt(request: TraceRequest) -> TraceAnswer:
        """Trace one prompt (see ffmem.engine.live.trace)."""
        return await live.run(request.model, lambda loaded: live.trace(loaded, request))

    @app.post(CircuitRequest.path)
    async def memory_circuit(request: CircuitRequest) -> CircuitAnswer:
        """A prompt's memory circuit for one position and target (see ffmem.engine.live.circuit)."""
        return await live.run(request.model, lambda loaded: live.circuit(loaded, request))

    @app.post(CoefficientsRequest.path)
    async def coefficients(request: CoefficientsRequest) -> CoefficientsAnswer:
        """One memory's coefficient at every token of a text, its max and min and where."""
        return await live.run(request.model, lambda loaded: live.coefficients(loaded, request))

    @app.post(AblationRequest.path)
    async def ablate(request: AblationRequest) -> AblationAnswer:
        """Target probabilities after each prefix with one memory as it is and switched off."""
        return await live.run(request.model, lambda loaded: live.ablation(loaded, request))

    @app.post(TokenChangeRequest.path)
    async def change(request: TokenChangeRequest) -> TokenChangeReport:
        """One memory amplified and switched off where its key fires: its TokenChange and output score."""
        return await live.run(request.model, lambda loaded: live.token_change(loaded, request))

    @app.post(TokenMemoriesRequest.path)
    async def token_memories(request: TokenMemoriesRequest) -> TokenMemoriesAnswer:
        """The memories whose values promote and suppress tokens most, past a run's stored depth."""
        return await live.run(request.model, lambda loaded: live.token_memories(loaded, request))

    @app.exception_handler(LiveError)
    async def live_error(request: Request, error: LiveError) -> JSONResponse:
        return _error(error.status, error.message, error.retry_after, error.field)

    @app.exception_handler(FfmemError)
    async def user_error(request: Request, error: FfmemError) -> JSONResponse:
        return _error(503 if isinstance(error, ModelLoadError) else 400, str(error), field=error.field)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("live worker failed on %s", request.url.path)
        return _error(500, f"the live worker failed: {type(error).__name__}; its log has the traceback")

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in error.errors())
        return _error(400, problems or "malformed request")

    return app


def _error(
    status: int, message: str, retry_after: int | None = None, field: str | None = None
) -> JSONResponse:
    """The app's error shape; `field`, when one request field is at fault, beside it."""
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    body = {"ok": False, "error": message, "status": status} | ({"field": field} if field else {})
    return JSONResponse(body, status_code=status, headers=headers)
