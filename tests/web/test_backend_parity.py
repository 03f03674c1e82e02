"""Every read-only page the same on SQLite and Postgres: the page tests that only read run on SQLite alone
(tests/conftest.py), so this module crawls the explorer of the same tiny index on both backends, from the
home page through every link it finds, and holds each page's status and its JSON twin equal (floats to
float32's precision: Postgres stores some statistics as 4-byte reals; times of day and durations left out,
the two indexes were built at different moments)."""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from contextlib import ExitStack
from html import unescape
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import copy_database
from fastapi.testclient import TestClient

from ffmem.config import Settings
from ffmem.web.main import create_app

BACKENDS = ("sqlite", "postgres")
SHAPES = 12  # pages crawled of each shape (a path with its numbers left out, and its query's names)
LINK = re.compile(r'(?:href|hx-get)="([^"#]+)')
SKIPPED = ("/static/", "/docs", "/openapi.json", "/login", "/logout")
# Left out: times of day and durations (when each backend's index was built, not what it holds) and the
# link to a random memory.
UNCOMPARED = re.compile(r"(_at|seconds|^duration.*|^took|^timings|^started|^finished|^random)$")
# Times inside a sentence ("computed in 0.1 s on 2026-11-29 07:54 UTC") are the building's, not the backend's.
TIMES = re.compile(r"\d+(?:\.\d+)? (?:ms|s|min)\b|\d{4}-\d\d-\d\d \d\d:\d\d(?::\d\d)?(?: UTC)?")
# Every page of the explorer (its numbers left out) but the login form and the circuit, which needs a worker.
PAGES = {
    "/",
    "/corpora",
    "/jobs",
    "/jobs/N",
    "/m/M",
    "/m/M/analysis",
    "/m/M/compare",
    "/m/M/labels",
    "/m/M/layers/N",
    "/m/M/layers/N/keys/N",
    "/m/M/layers/N/keys/N/ablation",
    "/m/M/layers/N/keys/N/related",
    "/m/M/layers/N/keys/N/samples",
    "/m/M/layers/N/keys/N/quadrants/pp",
    "/m/M/search",
    "/m/M/trace",
}
# Seeds the crawl cannot reach by links: searches typed into a form, URLs typed by hand, pages past the end.
SEEDS = [
    "/m/{slug}/search?q=Paris",
    "/m/{slug}/search?q=the&kind=sentences",
    "/m/{slug}/search?token=+Paris",
    "/m/{slug}/layers/1?sort=quadrant_nn&order=desc&per_page=5",
    "/m/{slug}/layers/2?sort=dominant_quadrant&per_page=100",
    "/m/{slug}/layers/1?per_page=10&page=99999&sort=density",
    "/m/{slug}/layers/99",
    "/m/{slug}/layers/1/keys/999",
    "/m/{slug}/layers/1/keys/5/quadrants/px",
]


@pytest.fixture(scope="module")
def clients(explorer_template, postgres_databases, tmp_path_factory) -> dict[str, TestClient]:
    """The explorer over a copy of the tiny index on each backend."""
    with ExitStack() as stack:
        clients = {}
        for backend in BACKENDS:
            folder = tmp_path_factory.mktemp(f"parity-{backend}")
            url = stack.enter_context(copy_database(explorer_template(backend), folder, postgres_databases))
            app = create_app(Settings(database_url=url, trace_rate_limit="0"))  # no worker: 503s
            stack.callback(app.state.engine.dispose)
            clients[backend] = stack.enter_context(TestClient(app))
        yield clients


def twin(url: str) -> str:
    """The JSON twin of a page's URL (the path with `.json` appended, the query kept)."""
    parts = urlsplit(url)
    path = "/.json" if parts.path == "/" else f"{parts.path}.json"
    return f"{path}?{parts.query}" if parts.query else path


def differences(a, b, where: str = "") -> list[str]:
    """Where two JSON values differ, floats compared to float32's precision, some left out (UNCOMPARED)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())}"]
        kept = [key for key in a if not UNCOMPARED.search(key)]
        return [d for key in kept for d in differences(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items against {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float):
            if math.isclose(a, b, rel_tol=2e-6, abs_tol=1e-7) or (math.isnan(a) and math.isnan(b)):
                return []
    elif a == b or (isinstance(a, str) and isinstance(b, str) and TIMES.sub("T", a) == TIMES.sub("T", b)):
        return []
    return [f"{where}: {a!r} against {b!r}"]


def shape(url: str) -> tuple[str, tuple[str, ...]]:
    """What pages of one kind share: the path with its numbers left out, and the query's names."""
    parts = urlsplit(url)
    return re.sub(r"\d+", "N", parts.path), tuple(sorted(parse_qs(parts.query, keep_blank_values=True)))


def crawl(client: TestClient, slug: str) -> list[str]:
    """The pages reachable from the home page and the seeds by links (GET, this site, no static files), up
    to SHAPES of each shape."""
    queue = deque(["/", *(seed.format(slug=slug) for seed in SEEDS)])
    seen = set(queue)
    shapes: Counter = Counter()
    pages = []
    while queue:
        url = queue.popleft()
        shapes[shape(url)] += 1
        if shapes[shape(url)] > SHAPES:
            continue
        answer = client.get(url)
        pages.append(url)
        if "text/html" not in answer.headers.get("content-type", ""):
            continue
        for link in LINK.findall(answer.text):
            link = unescape(link)
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or not link.startswith("/") or link.startswith(SKIPPED):
                continue
            if link not in seen and not parts.path.endswith((".json", ".csv")):
                seen.add(link)
                queue.append(link)
    return pages


def test_every_page_and_its_json_twin_are_the_same_on_both_backends(clients):
    (model,) = clients["sqlite"].get("/.json").json()["models"]
    pages = crawl(clients["sqlite"], model["model"]["slug"])
    reached = {re.sub(r"/m/[^/]+", "/m/M", shape(page)[0]) for page in pages}
    assert reached >= PAGES and len(pages) > 200, sorted(PAGES - reached)  # with their sorts and filters
    found = []
    for page in pages:
        answers = {backend: client.get(page) for backend, client in clients.items()}
        statuses = {backend: answer.status_code for backend, answer in answers.items()}
        if len(set(statuses.values())) > 1:
            found.append(f"{page}: {statuses}")
            continue
        if "text/html" not in answers["sqlite"].headers.get("content-type", ""):
            continue
        sqlite, postgres = (client.get(twin(page)) for client in clients.values())
        if sqlite.status_code != postgres.status_code:
            found.append(f"{twin(page)}: {sqlite.status_code} against {postgres.status_code}")
        elif sqlite.headers.get("content-type", "").startswith("application/json"):
            found += [f"{twin(page)}{d}" for d in differences(sqlite.json(), postgres.json())]
    assert found == [], "\n".join(found[:40])
