"""Two runs side by side in a real browser (Playwright driving Debian's Chromium) under the app's CSP:
from the model page's form to the pair's page, its per-layer chart drawn, the key list sorted by another
change, the links to both runs' key pages followed. Screenshots go to FFMEM_ARTIFACTS.

Skipped when Chromium is not installed, except on CI (env CI set), where that is a failure.
"""

from __future__ import annotations

import pytest
from browser_fixtures import serving
from sqlalchemy import select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.store import comparison
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import LanguageModel
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import Worker, build_index


@pytest.fixture(scope="module")
def index(tiny, tiny_model_dir, tmp_path_factory):
    """A SQLite index holding two runs of the tiny model (shards of 8 and of 2 sentences), compared."""
    folder = tmp_path_factory.mktemp("compare-browser")
    url = f"sqlite:///{folder / 'ffmem.db'}"
    upgrade(url)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    runs = []
    for shard_sentences in (8, 2):
        settings = Settings(
            model=str(tiny_model_dir), corpus=str(corpus), sentences=None, top_k=4, device="cpu",
            dtype="float32", batch_tokens=128, shard_sentences=shard_sentences, value_tokens=5,
            cache_dir=folder / "cache",
        )  # fmt: skip
        options = IndexOptions.from_settings(settings, progress=False)
        runs.append(build_index(options, sessions, loaded=tiny).run_id)
    with sessions() as session:
        job, _ = comparison.enqueue_comparison(session=session, run_a=runs[0], run_b=runs[1])
        session.commit()
        job_id = job.id
    Worker(sessions, options, loaded=tiny).work(job_id=job_id)
    with sessions() as session:
        slug = session.scalars(select(LanguageModel.slug)).one()
    engine.dispose()
    return url, slug, runs


@pytest.fixture(scope="module")
def server(index):
    app = create_app(Settings(database_url=index[0]))
    with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
    app.state.engine.dispose()


def test_two_runs_side_by_side_under_the_policy(watched, server, index):
    page, (_, slug, (first, second)) = watched, index
    response = page.goto(f"{server}/m/{slug}?run={first}")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    page.fill("#compare-runs input[name=b]", str(second))
    page.click("#compare-runs button[type=submit]")
    page.wait_for_url(f"**/m/{slug}/compare?a={first}&b={second}")
    page.wait_for_function(
        "() => document.querySelector('#chart-comparison') && "
        "document.querySelector('#chart-comparison .main-svg')"
    )
    rows = page.locator("#key-changes tbody tr")
    assert rows.count() == 50  # the default limit
    assert "run " in page.locator("#what-compared").inner_text()
    page.select_option("#sort-keys select[name=sort]", "mean")
    page.click("#sort-keys button[type=submit]")
    page.wait_for_url("**sort=mean**")
    page.wait_for_function("() => document.querySelector('#chart-comparison .main-svg')")
    link = page.locator("#key-changes tbody tr").first.locator("a").nth(1)
    href = link.get_attribute("href")
    assert href.endswith(f"run={second}")
    link.click()
    page.wait_for_url(f"**{href}")
    assert page.locator("h1").count() >= 1


def test_pick_the_second_run_under_the_policy(watched, server, index):
    page, (_, slug, (first, second)) = watched, index
    response = page.goto(f"{server}/m/{slug}/compare?a={first}")
    assert response.status == 200
    page.select_option("#pick-run select[name=b]", str(second))
    page.click("#pick-run button[type=submit]")
    page.wait_for_url(f"**/m/{slug}/compare?a={first}&b={second}")
    page.wait_for_function("() => document.querySelector('#chart-comparison .main-svg')")
