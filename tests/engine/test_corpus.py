"""Corpus sources, sentence splitting, skip counts, tokenization with offsets."""

from __future__ import annotations

import base64
import json

import pytest

from ffmem.engine.mining.corpus import CorpusError, read_corpus, tokenize
from ffmem.engine.mining.text_files import MAX_LINE_CHARS

USE = "pass wiki-vital, a UTF-8 .txt file or a .jsonl file"


def refusal(path) -> str:
    """The message of the CorpusError that reading `path` raises."""
    with pytest.raises(CorpusError) as error:
        read_corpus(str(path))
    return str(error.value)


def test_text_file_skips_and_counts_bad_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(
        b"Arthur C. Clarke wrote novels. He lived in Sri Lanka.\n"
        b"\n"
        b"   \n"
        b"bad \xff\xfe bytes here.\n"
        b"nul \x00 inside.\n"
        b"The last line has no newline"
    )
    corpus = read_corpus(str(path))
    assert corpus.sentences == [
        "Arthur C. Clarke wrote novels.",
        "He lived in Sri Lanka.",
        "The last line has no newline",
    ]
    assert corpus.skipped == {"empty": 2, "invalid_utf8": 1, "binary": 1}
    assert corpus.name == "corpus.txt" and len(corpus.sha256) == 64


def test_jsonl_reads_the_text_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"text": "One. Two."}),
        "{not json",
        "[" * 5000 + "]" * 5000,  # deeper than the JSON parser recurses
        json.dumps({"title": "no text"}),
        json.dumps({"text": 5}),
        json.dumps({"text": "   "}),
        json.dumps([1]),
        json.dumps("a bare string"),
        json.dumps({"text": "nul \x00 inside."}),
        '{"text": "a lone \\ud800 surrogate."}',
        "",
        json.dumps({"text": "Three."}),
    ]
    path.write_text("\n".join(lines))
    corpus = read_corpus(str(path))
    assert corpus.sentences == ["One.", "Two.", "Three."]
    assert corpus.skipped == {
        "invalid_json": 2,
        "no_text": 3,
        "not_object": 2,
        "binary": 1,
        "invalid_utf8": 1,
        "empty": 1,
    }


def test_limit_stops_early(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("Cats purr. Dogs bark. Birds sing. Fish swim.\nCows moo.\n")
    assert read_corpus(str(path), limit=3).sentences == ["Cats purr.", "Dogs bark.", "Birds sing."]


def test_empty_corpus_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"\n\n\xff\n")
    assert refusal(path) == (
        f"the corpus {path} has no sentences (skipped: 2 empty, 1 invalid_utf8); save it as UTF-8"
    )


def test_missing_file_is_a_clear_error(tmp_path):
    assert refusal(tmp_path / "nope.txt") == f"no corpus file at {tmp_path / 'nope.txt'}; {USE}"


def test_a_folder_or_an_empty_file_is_refused(tmp_path):
    assert refusal(tmp_path) == f"the corpus {tmp_path} is a folder, not a file; {USE}"
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert refusal(empty) == f"the corpus {empty} is empty; {USE}"


def _binary(share: str, size: int) -> str:
    return f"is not UTF-8 text: {share} of its first {size:,} bytes are control characters or not UTF-8"


