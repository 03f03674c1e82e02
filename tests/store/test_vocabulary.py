"""Token texts come from a vocabulary read once per process (vocabularies.vocabulary): the same texts as the
`tokens` table, never a stale or half-stored vocabulary, never another database's or model row's."""

from __future__ import annotations

from sqlalchemy import insert, select

from ffmem.store import runs, vocabularies
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Token


def _model(session, slug: str, vocab_size: int):
    return runs.upsert_model(
        session=session,
        slug=slug,
        source=slug,
        revision=None,
        architecture="Tiny",
        family="llama",
        n_layers=1,
        n_keys=4,
        d_model=8,
        vocab_size=vocab_size,
        activation="silu",
        gated=True,
    )


def test_token_texts_equal_the_stored_vocabulary(session):
    texts = [f" word{i}" for i in range(50)] + ["\x00nul", "<b>&"]
    model = _model(session, "tiny", len(texts))
    vocabularies.store_vocabulary(session=session, model_id=model.id, texts=texts, pieces=texts)
    session.commit()
    wanted = [0, 3, 51, 50, 3, 999, -1]
    stored = dict(session.execute(select(Token.token_id, Token.text).where(Token.model_id == model.id)).all())
    assert vocabularies.token_texts(session=session, model_id=model.id, token_ids=wanted) == {
        0: " word0",
        3: " word3",
        50: stored[50],
        51: "<b>&",
    }
    assert stored[50] == "\u2400nul"  # stored as every text is (NUL shown as ␀)
    assert vocabularies.token_texts(session=session, model_id=model.id + 1, token_ids=[0]) == {}


def test_a_vocabulary_still_being_stored_is_read_again(session):
    model = _model(session, "half", 4)
    session.execute(
        insert(Token), [{"model_id": model.id, "token_id": i, "text": f"t{i}", "piece": ""} for i in (0, 1)]
    )
    session.commit()
    assert vocabularies.token_texts(session=session, model_id=model.id, token_ids=range(4)) == {
        0: "t0",
        1: "t1",
    }
    session.execute(
        insert(Token), [{"model_id": model.id, "token_id": i, "text": f"t{i}", "piece": ""} for i in (2, 3)]
    )
    session.commit()
    assert vocabularies.token_texts(session=session, model_id=model.id, token_ids=range(4)) == {
        0: "t0",
        1: "t1",
        2: "t2",
        3: "t3",
    }


def test_each_database_has_its_own_vocabulary(tmp_path):
    found = []
    for name in ("a", "b"):
        url = f"sqlite:///{tmp_path / name}.db"
        upgrade(url)
        engine = make_engine(url)
        with make_sessionmaker(engine)() as session:
            model = _model(session, "same-slug", 2)  # the same id in both databases
            vocabularies.store_vocabulary(
                session=session, model_id=model.id, texts=[name, name * 2], pieces=["", ""]
            )
            session.commit()
            found.append(vocabularies.token_texts(session=session, model_id=model.id, token_ids=[0, 1]))
        engine.dispose()
    assert found == [{0: "a", 1: "aa"}, {0: "b", 1: "bb"}]
