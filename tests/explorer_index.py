"""A tiny but real index for the explorer's tests: the tiny random Llama over a corpus that holds
markup, built once per backend (SQLite, Postgres) and per test module.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from tiny_models import TRAINING_TEXT

from ffmem.config import Settings
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import LanguageModel, Run
from ffmem.web.main import create_app
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index

HOSTILE = [
    "Some wrote <script>alert(1)</script> into the page.",
    'Then came "><img src=x onerror=alert(1)> as a name.',
]
EXPLORER_SENTENCES = [*TRAINING_TEXT, *HOSTILE]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def explorer_db(request, tmp_path_factory, tiny, tiny_model_dir) -> str:
    """URL of a database holding one finished index run of the tiny model (top-T 6)."""
    from conftest import migrated_url

    folder = tmp_path_factory.mktemp("explorer")
    url = migrated_url(request, folder)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(EXPLORER_SENTENCES * 2) + "\n")
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
            cache_dir=folder / "cache",
        ),
        progress=False,
    )
    engine = make_engine(url)
    build_index(options, make_sessionmaker(engine), loaded=tiny)
    engine.dispose()
    return url


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


@pytest.fixture(scope="module")
def run(db) -> Run:
    """The tiny index's one run."""
    return db.scalars(select(Run)).one()


@pytest.fixture(scope="module")
def client(explorer_db):
    """The explorer over the tiny index, no live worker (modules that need one define their own)."""
    app = create_app(Settings(database_url=explorer_db))
    with TestClient(app) as client:
        yield client
    app.state.engine.dispose()


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
