"""The web process's client of the live worker (ffmem/worker/live_app.py): every failure becomes an AppError
that says what happened and what to do — the browse pages never depend on the worker. It sends the
requests of ffmem/engine/live/protocol.py, serialized, and parses the answers into that module's models,
the ones the worker answers with."""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

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
from ffmem.web.errors import AppError, sentence

Answer = TypeVar("Answer", bound=BaseModel)
JSON = {"Content-Type": "application/json"}


START = (
    "Start one with `ffmem worker` (or `ffmem serve`, which starts one); the browse pages work without it."
)


class LiveWorker:
    def __init__(self, url: str, timeout: float, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = client or httpx.Client(base_url=self.url, timeout=timeout)

    def trace(self, request: TraceRequest) -> TraceAnswer:
        return self._parse(TraceAnswer, self._post(request.path, request))

    def circuit(self, request: CircuitRequest) -> CircuitAnswer:
        return self._parse(CircuitAnswer, self._post(request.path, request))

    def coefficients(self, request: CoefficientsRequest) -> CoefficientsAnswer:
        return self._parse(CoefficientsAnswer, self._post(request.path, request))

    def ablation(self, request: AblationRequest) -> AblationAnswer:
        return self._parse(AblationAnswer, self._post(request.path, request))

    def token_change(self, request: TokenChangeRequest) -> TokenChangeReport:
        return self._parse(TokenChangeReport, self._post(request.path, request))

    def token_memories(
        self, request: TokenMemoriesRequest, timeout: float | None = None
    ) -> TokenMemoriesAnswer:
        """`timeout`: seconds to wait, when not the client's (a search waits less than a trace)."""
        return self._parse(TokenMemoriesAnswer, self._post(request.path, request, timeout))

    def _parse(self, model: type[Answer], answer: dict) -> Answer:
        """The worker's answer as `model`; one of another shape (a worker of another version) is a 502."""
        try:
            return model.model_validate(answer)
        except ValidationError as error:
            problem = error.errors()[0]
            where = ".".join(map(str, problem["loc"])) or "the answer"
            raise AppError(
                502,
                "Live worker failed",
                f"The live worker at {self.url} answered a {model.__name__} this explorer cannot read "
                f"({where}: {problem['msg']}); run the same ffmem version on both.",
            ) from None

    def health(self) -> dict:
        """The worker's state, or {"status": "down", "error": …} when it does not answer."""
        try:
            response = self.client.get("/health", timeout=2.0)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as error:
            return {
                "status": "down",
                "error": f"no live worker answers at {self.url} ({type(error).__name__})",
            }

    def _post(self, path: str, request: BaseModel, timeout: float | None = None) -> dict:
        waits = {} if timeout is None else {"timeout": timeout}
        try:
            response = self.client.post(path, content=request.model_dump_json(), headers=JSON, **waits)
        except httpx.TimeoutException:
            raise AppError(
                504,
                "Live worker timed out",
                f"The live worker at {self.url} did not answer in time; try a shorter prompt.",
            ) from None
        except httpx.HTTPError as error:
            raise AppError(
                503,
                "Live worker unavailable",
                f"No live worker answers at {self.url} ({type(error).__name__}). {START}",
                headers={"Retry-After": "5"},
            ) from None
        if response.status_code == 200:
            return response.json()
        try:
            body = response.json()
            message, field = body["error"], body.get("field")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, field = f"the live worker answered {response.status_code}", None
        if response.status_code == 503:
            retry = {"Retry-After": response.headers.get("Retry-After", "5")}
            raise AppError(503, "Live worker busy", sentence(message), headers=retry)
        if 400 <= response.status_code < 500:
            raise AppError(400, f"Bad {field}" if field else "Bad request", sentence(message), field=field)
        raise AppError(502, "Live worker failed", sentence(message))
