"""The web process's client of the live worker (ffmem/worker/live_server.py): every failure becomes an AppError
that says what happened and what to do — the browse pages never depend on the worker."""

from __future__ import annotations

import httpx

from ffmem.web.errors import AppError, sentence

START = (
    "Start one with `ffmem worker` (or `ffmem serve`, which starts one); the browse pages work without it."
)


class LiveWorker:
    def __init__(self, url: str, timeout: float, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = client or httpx.Client(base_url=self.url, timeout=timeout)

    def trace(self, payload: dict) -> dict:
        return self._post("/trace", payload)

    def ablation(self, payload: dict) -> dict:
        return self._post("/ablation", payload)

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
            message = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            message = f"the live worker answered {response.status_code}"
        if response.status_code == 503:
            retry = {"Retry-After": response.headers.get("Retry-After", "5")}
            raise AppError(503, "Live worker busy", sentence(message), headers=retry)
        if 400 <= response.status_code < 500:
            raise AppError(400, "Bad request", sentence(message))
        raise AppError(502, "Live worker failed", sentence(message))
