"""What a request asks for: the JSON twin (the same path plus `.json`), an htmx fragment, or the page."""

from __future__ import annotations

from fastapi import Request


def wants_json(request: Request) -> bool:
    return request.url.path.endswith(".json")


def wants_fragment(request: Request) -> bool:
    """An htmx request: it swaps a part of the page."""
    return bool(request.headers.get("HX-Request"))


def wants_result(request: Request) -> bool:
    """The JSON twin or an htmx fragment: what a page that renders at once (the ablation page) loads after."""
    return wants_json(request) or wants_fragment(request)
