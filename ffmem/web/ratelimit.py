"""Per-client rate limits on the live routes (traces and ablations): the `limits` library's moving
window, counted in the web process's memory by client address (`settings.trace_rate_limit`). Past the
limit a request gets a 429 AppError whose Retry-After is the whole seconds after which the window has
freed a slot (floor + 1: the moving window still refuses at its exact edge); browsing is never limited.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from ffmem.web.errors import AppError
from ffmem.web.wants import wants_result

SCOPE = "live"


class LiveLimit:
    """The limits of one app (none when `spec` is '' or '0'), each client counted apart."""

    def __init__(self, spec: str) -> None:
        self.items: list[RateLimitItem] = [] if spec.strip() in ("", "0") else parse_many(spec)
        self.limiter = MovingWindowRateLimiter(MemoryStorage())

    def spend(self, client: str) -> AppError | None:
        """Count one request of `client`: None when allowed, else the 429 to answer (refusals don't count)."""
        allowed = all(self.limiter.test(item, SCOPE, client) for item in self.items)
        if allowed and all(self.limiter.hit(item, SCOPE, client) for item in self.items):
            return None
        full = [item for item in self.items if not self.limiter.test(item, SCOPE, client)] or self.items
        resets = [self.limiter.get_window_stats(item, SCOPE, client).reset_time for item in full]
        wait = max(1, int(max(resets) - time.time()) + 1)
        rates = " and ".join(_rate(item) for item in full)
        return AppError(
            429,
            "Too many live requests",
            f"Live traces and tests are limited to {rates} per client; try again in {wait} s. "
            "The browse pages and search are not limited.",
            headers={"Retry-After": str(wait)},
        )


def _rate(item: RateLimitItem) -> str:
    """'30 per minute', '100 per 5 minutes'."""
    unit = item.GRANULARITY.name
    return (
        f"{item.amount} per {unit}" if item.multiples == 1 else f"{item.amount} per {item.multiples} {unit}s"
    )


def client_address(request: Request) -> str:
    """The client's address (behind a trusted proxy, uvicorn has already put X-Forwarded-For's there)."""
    return request.client.host if request.client else "unknown"


async def spend(request: Request) -> AppError | None:
    """Dependency of the live routes: spend one of this client's requests; the 429 to raise if refused.

    The route raises it itself, so that the trace page can answer with its form and the notice."""
    state = request.app.state
    limit = getattr(state, "live_limit", None)
    if limit is None:  # one per app, made on its first live request (the event loop: no race)
        limit = state.live_limit = LiveLimit(state.settings.trace_rate_limit)
    return limit.spend(client_address(request))


async def spend_on_text(request: Request) -> AppError | None:
    """Dependency of a browse page whose live part `?text=` asks for (the key page's "try your own text"):
    spends one of the client's live requests only when the URL holds a text; browsing is never limited."""
    return None if request.query_params.get("text") is None else await spend(request)


async def spend_on_result(request: Request) -> AppError | None:
    """Dependency of a live page that renders at once and has htmx load its result (the ablation page):
    spends one of the client's live requests on the result only (its htmx fragment or its JSON twin)."""
    return await spend(request) if wants_result(request) else None


LiveBudget = Annotated[AppError | None, Depends(spend)]
LiveTextBudget = Annotated[AppError | None, Depends(spend_on_text)]
LiveResultBudget = Annotated[AppError | None, Depends(spend_on_result)]
