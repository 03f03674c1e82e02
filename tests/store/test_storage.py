"""Every write of the store (runs, corpora, vocabularies, memories) round-trips exactly, on SQLite and
Postgres."""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np
import pytest
from sqlalchemy import delete, func, select, text

from ffmem.store import corpora, layer_table, memory_lists, memory_reads, memory_writes, runs, vocabularies
from ffmem.store.models import KeyOrder, KeyStats, LanguageModel, MemoryList, Run, RunStatus, Sentence, Token
from ffmem.store.results import MiningResults, StoredResults

MODEL = dict(
    slug="tiny",
    source="hf-internal/tiny",
    revision="abc123",
    architecture="LlamaForCausalLM",
    family="llama",
    n_layers=2,
    n_keys=3,
    d_model=8,
    vocab_size=5,
    activation="silu",
    gated=True,
)


def three_key_stats() -> dict[str, np.ndarray]:
    """A layer of three keys' statistics, the last two with infinite and missing extremes."""
    return dict(
        mean=np.array([0.5, -0.25, 0.0], dtype=np.float32),
        positive_share=np.array([0.75, 0.125, 0.0]),
        max_coefficient=np.array([3.0, np.inf, np.nan]),
        min_coefficient=np.array([-1.5, -np.inf, np.nan]),
        value_norm=np.array([1.0, 2.0, 4.0]),
        histogram=np.array([[1, 2], [0, 3], [0, 0]], dtype=np.int64),
        density=np.array([0.5, 0.25, 0.0]),
        max_prob=np.array([0.125, 0.5, 1.0]),
        agreement=np.array([3, 0, 0]),
        next_token_rank=np.array([0, 17, -1]),
    )


def reread(session) -> None:
    """Commit and forget every loaded object, so the next reads come from the database."""
    session.commit()
    session.expunge_all()


@pytest.fixture
def model(session) -> LanguageModel:
    return runs.upsert_model(session=session, **MODEL)


@pytest.fixture
def corpus(session):
    return corpora.store_corpus(
        session=session,
        name="tiny.txt",
        source="/data/tiny.txt",
        source_sha256="a" * 64,
        fingerprint="f" * 64,
        tokenizer="tiny@abc123",
        max_tokens=16,
        skipped={"empty": 2},
        sentences=[
            ("Hello world.", [0, 7, 9], [(0, 0), (0, 5), (5, 12)], 1),
            ("Bye.", [0, 4], [(0, 0), (0, 4)], 1),
        ],
    )


@pytest.fixture
def run(session, model, corpus) -> Run:
    return runs.create_run(
        session=session,
        model_id=model.id,
        corpus_id=corpus.id,
        top_k=2,
        n_value_tokens=2,
        n_sentences=2,
        dtype="float32",
        device="cpu",
        package_version="0.1.0",
        provenance={"torch": "2.4"},
        histogram_edges=[-1.0, 0.0, 1.0],
    )


def test_upsert_model_creates_then_updates(session, model):
    again = runs.upsert_model(session=session, **{**MODEL, "revision": "def456", "n_keys": 4})
    reread(session)
    stored = session.scalars(select(LanguageModel)).one()
    assert again.id == model.id == stored.id
    assert (stored.slug, stored.revision, stored.n_keys, stored.gated) == ("tiny", "def456", 4, True)
    assert isinstance(stored.created_at, datetime)


def test_vocabulary_round_trips_once(session, model):
    texts, pieces = ["a", " b", "\x00"], ["a", "Ġb", "Ā"]
    vocabularies.store_vocabulary(session=session, model_id=model.id, texts=texts, pieces=pieces)
    vocabularies.store_vocabulary(session=session, model_id=model.id, texts=["x"] * 3, pieces=["y"] * 3)
    reread(session)
    rows = session.execute(select(Token.token_id, Token.text, Token.piece).order_by(Token.token_id)).all()
    assert [tuple(row) for row in rows] == [(0, "a", "a"), (1, " b", "Ġb"), (2, "\u2400", "Ā")]


