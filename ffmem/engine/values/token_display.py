"""How a token shows to a person, shared by the pages (ffmem.web.display), the stored vocabulary's
reading (ffmem.store.vocabularies.vocabulary) and the explanations written at index time (ffmem.engine.
explanations). Importing it needs no torch.

- `visible`: spaces ␣, newlines ↵, tabs ⇥, other invisible characters ⟨U+XXXX⟩, the empty string ∅, no
  token at all —.
- `byte_form`: a byte-level token that is no whole character (a lone continuation byte, half of a
  multi-byte character) decodes to "�" alone, whatever its bytes; its raw piece still names them (a
  byte-level BPE piece in GPT-2's byte alphabet, or a SentencePiece byte `<0x80>`), and the token is
  shown with each byte that is no character as ⟨0xNN⟩: "�" (piece `Ģ`, byte 0x80) → `⟨0x80⟩`.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
from functools import cache

SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}  # ␣ ↵ ⇥ ␍
INVISIBLE = ("Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Cn")  # control, format, spaces, private, unassigned
REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are no character
SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def visible(text: str | None, *, spaces: bool = True) -> str:
    """A token as a person can see it: spaces ␣ (kept as spaces with `spaces=False`, for text already
    in quotes), newlines ↵, tabs ⇥, other invisible characters as ⟨U+XXXX⟩, the empty string ∅, no
    token at all —."""
    if text is None:
        return "—"
    if text == "":
        return "∅"
    if text.isprintable():  # no control, format, separator (but the ASCII space), private or unassigned
        return text.replace(" ", SHOWN[" "]) if spaces else text
    return "".join(
        (SHOWN.get(char) if spaces or char != " " else char)
        or (f"⟨U+{ord(char):04X}⟩" if unicodedata.category(char) in INVISIBLE else char)
        for char in text
    )


@cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte (the inverse of its `bytes_to_unicode`): the
    printable Latin-1 bytes stand for themselves, the others for U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}


def piece_bytes(piece: str) -> bytes | None:
    """The bytes a raw piece stands for: a SentencePiece byte `<0xNN>` or a piece in the byte-level
    alphabet; None for any other piece (its bytes are unknown)."""
    if match := SENTENCEPIECE_BYTE.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    alphabet = byte_alphabet()
    if piece and all(char in alphabet for char in piece):
        return bytes(alphabet[char] for char in piece)
    return None


def _bytes_shown(error: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"⟨0x{b:02X}⟩" for b in error.object[error.start : error.end]), error.end


codecs.register_error("ffmem-bytes-shown", _bytes_shown)


def byte_form(text: str, piece: str | None) -> str:
    """The token's text with the bytes that are no character as ⟨0xNN⟩, when it decodes to "�" and its
    piece names its bytes (and decodes to the text); else the text itself."""
    if REPLACEMENT not in text or piece is None or (data := piece_bytes(piece)) is None:
        return text
    if data.decode("utf-8", errors="replace") != text:  # the piece is not these bytes after all
        return text
    return data.decode("utf-8", errors="ffmem-bytes-shown")
