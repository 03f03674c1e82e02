"""Logging in with the admin token (a signed cookie) and out; /login.json tells a client whether it
may write and why not (ffmem/web/access.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ffmem.web import access, urls
from ffmem.web.pages.login import LoginContext, back, login_page
from ffmem.web.rendering import render
from ffmem.web.routes import action, page
from ffmem.web.wants import wants_json

router = APIRouter()
Next = Annotated[str, Query(max_length=500, description="A path of this site to go back to.")]


@page(router, "/login", "login", LoginContext)
def login(request: Request, next: Next = "/"):
    """Whether this client may write; the form to log in with the admin token."""
    return render(request, "login.html", login_page(request, next))


LOGIN_ERRORS = {
    400: "This server has no admin token to log in with.",
    403: "A wrong admin token, or a read-only server.",
}


@action(router, "/login", "log_in", LoginContext, writes=False, errors=LOGIN_ERRORS)
def _log_in(
    request: Request,
    token: Annotated[str, Form(max_length=500, description="The server's admin token.")],
    name: Annotated[str, Form(max_length=100, description="Your name, recorded with your labels.")] = "",
    next: Annotated[str, Form(max_length=500, description="A path of this site to go back to.")] = "/",
) -> Response:
    """Log in with the admin token (sets a signed cookie); the JSON twin answers with the new state."""
    refused = access.login_refusal(request, token)
    if refused is not None:
        raise refused
    name = name.strip()
    if wants_json(request):
        ctx = login_page(request, next).model_copy(update={"can_write": True, "reason": None, "name": name})
        response: Response = JSONResponse(ctx.model_dump(mode="json"))
    else:
        response = RedirectResponse(back(next), status_code=303)
    access.remember(request, response, name)
    return response


@action(router, "/logout", "log_out", writes=False)
def _log_out(request: Request) -> Response:
    """Log out (clears the login cookie)."""
    if wants_json(request):
        response: Response = JSONResponse({"ok": True})
    else:
        response = RedirectResponse(urls.home_url(), status_code=303)
    access.log_out(response)
    return response
