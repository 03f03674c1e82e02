"""Corpus files: found, checked to be UTF-8 text, and read line by line with each skipped line counted
by reason. No torch here: the web process checks a job's corpus with `corpus_file` before queueing it.

A file is refused whole when it is missing, a folder, unreadable, empty, or binary (its first 8 KiB
mostly control characters or not UTF-8: an image, an archive, UTF-16). Inside a text file, a line is
skipped and counted when it is not valid UTF-8 (`invalid_utf8`), holds a NUL (`binary`), is blank
(`empty`) or longer than `MAX_LINE_CHARS` (`too_long`); in JSONL also when it is not JSON
(`invalid_json`), not a JSON object (`not_object`), or has no non-blank string "text" (`no_text`).
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from ffmem.engine.errors import FfmemError

# The sentence splitter (pysbd) takes time growing with the square of a line's length (~0.5 s at
# 10,000 characters, ~40 s at 100,000): longer lines are skipped, not split. The longest summary of
# the bundled Wikipedia corpus has 2,134 characters.
MAX_LINE_CHARS = 10_000
SNIFF_BYTES = 8192  # the head of a file read to tell text from binary
BINARY_SHARE = 0.3  # a head with more than this share of control characters or non-UTF-8 bytes is binary
USE = "pass wiki-vital, a UTF-8 .txt file or a .jsonl file"


class CorpusError(FfmemError):
    """A corpus that cannot be used; the message says why."""


def corpus_file(source: str) -> Path:
    """The path of a corpus file, checked to be a readable, non-empty text file (CorpusError if not)."""
    path = Path(source)
    if path.is_dir():
        raise CorpusError(f"the corpus {source} is a folder, not a file; {USE}")
    if not path.is_file():
        raise CorpusError(f"no corpus file at {source}; {USE}")
    try:
        with path.open("rb") as file:
            head = file.read(SNIFF_BYTES)
    except OSError as error:
        raise CorpusError(f"cannot read the corpus {source} ({error.strerror}); {USE}") from None
    if not head:
        raise CorpusError(f"the corpus {source} is empty; {USE}")
    share = binary_share(head)
    if share > BINARY_SHARE:
        raise CorpusError(
            f"the corpus {source} is not UTF-8 text: {share:.0%} of its first {len(head):,} bytes are "
            f"control characters or not UTF-8 (a binary file?); {USE}"
        )
    return path


def binary_share(head: bytes) -> float:
    """The share of `head`'s characters that are control characters (not whitespace) or undecodable."""
    # Not final: a character cut at the end of the head is held back, not counted as undecodable.
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=len(head) < SNIFF_BYTES)
    bad = sum(1 for c in text if c == "\ufffd" or c == "\x7f" or (c < " " and c not in "\t\n\v\f\r"))
    return bad / max(len(text), 1)


def sha256(path: Path) -> str:
    """The file's sha256, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def text_lines(
    path: Path, skipped: Counter, *, jsonl: bool, max_chars: int = MAX_LINE_CHARS
) -> Iterator[str]:
    """The usable lines of a text file (the "text" of each line for JSONL), streamed; every other line
    is counted in `skipped` under its reason. Never holds more than one line of `max_chars`."""
    cap = 4 * max_chars + 2  # bytes: at most 4 a character in UTF-8, and a CR LF
    with path.open("rb") as file:
        first = True
        while chunk := file.readline(cap):
            if len(chunk) == cap and not chunk.endswith(b"\n"):  # longer than any line we keep
                while chunk and not chunk.endswith(b"\n"):
                    chunk = file.readline(cap)
                skipped["too_long"] += 1
                continue
            if first:
                chunk, first = chunk.removeprefix(codecs.BOM_UTF8), False
            for line in chunk.splitlines():  # a lone CR ends a line too
                text = _usable(line, skipped, jsonl=jsonl, max_chars=max_chars)
                if text is not None:
                    yield text


def _usable(line: bytes, skipped: Counter, *, jsonl: bool, max_chars: int) -> str | None:
    """The text of one line, or None after counting why it is skipped."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return _skip(skipped, "invalid_utf8")
    if len(text) > max_chars:
        return _skip(skipped, "too_long")
    if not jsonl:
        return _text(text, skipped)
    if not text.strip():
        return _skip(skipped, "empty")
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: thousands of nested brackets
        return _skip(skipped, "invalid_json")
    if not isinstance(record, dict):
        return _skip(skipped, "not_object")
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        return _skip(skipped, "no_text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape
        return _skip(skipped, "invalid_utf8")
    return _text(text, skipped)


def _text(text: str, skipped: Counter) -> str | None:
    if "\x00" in text:
        return _skip(skipped, "binary")
    if not text.strip():
        return _skip(skipped, "empty")
    return text


def _skip(skipped: Counter, reason: str) -> None:
    skipped[reason] += 1
    return None
