"""Who may write. Browsing and live traces are open to everyone; everything that writes or starts a
long computation (index runs, their retries and deletion, analyses, labels) needs write access:

- `read_only`: nobody writes, and the pages show no write control;
- an `admin_token`: the request sends it (`Authorization: Bearer …` or `X-Admin-Token`), or carries
  the signed cookie /login sets (SameSite=Strict, HttpOnly; it names who logged in, for labels);
- no token: a server bound to a loopback address (the default 127.0.0.1) lets its own machine write:
  the *client* must be on this machine (its address, after uvicorn has applied a trusted proxy's
  X-Forwarded-For, is a loopback one, or it has no IP address: a Unix socket or an in-process client)
  and the request must not have come through a proxy (no Forwarded, X-Forwarded-For or X-Real-IP
  header, trusted or not): behind a reverse proxy on the same machine every internet client arrives
  from 127.0.0.1, so only a token can tell them apart. A server bound to another address refuses.
  Each refusal says how to set a token.
"""

from __future__ import annotations

from hmac import compare_digest
from ipaddress import IPv6Address, ip_address
from urllib.parse import quote, unquote

from fastapi import Request
from fastapi.responses import Response
from itsdangerous import BadSignature, URLSafeTimedSerializer

from ffmem.web.errors import AppError

COOKIE = "ffmem_admin"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")  # a proxy passed the request on


def refusal(request: Request) -> AppError | None:
    """Why this request may not write, or None when it may."""
    settings = request.app.state.settings
    if settings.read_only:
        return AppError(403, "Read-only", "This server is read-only: it shows the index but changes nothing.")
    if settings.admin_token is None:
        return _local_refusal(request)
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


def _local_refusal(request: Request) -> AppError | None:
    """Without a token: None for a request from this machine, straight to a server on loopback."""
    host = request.app.state.settings.host
    if host not in LOOPBACK:
        return AppError(
            403,
            "Writes are off",
            f"This server listens on {host} and has no admin token, so it refuses writes. "
            "Set FFMEM_ADMIN_TOKEN and log in at /login, or serve on 127.0.0.1.",
        )
    proxied = [name for name in PROXY_HEADERS if name in request.headers]
    if proxied:
        return AppError(
            403,
            "Writes are off",
            f"This request came through a proxy (it carries {_header_names(proxied)}) and this server has "
            "no admin token, so it refuses writes: behind a proxy every client looks local. "
            "Set FFMEM_ADMIN_TOKEN and log in at /login.",
        )
    client = request.client.host if request.client else None
    if not _on_this_machine(client):
        return AppError(
            403,
            "Writes are off",
            f"This request comes from {client}, not from this machine, and this server has no admin "
            "token, so it refuses writes. Set FFMEM_ADMIN_TOKEN and log in at /login.",
        )
    return None


def _on_this_machine(client: str | None) -> bool:
    """Whether a client address is this machine's: a loopback address (IPv4-mapped too), or no network
    address at all (None or a bare name: a Unix socket's peer, an in-process test client)."""
    if client is None:
        return True
    try:
        address = ip_address(client)
    except ValueError:
        return "." not in client and ":" not in client  # a bare name such as "testclient" or "localhost"
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _header_names(names: list[str]) -> str:
    shown = {"forwarded": "Forwarded", "x-forwarded-for": "X-Forwarded-For", "x-real-ip": "X-Real-IP"}
    return " and ".join(shown[name] for name in names)


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


AUTHOR_COOKIE = "ffmem_author"  # the name last given with a label, offered again in the label form


def label_author(request: Request) -> str:
    """The author a label form starts with: the name just saved, the login's name, or the last one given."""
    saved = getattr(request.state, "label_author", None)
    if saved is not None:
        return saved
    return admin_name(request) or unquote(request.cookies.get(AUTHOR_COOKIE, ""))[:100]


def remember_author(request: Request, response: Response, author: str) -> None:
    """Keep `author` for the next label form (a year; it is only a default, not a credential). The page
    answering this request shows it too (set `request.state.label_author` before rendering it)."""
    response.set_cookie(
        AUTHOR_COOKIE,
        quote(author),
        max_age=365 * 24 * 3600,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


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
