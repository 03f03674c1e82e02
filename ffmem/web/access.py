"""Who may write. Browsing and live traces are open to everyone; everything that writes or starts a
long computation (index runs, their retries and deletion, analyses, labels) needs write access:

- `read_only`: nobody writes, and the pages show no write control;
- an `admin_token`: the request sends it (`Authorization: Bearer …` or `X-Admin-Token`), or carries
  the signed cookie /login sets (SameSite=Strict, HttpOnly; it names who logged in, for labels);
- no token: a server bound to a loopback address (the default 127.0.0.1) lets its own machine write;
  one bound to another address refuses, saying how to set a token.
"""

from __future__ import annotations

from hmac import compare_digest

from fastapi import Request
from fastapi.responses import Response
from itsdangerous import BadSignature, URLSafeTimedSerializer

from ffmem.web.errors import AppError

COOKIE = "ffmem_admin"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def refusal(request: Request) -> AppError | None:
    """Why this request may not write, or None when it may."""
    settings = request.app.state.settings
    if settings.read_only:
        return AppError(403, "Read-only", "This server is read-only: it shows the index but changes nothing.")
    if settings.admin_token is None:
        if settings.host in LOOPBACK:
            return None
        return AppError(
            403,
            "Writes are off",
            f"This server listens on {settings.host} and has no admin token, so it refuses writes. "
            "Set FFMEM_ADMIN_TOKEN and log in at /login, or serve on 127.0.0.1.",
        )
    given = _sent_token(request)
    if given is not None:
        if compare_digest(given.encode(), settings.admin_token.get_secret_value().encode()):
            return None
        return AppError(403, "Wrong admin token", "The admin token sent does not match this server's.")
    if admin_name(request) is not None:
        return None
    return AppError(
        401,
        "Admin token needed",
        "Writing needs the admin token: log in at /login, or send it as `Authorization: Bearer <token>`.",
        headers={"WWW-Authenticate": "Bearer"},
    )


def require_write(request: Request) -> None:
    """A route dependency: refuse the request unless it may write."""
    refused = refusal(request)
    if refused is not None:
        raise refused


def can_write(request: Request) -> bool:
    return refusal(request) is None


def login_offered(request: Request) -> bool:
    """Whether logging in can give write access here: a token is set and the server is not read-only."""
    settings = request.app.state.settings
    return settings.admin_token is not None and not settings.read_only


def admin_name(request: Request) -> str | None:
    """The name in a valid login cookie ("" when none was given), or None."""
    settings = request.app.state.settings
    cookie = request.cookies.get(COOKIE)
    if cookie is None or settings.admin_token is None:
        return None
    try:
        payload = _signer(settings).loads(cookie, max_age=settings.admin_session_hours * 3600)
    except BadSignature:  # also an expired one
        return None
    return payload.get("name", "") if isinstance(payload, dict) else None


def login_refusal(request: Request, token: str) -> AppError | None:
    """Why `token` does not log in here, or None when it is the admin token."""
    settings = request.app.state.settings
    if settings.read_only:
        return AppError(403, "Read-only", "This server is read-only: there is nothing to log in for.")
    if settings.admin_token is None:
        return AppError(
            400, "No admin token", "This server has no admin token to log in with (FFMEM_ADMIN_TOKEN)."
        )
    if not compare_digest(token.encode(), settings.admin_token.get_secret_value().encode()):
        return AppError(403, "Wrong admin token", "The admin token entered does not match this server's.")
    return None


def remember(request: Request, response: Response, name: str) -> None:
    """Set the login cookie (signed, naming `name`) on `response`."""
    settings = request.app.state.settings
    response.set_cookie(
        COOKIE,
        _signer(settings).dumps({"name": name}),
        max_age=int(settings.admin_session_hours * 3600),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def log_out(response: Response) -> None:
    response.delete_cookie(COOKIE, httponly=True, samesite="strict")


def _sent_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.headers.get("x-admin-token")


def _signer(settings) -> URLSafeTimedSerializer:
    """Cookies signed with the admin token: changing the token logs everyone out."""
    return URLSafeTimedSerializer(settings.admin_token.get_secret_value(), salt="ffmem-admin-login")
