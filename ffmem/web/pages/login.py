"""The login page: whether this client may write, and why not (ffmem/web/access.py); the form to log in
with the admin token."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, Field

from ffmem.web import access, urls


class LoginContext(BaseModel):
    """Whether this client may write, and why (ffmem/web/access.py)."""

    page: str = "login"
    title: str
    can_write: bool
    read_only: bool = Field(description="The server takes no writes at all (FFMEM_READ_ONLY).")
    token_set: bool = Field(description="The server has an admin token: logging in can give write access.")
    name: str | None = Field(description="Who logged in (the cookie's name), if anyone.")
    reason: str | None = Field(description="Why this client may not write.")
    next: str = Field(description="Where the form goes back to.")


def back(path: str) -> str:
    """`path` when it is a path of this site, else the home page (no open redirect)."""
    return path if path.startswith("/") and not path.startswith(("//", "/\\")) else urls.home_url()


def login_page(request: Request, next: str = "/") -> LoginContext:
    refused = access.refusal(request)
    settings = request.app.state.settings
    return LoginContext(
        title="ffmem: log in",
        can_write=refused is None,
        read_only=settings.read_only,
        token_set=settings.admin_token is not None,
        name=access.admin_name(request),
        reason=refused.message if refused else None,
        next=back(next),
    )
