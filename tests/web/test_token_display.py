"""Byte-level tokens shown as their bytes (issue 26, item 14): a token that is no whole character
decodes to "�" alone; the pages, the JSON twins and the explanations written at index time name it by
the bytes its raw piece stands for, ⟨0x80⟩, as they name other invisible characters ⟨U+200B⟩."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from ffmem.engine.explanations.description import describe, quoted
from ffmem.engine.explanations.fitting import Pattern
from ffmem.engine.values.token_display import byte_alphabet, byte_form, piece_bytes, visible
from ffmem.store import vocabularies
from ffmem.store.models import LanguageModel, Token


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's own table (openai/gpt-2 encoder.py), written out independently of ffmem's."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def test_the_byte_alphabet_is_gpt2s():
    assert byte_alphabet() == {char: b for b, char in gpt2_bytes_to_unicode().items()}


@pytest.mark.parametrize(
    ("text", "piece", "shown"),
    [
        ("\ufffd", "Ģ", "⟨0x80⟩"),  # a lone continuation byte, byte-level BPE
        ("\ufffd", "©", "⟨0xA9⟩"),
        ("\ufffd", "<0x80>", "⟨0x80⟩"),  # SentencePiece's byte fallback
        (" \ufffd", "ĠÃ", " ⟨0xC3⟩"),  # a space, then half of a two-byte character
        ("\ufffd", "ä¸", "⟨0xE4⟩⟨0xB8⟩"),  # two of three bytes
        (" Paris", "ĠParis", " Paris"),  # whole characters: the text itself
        ("\ufffd", "ï¿½", "\ufffd"),  # the replacement character itself, as UTF-8 bytes
        ("\ufffd", "▁x", "\ufffd"),  # a piece that names no bytes
        ("\ufffd", "Paris", "\ufffd"),  # a piece that is not the text's bytes
    ],
)
def test_byte_form(text, piece, shown):
    assert byte_form(text, piece) == shown


def test_piece_bytes():
    assert piece_bytes("ĠParis") == b" Paris" and piece_bytes("<0x0A>") == b"\n"
    assert piece_bytes("▁Paris") is None and piece_bytes("") is None


def test_quoted_names_tokens_as_the_pages_do_but_for_spaces():
    assert quoted(" the city\n") == "“ the city↵”"
    assert quoted("a\u200bb\t") == "“a⟨U+200B⟩b⇥”" and quoted("") == "“∅”"
    assert quoted("⟨0x80⟩") == "“⟨0x80⟩”"
    assert visible(" the city") == "␣the␣city"


def lone_continuation_byte(db) -> Token:
    """A token of the tiny index that is one continuation byte (10xxxxxx) alone."""
    for token in db.scalars(select(Token).order_by(Token.token_id)):
        data = piece_bytes(token.piece)
        if token.text == "\ufffd" and data is not None and len(data) == 1 and data[0] & 0xC0 == 0x80:
            return token
    raise AssertionError("the tiny vocabulary has byte tokens")


def test_the_vocabulary_names_byte_tokens_by_their_bytes(db, client, slug):
    token = lone_continuation_byte(db)
    model = db.scalars(select(LanguageModel).where(LanguageModel.slug == slug)).one()
    byte = piece_bytes(token.piece)[0]
    shown = f"⟨0x{byte:02X}⟩"
    assert vocabularies.vocabulary(session=db, model_id=model.id)[token.token_id] == shown
    assert vocabularies.token_texts(session=db, model_id=model.id, token_ids=[token.token_id]) == {
        token.token_id: shown
    }
    assert (
        vocabularies.token_texts(session=db, model_id=model.id, token_ids=[0])[0]
        == db.get(Token, (model.id, 0)).text
    )


def test_an_explanation_names_a_byte_token_by_its_bytes(db, slug):
    """describe() with the names the worker passes it (vocabularies.vocabulary, as ffmem.worker.explanations
    reads them): a key whose pattern weighs the byte token says so as ⟨0x..⟩, never "�"."""
    token = lone_continuation_byte(db)
    model = db.scalars(select(LanguageModel).where(LanguageModel.slug == slug)).one()
    named = vocabularies.vocabulary(session=db, model_id=model.id)
    names = [named.get(i, "") for i in range(max(named) + 1)]
    pattern = Pattern(final=[token.token_id], weights=[1.5], pairs=[[5, token.token_id]], pair_weights=[2.0])
    described = describe(pattern, [token.token_id], None, names)
    shown = f"⟨0x{piece_bytes(token.piece)[0]:02X}⟩"
    assert described.text == f"Fires on “{shown}” after {quoted(names[5])}; then writes “{shown}”."
    assert "\ufffd" not in described.text
