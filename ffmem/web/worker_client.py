"""The web process's client of the live worker (ffmem/worker/live_server.py): every failure becomes an
AppError that says what happened and what to do — the browse pages never depend on the worker. Answers
are parsed into the models the worker answers with (ffmem/engine/live/trace_answer.py)."""

from __future__ import annotations

from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from ffmem.engine.live.trace_answer import AblationAnswer, CircuitAnswer, CoefficientsAnswer, TraceAnswer
from ffmem.web.errors import AppError, sentence

Answer = TypeVar("Answer", bound=BaseModel)
CHARS_PER_TOKEN = 32  # a text longer than this many characters a token is refused before the worker


def text_max_length(max_tokens: int) -> int:
    """The longest text a box sends to the worker, in characters (the worker then counts its tokens)."""
    return CHARS_PER_TOKEN * max_tokens


START = (
    "Start one with `ffmem worker` (or `ffmem serve`, which starts one); the browse pages work without it."
)


class LiveWorker:
    def __init__(self, url: str, timeout: float, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = client or httpx.Client(base_url=self.url, timeout=timeout)

    def trace(self, payload: dict) -> TraceAnswer:
        return self._parse(TraceAnswer, self._post("/trace", payload))

    def circuit(self, payload: dict) -> CircuitAnswer:
        return self._parse(CircuitAnswer, self._post("/circuit", payload))

    def coefficients(self, payload: dict) -> CoefficientsAnswer:
        return self._parse(CoefficientsAnswer, self._post("/coefficients", payload))

    def ablation(self, payload: dict) -> AblationAnswer:
        return self._parse(AblationAnswer, self._post("/ablation", payload))

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

    def _post(self, path: str, payload: dict) -> dict:
        try:
            response = self.client.post(path, json=payload)
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
