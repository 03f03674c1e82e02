"""render(request, template, ctx): the JSON twin for `.json` paths, an htmx fragment when htmx asks
for one, the full page otherwise — always from the same context object.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel

from ffmem.engine.live.protocol import text_max_length
from ffmem.store.models import JobKind, JobStatus
from ffmem.web import urls
from ffmem.web.access import admin_name, can_write, label_author, login_offered
from ffmem.web.display import (
    coefficient_bar,
    duration,
    number,
    percent,
    sentences,
    signed,
    tail_words,
    tok,
    visible,
    without_bidi_controls,
)
from ffmem.web.errors import AppError
from ffmem.web.pages import analysis, circuit, compare, composition, key_charts, model, trace_charts
from ffmem.web.shading import shaded_html
from ffmem.web.wants import wants_fragment, wants_json

TEMPLATES = Path(__file__).resolve().parent / "templates"
templates = Jinja2Templates(directory=TEMPLATES)
templates.env.auto_reload = False  # templates change with the package only: no file check per render
templates.env.finalize = without_bidi_controls  # every shown value, before escaping (ffmem.web.display)
templates.env.filters.update(visible=visible, number=number, percent=percent, tail_words=tail_words)
templates.env.filters.update(sentences=sentences)  # a run's sentences: a count, or all
templates.env.globals.update(
    urls=urls, can_write=can_write, admin_name=admin_name, login_offered=login_offered
)
# Each page's figures, beside the page: `pages.model.layer_lines(…)`, `pages.key_charts.value_bars(…)`.
templates.env.globals.update(
    pages=SimpleNamespace(
        analysis=analysis,
        circuit=circuit,
        compare=compare,
        composition=composition,
        key_charts=key_charts,
        model=model,
        trace_charts=trace_charts,
    )
)
templates.env.globals.update(label_author=label_author, duration=duration, shaded=shaded_html)
templates.env.globals.update(tok=tok, coefficient_bar=coefficient_bar, signed=signed)  # ffmem.web.display
templates.env.globals.update(text_max_length=text_max_length)  # what the live boxes may send
templates.env.globals.update(JobKind=JobKind, JobStatus=JobStatus)  # templates compare with these


def render(
    request: Request,
    template: str,
    ctx: BaseModel,
    fragment: str | None = None,
    *,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
    field_errors: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
) -> Response:
    """The page for `ctx`: JSON for `.json`, `fragment` for htmx requests that target it, else the page.

    `field_errors`: why a form field's value was refused, shown next to it (`#FIELD-error`); `form`: the
    values typed into the refused form, kept in its fields."""
    if wants_json(request):
        # pydantic's own serialiser: the standard library's took twice as long on a key page.
        body = ctx.model_dump_json()
        return Response(body, status_code=status_code, headers=headers, media_type="application/json")
    name = template
    if fragment and request.headers.get("HX-Request") and request.headers.get("HX-Target") == fragment:
        name = f"_{fragment}.html"
    context = {
        "ctx": ctx,
        "json_url": twin_url(request),
        "field_errors": field_errors or {},
        "form": form or {},
    }
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=headers)


def twin_url(request: Request) -> str:
    """This page's JSON twin: the same path with `.json` appended, the same query."""
    path = request.url.path
    twin = "/.json" if path == "/" else f"{path}.json"
    return f"{twin}?{request.url.query}" if request.url.query else twin


def render_error(request: Request, error: AppError) -> Response:
    """The one error shape. To an htmx request, the message alone (`X-Error-Message`): the page keeps
    everything else, the element the answer was going to included, and shows it next to the field that
    caused it (`X-Error-Field`, static/app.js), else just before that element; the URL is not pushed."""
    if wants_json(request):
        body = {"ok": False, "error": error.message, "status": error.status}
        if error.link:
            body["link"] = error.link[0]
        return JSONResponse(body, status_code=error.status, headers=error.headers)
    if wants_fragment(request):
        # innerHTML: never in place of the element the answer was going to (htmx then loses its target)
        message = {"HX-Push-Url": "false", "HX-Reswap": "innerHTML", "X-Error-Message": "true"}
        headers = error.headers | message
        if error.field:
            headers["X-Error-Field"] = error.field
        return templates.TemplateResponse(
            request, "_error.html", {"error": error}, status_code=error.status, headers=headers
        )
    return templates.TemplateResponse(
        request,
        "error.html",
        {"error": error, "json_url": None},
        status_code=error.status,
        headers=error.headers,
    )


def render_unanswered(
    request: Request,
    error: AppError,
    template: str,
    fragment: str,
    unanswered: Callable[[str, str | None], BaseModel],
) -> Response:
    """A live page's answer when the live worker gives none (`error`). JSON: the error. To htmx, a bad
    field's message alone, next to it (the answer on the page stays). Else the page (or its `fragment`, to
    htmx) keeps its form and says why there is no answer: `unanswered(notice, field)` is its context — a bad
    input next to its field; too many live requests, or the worker down, busy or failed, in a notice."""
    if wants_json(request):
        raise error
    if error.field and wants_fragment(request):
        return render_error(request, error)
    notice = error.message if error.field else f"{error.title}: {error.message}"
    context = unanswered(notice, error.field)
    return render(request, template, context, fragment, status_code=error.status, headers=error.headers)
