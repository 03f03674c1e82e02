"""The API docs (/docs): our own page over the vendored Swagger UI, with no inline script and nothing
from a CDN; FastAPI's own /docs and /redoc are off. The browser test (tests/browser/test_api_docs_browser.py)
sees it draw under the Content-Security-Policy."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath

import pytest
from fastapi.testclient import TestClient

from ffmem.config import Settings
from ffmem.store.db import upgrade
from ffmem.web.main import STATIC, create_app

VENDORED = ("vendor/swagger-ui-bundle-5.35.0.js", "vendor/swagger-ui-5.35.0.css")


@pytest.fixture
def client(tmp_path):
    url = f"sqlite:///{tmp_path / 'ffmem.db'}"
    upgrade(url)
    app = create_app(Settings(database_url=url))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def test_docs_page_loads_only_our_files(client):
    response = client.get("/docs")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "script-src 'self';" in response.headers["content-security-policy"]
    page = response.text
    assert 'data-openapi="/openapi.json"' in page
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page, re.S)
    assert [re.search(r'src="([^"]+)"', attrs)[1] for attrs, _ in scripts] == [
        "/static/vendor/swagger-ui-bundle-5.35.0.js",
        "/static/docs.js",
    ]
    assert all(body.strip() == "" for _, body in scripts)  # no inline script
    assert re.findall(r'(?:href|src)="([^"]+)"', page) == [
        "/static/favicon.svg",
        "/static/vendor/swagger-ui-5.35.0.css",
        "/static/vendor/swagger-ui-bundle-5.35.0.js",
        "/static/docs.js",
    ]


def test_openapi_and_the_docs_files_are_served(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert "/m/{model}/layers/{layer}/keys/{key}" in paths
    assert "/docs" not in paths
    for name in VENDORED:
        response = client.get(f"/static/{name}")
        assert response.status_code == 200 and "immutable" in response.headers["cache-control"]
        assert response.content == (STATIC / name).read_bytes()
    assert "SwaggerUIBundle(" in client.get("/static/docs.js").text
    assert client.get("/redoc").status_code == 404  # FastAPI's own docs are off
    assert client.get("/docs/oauth2-redirect").status_code == 404


def test_vendored_files_are_package_data():
    """pyproject.toml ships the docs' files with the package, and VENDOR.md gives each one's sha256."""
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    shipped = project["tool"]["setuptools"]["package-data"]["ffmem.web"]
    note = (STATIC / "vendor" / "VENDOR.md").read_text()
    for name in (*(f"static/{name}" for name in VENDORED), "static/docs.js", "templates/docs.html"):
        assert any(PurePosixPath(name).match(pattern) for pattern in shipped), name
    for name in VENDORED:
        digest = hashlib.sha256((STATIC / name).read_bytes()).hexdigest()
        assert f"| {name.removeprefix('vendor/')} |" in note and digest in note