def test_corpus_round_trips(session, corpus):
    reread(session)
    found = corpora.find_corpus(session=session, fingerprint="f" * 64)
    assert found is not None and found.id == corpus.id
    assert (found.n_sentences, found.n_tokens, found.skipped) == (2, 5, {"empty": 2})
    assert corpora.find_corpus(session=session, fingerprint="0" * 64) is None
    assert corpora.load_sentence_tokens(session=session, corpus_id=found.id) == [[0, 7, 9], [0, 4]]
    assert corpora.load_first_positions(session=session, corpus_id=found.id) == [1, 1]
    first = session.get(Sentence, (found.id, 0))
    assert (first.text, first.offsets) == ("Hello world.", [[0, 0], [0, 5], [5, 12]])


def test_run_lifecycle(session, model, run):
    assert run.status == RunStatus.running and run.started_at is not None and run.finished_at is None
    runs.finish_run(session=session, run_id=run.id, n_tokens=np.int64(123))
    reread(session)
    stored = runs.get_run(session=session, run_id=run.id)
    assert (stored.status, stored.n_tokens, stored.histogram_edges) == ("done", 123, [-1.0, 0.0, 1.0])
    assert stored.provenance == {"torch": "2.4"} and stored.finished_at is not None and stored.error is None
    found = runs.find_finished_run(session=session, model_slug="tiny", n_sentences=2)
    assert found is not None and found.id == run.id
    assert runs.find_finished_run(session=session, model_slug="tiny", n_sentences=3) is None


