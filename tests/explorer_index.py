"""A tiny but real index for the explorer's tests: the tiny random Llama over a corpus that holds
markup, built once per backend (SQLite, Postgres) and test process, copied for each test module.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from bench.tiny_tokenizer import TRAINING_TEXT
from ffmem.config import Settings
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import LanguageModel, Run
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.live_app import create_live_app
from ffmem.worker.live_executor import Live
from ffmem.worker.loop import build_index

HOSTILE = [
    "Some wrote <script>alert(1)</script> into the page.",
    'Then came "><img src=x onerror=alert(1)> as a name.',
]
EXPLORER_SENTENCES = [*TRAINING_TEXT, *HOSTILE]


def _build(url: str, corpus, folder, tiny, tiny_model_dir) -> None:
    """One finished index run of the tiny model (top-T 6) over `corpus` into the migrated database `url`."""
    options = IndexOptions.from_settings(
        Settings(
            model=str(tiny_model_dir),
            corpus=str(corpus),
            sentences=None,
            top_k=6,
            device="cpu",
            dtype="float32",
            batch_tokens=128,
            shard_sentences=8,
            value_tokens=8,
            explain_quadrants=True,  # the tiny Llama is gated: its pages show each quadrant's explanation
            cache_dir=folder / "cache",
        ),
        progress=False,
    )
    engine = make_engine(url)
    build_index(options, make_sessionmaker(engine), loaded=tiny)
    engine.dispose()


@pytest.fixture(scope="session")
def explorer_template(tmp_path_factory, tiny, tiny_model_dir, postgres_databases):
    """`template(backend)`: the URL of a database holding the tiny index, built once per backend and test
    process (a SQLite file; a Postgres database that modules copy with CREATE DATABASE … TEMPLATE)."""
    built: dict[str, str] = {}
    corpus = tmp_path_factory.mktemp("explorer-corpus") / "corpus.txt"  # one path: the same runs' options
    corpus.write_text("\n".join(EXPLORER_SENTENCES * 2) + "\n")

    def template(backend: str) -> str:
        if backend not in built:
            folder = tmp_path_factory.mktemp(f"explorer-{backend}")
            sqlite = f"sqlite:///{folder / 'template.db'}"
            url = sqlite if backend == "sqlite" else postgres_databases.create("explorer")
            upgrade(url)
            _build(url, corpus, folder, tiny, tiny_model_dir)
            built[backend] = url
        return built[backend]

    return template


@pytest.fixture(scope="module")
def explorer_db(request, explorer_template, postgres_databases, tmp_path_factory) -> str:
    """URL of a database holding one finished index run of the tiny model (top-T 6): the module's own copy
    of the process's template, so a module may write. SQLite alone, unless the module asks for both
    backends with `pytestmark = pytest.mark.backends("sqlite", "postgres")` (tests/conftest.py)."""
    from conftest import copy_database

    source = explorer_template(request.param)
    with copy_database(source, tmp_path_factory.mktemp("explorer"), postgres_databases) as url:
        yield url


@pytest.fixture(scope="module")
def db(explorer_db):
    """A session on the tiny index."""
    engine = make_engine(explorer_db)
    with make_sessionmaker(engine)() as session:
        yield session
    engine.dispose()


@pytest.fixture(scope="module")
def slug(db) -> str:
    """The tiny model's URL name."""
    return db.scalars(select(LanguageModel.slug)).one()


NO_WORKER = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def run(db) -> Run:
    """The tiny index's one run."""
    return db.scalars(select(Run)).one()


@pytest.fixture(scope="module")
def client(explorer_db):
    """The explorer over the tiny index, no live worker (modules that need one define their own): its URL
    the discard port, where nothing answers (whatever else runs on this machine's 8001)."""
    app = create_app(Settings(database_url=explorer_db, worker_url=NO_WORKER))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


def tiny_worker(tiny, tiny_model_dir, **options) -> tuple[Live, TestClient]:
    """A live worker holding the tiny model (its executor, `options` its own, and its app's client at
    http://worker), for a module that serves live requests in-process."""
    live = Live(device="cpu", **({"max_tokens": 56, "queue": 4} | options))
    live.models[str(tiny_model_dir)] = tiny
    return live, TestClient(create_live_app(live), base_url="http://worker")


def four_shard_options(tiny_model_dir, tmp_path) -> IndexOptions:
    """A run of the tiny model over 28 sentences in 4 shards of 7 (shard k: every 4th from the k-th),
    nothing held out: what the progress and provisional-page tests rewind and inspect."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(EXPLORER_SENTENCES[:7] * 4) + "\n")
    return IndexOptions.from_settings(
        Settings(
            model=str(tiny_model_dir),
            corpus=str(corpus),
            cache_dir=tmp_path,
            sentences=None,
            held_out_every=0,
            top_k=4,
            device="cpu",
            dtype="float32",
            batch_tokens=64,
            shard_sentences=8,
        ),
        progress=False,
    )
