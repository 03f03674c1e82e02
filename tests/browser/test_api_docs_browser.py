"""The API docs (/docs, the footer's "API" link) in a real browser: the vendored Swagger UI draws every
route from /openapi.json under the app's Content-Security-Policy (no CDN, no inline script).

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

import pytest
from browser_fixtures import serving

from ffmem.config import Settings
from ffmem.store.db import upgrade
from ffmem.web.main import create_app

KEY_PATH = "/m/{model}/layers/{layer}/keys/{key}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The explorer on an empty database (the docs need no index); yields its base URL."""
    url = f"sqlite:///{tmp_path_factory.mktemp('docs') / 'ffmem.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


def test_docs_list_every_route_under_the_policy(watched, server):
    page = watched
    page.goto(f"{server}/")
    page.locator("footer a", has_text="API").click()
    page.wait_for_url(f"{server}/docs")
    operation = page.locator(f'.opblock-get .opblock-summary-path[data-path="{KEY_PATH}"]')
    operation.wait_for()
    assert page.locator(f'.opblock-get .opblock-summary-path[data-path="{KEY_PATH}.json"]').count() == 1
    assert page.locator(".opblock-post").count() >= 1  # the forms' actions too
    assert page.locator(".info .title").inner_text().startswith("ffmem")
    operation.click()  # opens: its parameters, read from the document
    page.locator(".opblock.is-open .parameters").wait_for()
    assert page.locator(".opblock.is-open .parameter__name", has_text="layer").count() == 1
