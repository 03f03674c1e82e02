"""Security headers and request size limits, as ASGI middleware around the whole app.

- **Headers** (the `secure` package's ASGI middleware): a Content-Security-Policy that runs only our
  own scripts (htmx, plotly and the API docs' Swagger UI are vendored under /static/vendor; templates
  hold no inline script, event handler or `javascript:` URL), nosniff, a referrer policy, X-Frame-Options
  for old browsers and Cross-Origin-Opener-Policy — on every response: pages, JSON twins, static files,
  redirects and error pages, 500s included (`install` wraps the whole middleware stack: Starlette sends the
  500 page from its outermost ServerErrorMiddleware, outside any middleware added with `add_middleware`).
- **Limits** (`RequestLimits`): a query string over `settings.max_query_bytes` is a 414, a request body
  over `settings.max_body_bytes` (a corpus upload: `settings.max_upload_bytes`; a live page's form, a
  prompt or text too long for a URL: `live_body_bytes`) a 413, both in the app's
  error shape and before the routes run, so
  nothing of a refused request is stored. Bodies without a Content-Length (chunked) are read chunk by
  chunk and refused as soon as they pass the limit: at most the limit is ever held in memory.
"""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from secure import (
    ContentSecurityPolicy,
    CrossOriginOpenerPolicy,
    ReferrerPolicy,
    Secure,
    XContentTypeOptions,
    XFrameOptions,
)
from secure.middleware import SecureASGIMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ffmem.config import Settings
from ffmem.engine.live.protocol import text_max_length
from ffmem.web.errors import AppError
from ffmem.web.pages.corpora import upload_too_large
from ffmem.web.rendering import render_error

# htmx 2.0.11's indicator <style>; a new htmx may change it (the browser test then reports the violation)
HTMX_INDICATOR_STYLE = "'sha256-faU7yAF8NxuMTNEwVmBz+VcYeIoBQ2EMHW3WaVxCvnk='"
EMPTY_STYLE = "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='"  # sha256 of ""
CSP = (
    ContentSecurityPolicy()
    .default_src("'self'")
    .script_src("'self'")
    # Styles, as strict as the pages allow (checked in Chromium, tests/browser/test_csp_browser.py):
    # - <style> elements: only our stylesheet and two inline ones, by hash: htmx 2's indicator rules
    #   (it adds them at load; HTMX_INDICATOR_STYLE) and the empty <style> plotly adds and then fills
    #   through the CSSOM (EMPTY_STYLE; CSSOM rules are not subject to CSP). Any other inline <style>
    #   (an injected one) is refused.
    # - style attributes need 'unsafe-inline': the coefficient bars are `style="width: …%"`
    #   (ffmem/web/templates/_macros.html) and plotly's heatmap (the cartesian bundle) writes style
    #   attributes as it draws. An attribute selects no other element: it cannot read the page as an injected
    #   <style> could.
    # - style-src is the fallback of browsers without the -elem/-attr directives (before Firefox 108,
    #   Safari 15.4): 'unsafe-inline' there, or htmx and plotly would lose their styles.
    .style_src("'self'", "'unsafe-inline'")
    .style_src_elem("'self'", HTMX_INDICATOR_STYLE, EMPTY_STYLE)
    .style_src_attr("'unsafe-inline'")
    .img_src("'self'", "data:")
    .connect_src("'self'")
    .object_src("'none'")
    .base_uri("'self'")
    .form_action("'self'")
    .frame_ancestors("'none'")
)
HEADERS = Secure(
    csp=CSP,
    xcto=XContentTypeOptions(),
    referrer=ReferrerPolicy().strict_origin_when_cross_origin(),
    xfo=XFrameOptions().deny(),
    coop=CrossOriginOpenerPolicy().same_origin(),
)


UPLOAD_PATHS = ("/corpora", "/corpora.json")  # corpus uploads: their own, larger body limit
MULTIPART_SLACK = 64 * 1024  # the form's other fields and the multipart boundaries around the file
LIVE_PATHS = re.compile(r"/m/[^/]+/(trace|layers/\d+/keys/\d+)(\.json)?")  # POSTed live views (a form)


def live_body_bytes(settings: Settings) -> int:
    """The largest form a live page may POST: the longest text its box sends, every character as
    percent-encoded UTF-8 (at most 12 bytes), and a query string's worth for its other fields."""
    return 12 * text_max_length(settings.max_prompt_tokens) + settings.max_query_bytes


def install(app: FastAPI, settings: Settings) -> None:
    """Size limits inside, security headers outside everything else (500 pages included)."""
    app.add_middleware(
        RequestLimits,
        max_body=settings.max_body_bytes,
        max_query=settings.max_query_bytes,
        max_upload=settings.max_upload_bytes,
        max_live=live_body_bytes(settings),
    )
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: SecureASGIMiddleware(build(), secure=HEADERS)


class RequestLimits:
    """Refuse an over-long query string (414) or request body (413) before the app sees the request."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body: int,
        max_query: int,
        max_upload: int | None = None,
        max_live: int | None = None,
    ) -> None:
        self.app, self.max_body, self.max_query = app, max_body, max_query
        self.max_upload = max_upload if max_upload is not None else max_body
        self.max_live = max(max_live or 0, max_body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(scope.get("query_string", b"")) > self.max_query:
            message = (
                f"The query string is longer than {self.max_query:,} bytes, the most this server "
                "accepts; shorten it, or send a long prompt or text as a form (POST)."
            )
            await self._refuse(scope, receive, send, AppError(414, "Query too long", message))
            return
        posted, path = scope.get("method") == "POST", scope.get("path", "")
        upload = posted and path in UPLOAD_PATHS
        limit = self.max_upload + MULTIPART_SLACK if upload else self.max_body
        if posted and LIVE_PATHS.fullmatch(path):
            limit = self.max_live
        body = await self._read_body(scope, receive, limit)
        if body is None:
            if upload:
                refused = upload_too_large(self.max_upload)
            else:
                message = f"The request body is larger than {limit:,} bytes, the most this server accepts."
                refused = AppError(413, "Request too large", message)
            await self._refuse(scope, receive, send, refused)
            return

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, scope: Scope, receive: Receive, limit: int) -> list[Message] | None:
        """The body's messages (at most `limit` bytes), or None as soon as it is larger."""
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return None  # refused unread
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: let the app see it
                return messages
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                return messages

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: AppError) -> None:
        response = render_error(Request(scope), error)
        await response(scope, receive, send)