@pytest.mark.parametrize(
    ("name", "content", "why"),
    [
        # 27 C0 controls (not \t\n\v\f\r), DEL and 128 undecodable bytes in every 256: 156 / 256
        ("every-byte.txt", bytes(range(256)) * 64, _binary("61%", 8192)),
        # a PNG's signature and header chunk, 33 bytes, 32 characters (C4 89 is ĉ): 89, 1A, the NULs and
        # small numbers of the chunk's length, width, height, depth, colour type and CRC: 20 of 32
        ("image.txt", base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJ"), _binary("62%", 33)),
        # gzip of nothing: its header (1F 8B 08, flags, mtime 0, FF), an empty block and CRC and size 0
        (
            "corpus.txt.gz",
            bytes.fromhex("1f8b0800000000000 0ff0300000000000000 0000".replace(" ", "")),
            _binary("100%", 20),
        ),
        ("utf16.txt", "Hello world.\n".encode("utf-16"), _binary("54%", 28)),
        ("corpus.jsonl", b"\x00" * 100 + b'{"text": "after NULs."}\n', _binary("81%", 124)),
    ],
)
def test_a_binary_file_is_refused_whole(tmp_path, name, content, why):
    path = tmp_path / name
    path.write_bytes(content)
    assert refusal(path) == f"the corpus {path} {why} (a binary file?); {USE}"


def test_a_file_with_no_utf8_line_says_so(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Café au lait.\nCrème brûlée.\n".encode("latin-1"))
    assert refusal(path) == f"the corpus {path} has no sentences (skipped: 2 invalid_utf8); save it as UTF-8"
    path.write_bytes("Café au lait.\nPlain words here.\n".encode("latin-1"))
    corpus = read_corpus(str(path))
    assert (corpus.sentences, corpus.skipped) == (["Plain words here."], {"invalid_utf8": 1})


def test_long_lines_are_skipped_not_split(tmp_path):
    """A 10 MB line never reaches the sentence splitter (whose time grows with the square of a line)."""
    path = tmp_path / "huge.txt"
    path.write_bytes(b"word " * 2_000_000 + b"\nA short line.\n" + b"x. " * 4000 + b"\n")
    corpus = read_corpus(str(path))
    assert (corpus.sentences, corpus.skipped) == (["A short line."], {"too_long": 2})
    assert MAX_LINE_CHARS == 10_000
    jsonl = tmp_path / "huge.jsonl"
    jsonl.write_text(json.dumps({"text": "word " * 2_000_000}) + "\n" + json.dumps({"text": "Kept."}))
    corpus = read_corpus(str(jsonl))
    assert (corpus.sentences, corpus.skipped) == (["Kept."], {"too_long": 1})


def test_the_line_limit_counts_characters_not_bytes(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("ééééé\néééééé\nabcde\nabcdef\n")  # 5 and 6 characters, 10 and 12 bytes
    corpus = read_corpus(str(path), max_line_chars=5)
    assert (corpus.sentences, corpus.skipped) == (["ééééé", "abcde"], {"too_long": 2})
    only = tmp_path / "only.txt"
    only.write_text("x" * 30)
    with pytest.raises(CorpusError) as error:
        read_corpus(str(only), max_line_chars=5)
    assert str(error.value) == f"the corpus {only} has no sentences (skipped: 1 too_long)"


def test_line_endings_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"\xef\xbb\xbfFirst one.\rSecond one.\r\nThird one.")
    assert read_corpus(str(path)).sentences == ["First one.", "Second one.", "Third one."]


def test_wiki_vital_is_the_bundled_wikipedia():
    corpus = read_corpus("wiki-vital", limit=20)
    assert len(corpus.sentences) == 20
    assert corpus.sentences[0] == (
        "20th-century classical music is Western art music that was written between 1901 and 2000, inclusive."
    )
    assert "Arthur C. Clarke" in " ".join(corpus.sentences)  # abbreviations do not end sentences


def test_tokenize_offsets_cover_the_text_and_truncate(tiny):
    sentences = ["The capital of France is Paris.", "Café au lait, naïve façade."]
    tokenized = tokenize(sentences, tiny.tokenizer, max_tokens=128)
    for sentence in tokenized:
        assert len(sentence.token_ids) == len(sentence.offsets)
        assert sentence.first_position == 0  # this tokenizer adds no BOS
        assert sentence.offsets[-1][1] == len(sentence.text)
        decoded = tiny.tokenizer.decode(sentence.token_ids)
        assert decoded == sentence.text
    short = tokenize(sentences, tiny.tokenizer, max_tokens=4)
    assert [len(s.token_ids) for s in short] == [4, 4]


def test_held_out_sentences_are_every_nth_and_never_mined():
    from ffmem.engine.mining.corpus import held_out_sentences, mined_sentences

    assert held_out_sentences(25, 10) == [9, 19] and held_out_sentences(25, 0) == []
    mined = mined_sentences(25, 10)
    assert sorted(mined + held_out_sentences(25, 10)) == list(range(25)) and 9 not in mined
    assert mined_sentences(7, 0) == list(range(7))


def test_each_shard_spans_the_corpus_and_the_shards_partition_it():
    from ffmem.engine.mining.corpus import mined_sentences, shard_members

    mined = mined_sentences(1000, 10)  # 900 sentences, 4 shards of at most 256
    shards = [shard_members(mined, shard, 256) for shard in range(4)]
    assert sorted(sum(shards, [])) == mined and all(len(s) <= 256 for s in shards)
    assert shards[0][:3] == [0, 4, 8] and shards[0][-1] > 990  # the first shard reaches the end


def test_a_shard_is_sized_by_the_model_unless_given():
    from ffmem.engine.mining.corpus import MIN_SHARD_SENTENCES, SHARD_TOKENS_PER_MEMORY, shard_size

    corpus = {"corpus_tokens": 1_050_056, "corpus_sentences": 36_518}  # the default corpus: 28.75 tokens each
    assert shard_size(8, memories=458_752, **corpus) == 8  # given: as given
    assert shard_size(0, memories=3 * 48, **corpus) == MIN_SHARD_SENTENCES  # a tiny model: the least size
    smollm2 = shard_size(0, memories=30 * 1536, **corpus)
    assert smollm2 == 25_641 and 16 * 46_080 <= smollm2 * 1_050_056 / 36_518 < 16 * 46_080 + 29  # 2 shards
    llama_8b = shard_size(0, memories=32 * 14_336, **corpus)
    assert llama_8b == 255_266 and llama_8b * 1_050_056 / 36_518 >= SHARD_TOKENS_PER_MEMORY * 458_752
    assert shard_size(0, memories=46_080, corpus_tokens=0, corpus_sentences=0) == 16 * 46_080  # no corpus yet
