"""The writers' encodings made for a whole layer (or run) at once give the bytes a row at a time gave."""

from __future__ import annotations

import numpy as np

from ffmem.store import key_examples, memory_lists
from ffmem.store.db import json_dumps
from ffmem.store.memory_writes import json_rows


def test_row_bytes_are_each_rows_bytes_after_the_header_padded_to_odd_lengths():
    rows = np.arange(24, dtype=np.uint8).reshape(4, 6)  # [rows, bytes]
    assert memory_lists.row_bytes(b"\x07", rows) == [b"\x07" + bytes(r) for r in rows.tolist()]
    padded = memory_lists.row_bytes(b"\x07\x08", rows, odd=True)  # 8 bytes: a zero byte after
    assert padded == [b"\x07\x08" + bytes(r) + b"\0" for r in rows.tolist()]
    assert memory_lists.row_bytes(b"", rows[:, :0]) == [b""] * 4


def test_sentence_order_is_lexsorts_ties_included():
    rng = np.random.default_rng(0)
    for sentences, ordered in ((30, False), (30, True), (70_000, True)):
        memory = rng.integers(0, 200, 5000)  # [triggers]
        memory = np.sort(memory) if ordered else memory
        sentence = rng.integers(0, sentences, 5000)  # memories twice in a sentence: ties left to position
        position = rng.integers(0, 40, 5000).astype(np.int16)
        expected = np.lexsort((position, memory, sentence))
        assert (memory_lists._by_sentence(sentence, memory, position) == expected).all()
    memory = np.repeat(np.arange(100), 10)  # the writers' case: memories in order, each sentence once
    sentence = (memory * 7 + np.tile(np.arange(10), 100) * 13) % 500
    position = rng.integers(0, 40, 1000)
    expected = np.lexsort((position, memory, sentence))
    assert (memory_lists._by_sentence(sentence, memory, position) == expected).all()


def test_sentence_triggers_are_packed_by_sentence_then_memory_by_hand():
    memory = np.array([5, 3, 3, 9, 1])
    sentence = np.array([2, 0, 2, -1, 2])  # −1: an empty slot, left out
    position = np.array([4, 1, 0, 7, 2])
    coefficient = np.array([0.5, 1.5, 2.5, 3.5, 4.5], np.float32)
    sentences, blobs = memory_lists.encode_sentence_triggers(memory, sentence, position, coefficient)
    assert sentences == [0, 2]

    def entry(m: int, p: int, c: float) -> bytes:  # 1-byte memory and position, float32
        return bytes([m, p]) + np.float32(c).tobytes()

    header = bytes([1, 1])
    assert blobs[0] == header + entry(3, 1, 1.5) + b"\0"  # 8 bytes: padded to 9
    assert blobs[1] == header + entry(1, 2, 4.5) + entry(3, 0, 2.5) + entry(5, 4, 0.5) + b"\0"  # 20: 21


def test_json_rows_are_each_rows_json():
    for array in (
        np.arange(12).reshape(3, 4),
        np.zeros((2, 0), int),
        np.array([[1.5, np.nan], [np.inf, -2.0]]),
    ):
        assert json_rows(array) == [json_dumps(row) for row in array.tolist()]
    assert json_rows(np.zeros((0, 3), int)) == []


def test_shading_codes_by_hand():
    values = np.array([1.0, -0.5, np.nan, 0.25, 0.0, 0.0, np.nan], np.float32)
    steps, codes = key_examples._steps_and_codes(values, np.array([4, 0, 2, 1]))
    assert steps.tolist() == [np.float32(1 / 127), 0.0, 0.0, 0.0]  # a sentence of 0s or NaN: step 0
    # 1 / step = 127; −0.5 · 127 = −63.5 rounds to even, −64; NaN: NOT_MINED; 0.25 · 127 = 31.75: 32
    assert codes.tolist() == [127, -64, -128, 32, 0, 0, -128]