def test_a_finished_run_leaves_postgres_row_counts_to_plan_by(session, run, db_url):
    """Postgres plans the explorer's reads by its statistics, which autovacuum (off on these machines)
    may never gather: finishing a run gathers them for the tables it filled (reltuples −1: never)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite plans without statistics")
    memory_writes.store_key_stats(session=session, run_id=run.id, layer=0, **three_key_stats())
    session.commit()
    planned = text(
        "SELECT relname, reltuples FROM pg_class WHERE relname IN ('key_stats', 'memory_lists')"
        " AND relnamespace = current_schema()::regnamespace"
    )
    assert dict(session.execute(planned).all()) == {"key_stats": -1, "memory_lists": -1}
    runs.finish_run(session=session, run_id=run.id, n_tokens=10)
    session.commit()
    assert dict(session.execute(planned).all()) == {"key_stats": 3, "memory_lists": 0}


def test_fail_run_stores_the_traceback(session, run):
    try:
        raise RuntimeError("out of memory on layer 3")
    except RuntimeError as error:
        runs.fail_run(session=session, run_id=run.id, error=error)
    reread(session)
    stored = runs.get_run(session=session, run_id=run.id)
    assert stored.status == RunStatus.failed and stored.finished_at is not None
    assert stored.error["type"] == "RuntimeError"
    assert stored.error["message"] == "out of memory on layer 3"
    assert "Traceback (most recent call last)" in stored.error["traceback"]
    assert "test_fail_run_stores_the_traceback" in stored.error["traceback"]


def test_triggers_round_trip_and_skip_missing(session, run):
    coefficients = np.array([[2.5, 1.25], [0.1, -7.0], [3.0, 0.0]], dtype=np.float32)
    sentence_index = np.array([[1, 0], [0, -1], [-1, -1]], dtype=np.int64)
    position = np.array([[2, 1], [3, 0], [0, 0]], dtype=np.int64)
    stored = memory_writes.store_triggers(
        session=session,
        run_id=run.id,
        layer=1,
        sign=-1,
        coefficients=coefficients,
        sentence_index=sentence_index,
        position=position,
    )
    reread(session)
    assert stored == 3
    assert runs.count_entries(session=session, run_id=run.id, kind="triggers") == 3
    assert session.scalar(select(func.count()).select_from(MemoryList)) == 2  # key 2 has none: no list

    def triggers(key: int) -> list[tuple]:
        rows = memory_reads.get_triggers(session=session, run_id=run.id, layer=1, key=key, sign=-1)
        return [(t.rank, t.sentence_index, t.position, t.coefficient) for t in rows]

    assert triggers(0) == [(0, 1, 2, 2.5), (1, 0, 1, 1.25)]
    assert triggers(1) == [(0, 0, 3, float(np.float32(0.1)))]
    assert type(triggers(1)[0][3]) is float
    assert triggers(2) == []
    assert memory_reads.get_triggers(session=session, run_id=run.id, layer=1, key=0, sign=1) == []
    # the kind is stored as its number (revision 0032: "norm" 1, "raw" 2, "triggers" 3), read as its name
    assert session.execute(text("SELECT DISTINCT kind FROM memory_lists")).scalars().all() == [3]
    assert session.scalars(select(MemoryList.kind).distinct()).all() == ["triggers"]


def test_a_list_of_no_kind_is_refused(session, run):
    """models.Coded refuses a name outside its own, through the bulk writer as through the ORM."""
    from sqlalchemy.exc import StatementError

    from ffmem.store.bulk import bulk_insert

    row = (run.id, "trigger", 1, 0, 0, b"x")
    with pytest.raises(KeyError, match="trigger"):
        bulk_insert(session, MemoryList.__table__, memory_writes.LIST_COLUMNS, [row])
    session.rollback()
    with pytest.raises(StatementError, match="'value' is none of"):
        session.scalar(select(MemoryList.data).where(MemoryList.kind == "value"))


def test_value_tokens_round_trip(session, run):
    token_ids = np.array([[4, 1], [0, 2], [3, 3]], dtype=np.int64)
    logits = np.array([[9.5, 8.25], [1.0, -2.0], [0.5, 0.5]], dtype=np.float32)
    log_z = np.array([10.25, 3.0, 20.0], dtype=np.float32)
    for readout, direction in (("raw", 1), ("norm", -1)):
        memory_writes.store_value_tokens(
            session=session,
            run_id=run.id,
            layer=0,
            readout=readout,
            direction=direction,
            token_ids=token_ids,
            logits=logits,
            log_z=log_z,
        )
    reread(session)
    assert runs.count_entries(session=session, run_id=run.id, kind="raw") == 6
    assert runs.count_entries(session=session, run_id=run.id, kind="norm") == 6

    def values(key: int, readout: str, direction: int) -> list[tuple]:
        rows = memory_reads.get_value_tokens(
            session=session, run_id=run.id, layer=0, key=key, readout=readout, direction=direction
        )
        return [(v.rank, v.token_id, v.logit, v.prob) for v in rows]

    # prob = exp(logit − log_z), the softmax over the full readout
    close = pytest.approx
    assert values(2, "norm", -1) == [(0, 3, 0.5, close(math.exp(-19.5))), (1, 3, 0.5, close(math.exp(-19.5)))]
    assert values(0, "raw", 1) == [(0, 4, 9.5, close(math.exp(-0.75))), (1, 1, 8.25, close(math.exp(-2.0)))]
    assert values(2, "raw", -1) == []
    assert all(type(v) is float for v in values(0, "raw", 1)[0][2:])


def test_a_keys_lists_in_one_read_equal_the_lists_read_one_by_one(session, run):
    """What the key page reads in one statement (memory_reads.key_lists; StoredResults' triggers and value
    readouts) equals each list read alone, and a list not stored is empty."""
    where = dict(session=session, run_id=run.id, layer=1)
    memory_writes.store_triggers(
        **where,
        sign=1,
        coefficients=np.array([[2.5, 1.25], [0.5, 0.25], [3.0, 1.0]], dtype=np.float32),
        sentence_index=np.array([[1, 0], [0, -1], [1, 0]]),
        position=np.array([[2, 1], [1, 0], [0, 1]]),
    )
    memory_writes.store_triggers(
        **where,
        sign=-1,
        coefficients=np.array([[-1.0, -0.5], [-2.0, -1.5], [-3.0, -0.5]], dtype=np.float32),
        sentence_index=np.array([[0, 1], [1, 0], [0, -1]]),
        position=np.array([[1, 2], [0, 1], [2, 0]]),
    )
    token_ids = np.array([[4, 1], [0, 2], [3, 3]])
    for readout, direction in (("raw", 1), ("raw", -1), ("norm", 1)):  # no norm bottom tokens stored
        memory_writes.store_value_tokens(
            **where,
            readout=readout,
            direction=direction,
            token_ids=token_ids[:, ::direction],
            logits=np.array([[9.5, 8.25], [1.0, -2.0], [0.5, 0.5]], dtype=np.float32) * direction,
            log_z=np.array([10.25, 3.0, 20.0], dtype=np.float32),
        )
    reread(session)
    key = 1
    lists = memory_reads.key_lists(**where, key=key)
    assert set(lists) == {("triggers", 1), ("triggers", -1), ("raw", 1), ("raw", -1), ("norm", 1)}
    readouts = memory_lists.value_readouts(lists, run_id=run.id, layer=1, key=key)
    for readout in memory_lists.READOUTS:
        for direction in (1, -1):
            alone = memory_reads.get_value_tokens(**where, key=key, readout=readout, direction=direction)
            assert readouts[readout, direction] == alone
    assert readouts["norm", -1] == [] and len(readouts["raw", -1]) == 2
    stored = StoredResults(session, run)
    assert stored.value_readouts(1, key) == readouts
    assert MiningResults(session, run).value_readouts(1, key) == readouts  # a run still mining: the same
    for sign in (1, -1):
        alone = memory_reads.get_triggers(**where, key=key, sign=sign)
        assert stored.triggers(1, key, sign) == alone and len(alone) >= 1
        assert stored.triggers(1, key, sign, 1) == alone[:1]
    assert stored.triggers(0, key, 1) == [] and stored.value_readouts(0, key)["raw", 1] == []


def test_packed_lists_round_trip():
    sentence_index = np.array([[7, 70_000, -1], [-1, -1, -1]])  # [keys, T]
    position = np.array([[0, 511, 0], [0, 0, 0]])
    coefficient = np.array([[2.5, -1.25, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    first, second = memory_lists.encode_triggers(sentence_index, position, coefficient)
    # The widths (3 B: 70,000 sentences; 2 B: position 511), 2 entries of 3 + 2 + 4 B, a byte to an odd length
    assert first[:2] == bytes([3, 2]) and len(first) == 2 + 2 * 9 + 1 and second == b""
    decoded = memory_lists.decode_triggers(first)
    assert decoded.tolist() == [(7, 0, 2.5), (70_000, 511, -1.25)]
    assert memory_lists.trigger_count(first) == 2
    for widest, width in ((65_535, 2), (65_536, 3), (2**24 - 1, 3), (2**24, 4)):
        token_ids = np.array([[widest, 3], [0, 1]])  # [keys, n]
        logits = np.array([[1.5, -2.0], [0.25, 0.125]], dtype=np.float32)
        blobs = memory_lists.encode_value_tokens(token_ids, logits, np.array([4.0, 5.0]))
        assert [len(b) for b in blobs] == [memory_lists.VALUE_HEADER.itemsize + 2 * (width + 4)] * 2
        entries, log_z = memory_lists.decode_value_tokens(blobs[0])
        assert (entries["token_id"].tolist(), entries["logit"].tolist(), log_z) == (
            [widest, 3],
            [1.5, -2.0],
            4.0,
        )
        many = memory_lists.decode_many("raw", [3, 3], [0, 1], blobs)
        assert (many.layer.tolist(), many.key.tolist(), many.rank.tolist()) == (
            [3] * 4,
            [0, 0, 1, 1],
            [0, 1] * 2,
        )
        assert many.entries["token_id"].tolist() == [widest, 3, 0, 1] and many.log_z.tolist() == [4, 4, 5, 5]


def test_packed_widths_follow_the_largest_value():
    """Issue 41: an integer column takes the bytes its largest value needs (1 to 4), −1 (none) all ones."""
    largest = (0, 255, 256, 65_535, 65_536, 2**24 - 1, 2**24)
    assert [memory_lists.int_width(np.array([v])) for v in largest] == [1, 1, 2, 2, 3, 3, 4]
    assert memory_lists.int_width(np.array([255]), none=True) == 2  # 255 would read as none
    columns = (np.array([-1, 0, 70_000]), np.array([1.5, -2.0, 0.25], np.float32))
    raw = memory_lists.pack_columns(columns, (3, memory_lists.FLOAT))  # [3, 7]
    assert raw[0].tobytes() == b"\xff\xff\xff" + np.float32(1.5).tobytes()
    assert raw[2, :3].tobytes() == (70_000).to_bytes(3, "little")
    memory, score = memory_lists.unpack_columns(raw, (3, memory_lists.FLOAT), (True, False))
    assert memory.tolist() == [-1, 0, 70_000] and score.tolist() == [1.5, -2.0, 0.25]


def test_lists_stored_before_0031_read_as_written():
    """The fixed records of the lists stored before revision 0031 (even lengths, no header) still read."""
    triggers = np.array([(7, 0, 2.5), (70_000, 511, -1.25)], memory_lists.TRIGGER).tobytes()
    assert memory_lists.decode_triggers(triggers).tolist() == [(7, 0, 2.5), (70_000, 511, -1.25)]
    assert memory_lists.trigger_count(triggers) == 2
    many = memory_lists.decode_many("triggers", [1, 1], [4, 5], [triggers, memory_lists.encode_triggers(
        np.array([[3]]), np.array([[2]]), np.array([[0.5]], np.float32))[0]])  # fmt: skip
    assert many.entries.tolist() == [(7, 0, 2.5), (70_000, 511, -1.25), (3, 2, 0.5)]
    assert (many.key.tolist(), many.rank.tolist()) == ([4, 4, 5], [0, 1, 0])
    sentence = np.array([(3, 5, 1.5), (70_000, 2, -0.5)], memory_lists.SENTENCE_TRIGGER).tobytes()
    assert memory_lists.decode_sentence_triggers(sentence).tolist() == [(3, 5, 1.5), (70_000, 2, -0.5)]
    lists = np.array([(9, 2.0), (-1, 0.0)] * 4, memory_lists.TOKEN_MEMORY).tobytes()  # 4 lists of depth 2
    assert memory_lists.decode_token_memories(lists).tolist() == [[(9, 2.0), (-1, 0.0)]] * 4


def test_token_and_sentence_lists_round_trip_packed():
    memories = np.array([[[70_000, -1], [0, 1], [2, 3], [4, -1]]])  # [1 token, 4 lists, depth 2]
    scores = np.arange(8, dtype=np.float32).reshape(1, 4, 2) - 3.5
    (blob,) = memory_lists.encode_token_memories(memories, scores)
    assert blob[0] == 3 and len(blob) == 1 + 8 * 7  # uint24 memories (all ones: none), float32 scores
    found = memory_lists.decode_token_memories(blob)
    assert found["memory"].tolist() == memories[0].tolist() and found["score"].tolist() == scores[0].tolist()
    memory, sentence = np.array([9, 70_000, 9, 4]), np.array([1, 0, 0, -1])
    position, coefficient = np.array([3, 1, 2, 0]), np.array([0.5, 1.5, 2.5, 9.0], np.float32)
    sentences, blobs = memory_lists.encode_sentence_triggers(memory, sentence, position, coefficient)
    assert sentences == [0, 1] and blobs[0][:2] == bytes([3, 1]) and all(len(b) % 2 for b in blobs)
    assert [memory_lists.decode_sentence_triggers(b).tolist() for b in blobs] == [
        [(9, 2, 2.5), (70_000, 1, 1.5)],
        [(9, 3, 0.5)],
    ]


def test_key_stats_round_trip_with_null_extremes(session, run):
    memory_writes.store_key_stats(session=session, run_id=run.id, layer=1, **three_key_stats())
    reread(session)
    first = memory_reads.get_key_stats(session=session, run_id=run.id, layer=1, key=0)
    assert (
        first.mean,
        first.positive_share,
        first.max_coefficient,
        first.min_coefficient,
        first.value_norm,
        first.histogram,
    ) == (0.5, 0.75, 3.0, -1.5, 1.0, [1, 2])
    assert (first.density, first.max_prob, first.agreement, first.next_token_rank) == (0.5, 0.125, 3, 0)
    second = memory_reads.get_key_stats(session=session, run_id=run.id, layer=1, key=1)
    assert (second.max_coefficient, second.min_coefficient, second.histogram) == (None, None, [0, 3])
    assert second.next_token_rank == 17
    third = memory_reads.get_key_stats(session=session, run_id=run.id, layer=1, key=2)
    assert (third.max_coefficient, third.min_coefficient, third.next_token_rank) == (None, None, None)
    assert memory_reads.get_key_stats(session=session, run_id=run.id, layer=0, key=0) is None


def test_mismatched_shapes_are_refused(session, run):
    with pytest.raises(ValueError, match="shape"):
        memory_writes.store_triggers(
            session=session,
            run_id=run.id,
            layer=0,
            sign=1,
            coefficients=np.zeros((3, 2)),
            sentence_index=np.zeros((3, 1), dtype=np.int64),
            position=np.zeros((3, 2)),
        )


def _fill(session, run) -> None:
    ones = np.ones((3, 2))
    ints = np.ones((3, 2), dtype=np.int64)
    memory_writes.store_triggers(
        session=session, run_id=run.id, layer=0, sign=1, coefficients=ones, sentence_index=ints, position=ints
    )
    memory_writes.store_value_tokens(
        session=session,
        run_id=run.id,
        layer=0,
        readout="raw",
        direction=1,
        token_ids=ints,
        logits=ones,
        log_z=np.ones(3),
    )
    memory_writes.store_key_stats(
        session=session,
        run_id=run.id,
        layer=0,
        mean=np.zeros(3),
        positive_share=np.zeros(3),
        max_coefficient=np.ones(3),
        min_coefficient=np.ones(3),
        value_norm=np.ones(3),
        histogram=ints,
        density=np.zeros(3),
        max_prob=np.ones(3),
        agreement=np.zeros(3, dtype=np.int64),
        next_token_rank=np.zeros(3, dtype=np.int64),
    )


def _counts(session) -> tuple[int, int, int, int]:
    runs, lists, stats = (
        session.scalar(select(func.count()).select_from(t)) for t in (Run, MemoryList, KeyStats)
    )
    value_lists = session.scalar(select(func.count()).select_from(MemoryList).where(MemoryList.kind == "raw"))
    return runs, lists - value_lists, value_lists, stats


def test_deleting_a_run_cascades(session, run):
    _fill(session, run)
    reread(session)
    assert _counts(session) == (1, 3, 3, 3)  # one list per key
    runs.delete_run(session=session, run_id=run.id)
    reread(session)
    assert _counts(session) == (0, 0, 0, 0)


def test_deleting_a_model_cascades_to_its_runs(session, model, run):
    _fill(session, run)
    vocabularies.store_vocabulary(session=session, model_id=model.id, texts=["a"], pieces=["a"])
    reread(session)
    session.delete(session.get(LanguageModel, model.id))
    reread(session)
    assert _counts(session) == (0, 0, 0, 0)


EXPLAINED = {  # (layer, key): an explanation's text, with LIKE's wildcards, quotes, short and non-ASCII texts
    (0, 0): "ends in “Paris” 100%",
    (0, 1): "ends in ' Berlin' after 'capital of'",
    (0, 2): 'quotes "x" and 50% of _under_scores',
    (1, 0): "PARISIAN café",
    (1, 1): "ab",
    (1, 2): "values: ' paris', ' Rome'",
}


def test_explanations_are_found_by_any_piece_of_their_text_as_by_a_scan(session, run, db_url):
    from ffmem.store import composition

    table = {"sign": 1, "final": [], "weights": [], "pairs": [], "pair_weights": []}  # an empty pattern
    rows = [(layer, key, "heuristic", text, 0.1 * key, table, {}) for (layer, key), text in EXPLAINED.items()]
    composition.store_explanations(session=session, run_id=run.id, rows=rows)
    reread(session)
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":  # the trigram table (migration 0021), kept in step by its triggers
        assert composition._has_text_index(session)
        matched = text(
            f"SELECT rowid FROM {composition.EXPLANATION_TEXT} WHERE {composition.EXPLANATION_TEXT} MATCH :q"
        )
        assert len(session.scalars(matched, {"q": '"paris"'}).all()) == 3
    else:  # the trigram index of lower(text), which LIKE reads
        indexes = session.scalars(
            text("SELECT indexname FROM pg_indexes WHERE tablename = 'explanations'")
        ).all()
        assert "ix_explanations_text_trigram" in indexes
    for needle in (
        "paris",
        "PARIS",
        "ends in",
        '"x"',
        "50%",
        "_under_",
        "café",
        "ab",
        "b",
        "' r",
        "zzz",
        "%",
        "_",
    ):
        found = composition.search_explanations(session=session, run_id=run.id, text=needle, limit=10)
        scan = [memory for memory, body in EXPLAINED.items() if needle.lower() in body.lower()]
        scan.sort(key=lambda memory: (-0.1 * memory[1], memory))  # the best scored first, then by memory
        assert [(e.layer, e.key) for e in found] == scan, needle
    assert [(e.layer, e.key) for e in composition.search_explanations(
        session=session, run_id=run.id, text="paris", limit=2)] == [(1, 2), (0, 0)]  # fmt: skip
    runs.delete_run(session=session, run_id=run.id)
    reread(session)
    if dialect == "sqlite":  # a deleted run's explanations leave the index too
        assert session.scalars(matched, {"q": '"paris"'}).all() == []


@pytest.mark.parametrize("far", [False, True])
def test_the_keys_promoting_a_token_are_those_whose_value_lists_hold_it(session, run, far):
    """The byte search keeps candidates only: a logit whose bytes hold the id's (3.14159 is D0 0F 49 40,
    so id 0x4049 as two bytes) is no hit; ids past 65,535 are stored in four bytes."""
    shift = 0x10000 if far else 0  # far: a layer of 4-byte ids
    target, other = 0x4049 + shift, 7 + shift
    token_ids = np.array(
        [[other, target], [other, other + 1], [target, other], [other + 2, other]]
    )  # [keys, n]
    logits = np.array([[5.0, 2.0], [3.14159, 1.0], [2.0, 1.0], [0.5, 0.25]], dtype=np.float32)
    memory_writes.store_value_tokens(
        session=session, run_id=run.id, layer=1, readout="raw", direction=1,
        token_ids=token_ids, logits=logits, log_z=np.zeros(4, np.float32),
    )  # fmt: skip
    reread(session)
    keys = memory_reads.promoting_keys
    assert keys(session=session, run_id=run.id, layer=1, token_ids=[target]) == [0, 2]
    assert keys(session=session, run_id=run.id, layer=1, token_ids=[target, other + 2]) == [0, 2, 3]
    assert keys(session=session, run_id=run.id, layer=1, token_ids=[other + 3]) == []
    assert keys(session=session, run_id=run.id, layer=0, token_ids=[target]) == []  # another layer
    assert keys(session=session, run_id=run.id, layer=1, token_ids=[]) == []
    assert keys(session=session, run_id=run.id, layer=1, token_ids=[target], readout="norm") == []


def test_explanations_stored_in_bulk_are_indexed_as_their_trigger_would_and_it_is_back(session, run):
    from ffmem.store import composition

    texts = {(0, key): f"ends in “w{key}” then w{key + 1}" for key in range(3)}
    empty = {"sign": 1, "final": [], "weights": [], "pairs": [], "pair_weights": []}
    rows = [(layer, key, "heuristic", t, None, empty, {}) for (layer, key), t in texts.items()]
    composition.store_explanations(session=session, run_id=run.id, rows=rows[:2])
    composition.store_explanations(session=session, run_id=run.id, rows=rows[2:])
    reread(session)
    for needle, expected in (("w1", [(0, 0), (0, 1)]), ("w2", [(0, 1), (0, 2)]), ("“w0”", [(0, 0)])):
        found = composition.search_explanations(session=session, run_id=run.id, text=needle, limit=10)
        assert sorted((e.layer, e.key) for e in found) == expected
    if session.get_bind().dialect.name != "sqlite":
        return
    fts = composition.EXPLANATION_TEXT
    triggers = text("SELECT name FROM sqlite_master WHERE type = 'trigger' AND name = :name")
    assert session.scalars(triggers, {"name": f"{fts}_insert"}).all() == [f"{fts}_insert"]
    session.execute(  # a row inserted another way is indexed by the trigger, as before
        text(
            "INSERT INTO explanations (run_id, layer, key, source, text, details) "
            "VALUES (:run, 1, 0, 'heuristic', 'quite apart', '{}')"
        ),
        {"run": run.id},
    )
    session.execute(text(f"INSERT INTO {fts}({fts}) VALUES ('integrity-check')"))  # raises when out of step
    reread(session)
    found = composition.search_explanations(session=session, run_id=run.id, text="apart", limit=10)
    assert [(e.layer, e.key) for e in found] == [(1, 0)]


def test_every_page_of_a_layer_in_every_order_from_either_end(session, run):
    """Pages past the middle are read backwards from the end: each page equals a slice of the full order
    (NULLs last, ties by key), on both databases."""
    rng = np.random.default_rng(2)
    n = 11
    stats = {name: np.resize(values, n) for name, values in three_key_stats().items()}
    stats["histogram"] = np.zeros((n, 2), dtype=np.int64)
    stats["max_coefficient"] = rng.choice([1.0, 2.0, np.nan], size=n)  # ties and NULLs
    stats["positive_share"] = rng.random(n)
    memory_writes.store_key_stats(session=session, run_id=run.id, layer=0, **stats)
    reread(session)
    for sort in ("key", "max_coefficient", "positive_share"):
        value = np.arange(n, dtype=float) if sort == "key" else stats[sort]
        for descending in (False, True):
            missing = np.isnan(value)
            primary = np.where(missing, 0.0, -value if descending else value)
            expected = np.lexsort((np.arange(n), primary, missing)).tolist()
            for per_page in (1, 3, 4, 11, 20):
                for offset in range(0, n + per_page, per_page):
                    total, page = layer_table.layer_keys(
                        session=session, run_id=run.id, layer=0, sort=sort, descending=descending,
                        offset=offset, limit=per_page,
                    )  # fmt: skip
                    assert total == n
                    assert [s.key for s in page] == expected[offset : offset + per_page], (
                        sort,
                        per_page,
                        offset,
                    )


def test_the_stored_key_orders_page_as_the_database_sorts(session, run):
    """Issue 41: a finished layer's pages are slices of the orders stored with its statistics (key_orders),
    not a sort of the layer's rows; every sort, both directions, any page equals what the database's sort
    of the rows gives (the path of runs stored before 0031): NULLs and infinities last, ties by key, the
    dominant quadrant by its share within. The order itself is checked against a sort written here."""
    rng = np.random.default_rng(5)
    n = 23
    stats = {name: np.resize(values, n) for name, values in three_key_stats().items()}
    stats["histogram"] = np.zeros((n, 2), dtype=np.int64)
    stats["max_coefficient"] = rng.choice([1.0, 2.0, np.nan, np.inf], size=n)  # ties, NULLs
    stats["positive_share"] = rng.choice([0.25, 0.5, 0.75], size=n)
    stats["density"] = rng.random(n)
    stats["next_token_rank"] = rng.choice([-1, 0, 3], size=n)
    shares = rng.dirichlet([1.0] * 4, n)  # [keys, 4]
    shares[:4] = [0.4, 0.3, 0.2, 0.1]  # the same dominant quadrant and share: by key
    memory_writes.store_key_stats(session=session, run_id=run.id, layer=0, quadrant_shares=shares, **stats)
    reread(session)
    assert session.scalar(select(func.count()).select_from(KeyOrder)) == 2 * (
        len(layer_table.KEY_SORTS) - 2
    )  # by key: none needed; by explanation: sorted in SQL

    def pages(descending: bool, sort: str) -> list[tuple[int, list[int]]]:
        found = []
        for offset in range(0, n + 10, 5):  # every page, one past the last
            total, page = layer_table.layer_keys(
                session=session,
                run_id=run.id,
                layer=0,
                sort=sort,
                descending=descending,
                offset=offset,
                limit=5,
            )
            found.append((total, [s.key for s in page]))
        return found

    stored = {(sort, d): pages(d, sort) for sort in layer_table.KEY_SORTS for d in (True, False)}
    density = stats["density"]
    by_hand = sorted(range(n), key=lambda k: (-density[k], k))  # no NULLs: by value, then key
    assert stored["density", True] == [(n, by_hand[at : at + 5]) for at in range(0, n + 10, 5)]
    by_rank = sorted(
        range(n), key=lambda k: (stats["next_token_rank"][k] < 0, stats["next_token_rank"][k], k)
    )
    assert [k for _, page in stored["next_token_rank", False] for k in page] == by_rank
    quadrant = [k for _, page in stored["dominant_quadrant", False] for k in page]
    by_share = sorted(range(n), key=lambda k: (shares[k].argmax(), -np.float32(shares[k].max()), k))
    assert quadrant == by_share and quadrant.index(1) == quadrant.index(0) + 1  # an equal share: by key
    session.execute(delete(KeyOrder))  # the database's sort of the rows
    reread(session)
    for (sort, descending), found in stored.items():
        assert found == pages(descending, sort), (sort, descending)
