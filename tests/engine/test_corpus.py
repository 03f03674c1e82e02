"""Corpus sources, sentence splitting, skip counts, tokenization with offsets."""

from __future__ import annotations

import json

import pytest

from engine.corpus import CorpusError, read_corpus, tokenize


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
        json.dumps({"title": "no text"}),
        json.dumps([1]),
        json.dumps({"text": "Three."}),
    ]
    path.write_text("\n".join(lines))
    corpus = read_corpus(str(path))
    assert corpus.sentences == ["One.", "Two.", "Three."]
    assert corpus.skipped == {"invalid_json": 1, "no_text": 2}


def test_limit_stops_early(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("Cats purr. Dogs bark. Birds sing. Fish swim.\nCows moo.\n")
    assert read_corpus(str(path), limit=3).sentences == ["Cats purr.", "Dogs bark.", "Birds sing."]


def test_empty_corpus_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"\n\n\xff\n")
    with pytest.raises(CorpusError, match=r"has no sentences \(skipped: 2 empty, 1 invalid_utf8\)"):
        read_corpus(str(path))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="no corpus file"):
        read_corpus(str(tmp_path / "nope.txt"))


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
