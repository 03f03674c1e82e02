"""Corpora from the browser: an uploaded text or JSONL file is checked as the CLI's corpus reader checks
one (ffmem/engine/mining/text_files.py: a binary or empty file is refused saying why; lines that cannot be
used are skipped and counted by reason) and kept under `Settings.upload_folder` with its counts beside it; the
corpora page lists it with the bundled corpus and those the database holds.

An upload is kept as `<sha256[:12]>-<name>` (the same file twice is one file) plus `….json` (its counts),
written to a temporary name first, so the list never shows a half-written file. Jobs name it by its
absolute path, as they name any corpus file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, Field

from ffmem.config import Settings
from ffmem.engine.mining.text_files import CorpusError, corpus_file, text_lines
from ffmem.store import corpora
from ffmem.store.db import Session
from ffmem.web.errors import AppError, sentence
from ffmem.web.views import Moment

SUFFIXES = (".txt", ".jsonl")
BUNDLED = "wiki-vital"
SIDECAR = ".json"  # the counts beside each upload
BLOCK = 1 << 20
# What each skip reason of text_files means, for the page.
SKIP_REASONS = {
    "invalid_utf8": "not valid UTF-8",
    "binary": "holds a NUL byte",
    "empty": "blank",
    "too_long": "longer than 10,000 characters",
    "invalid_json": "not JSON",
    "not_object": "not a JSON object",
    "no_text": 'no non-blank string "text"',
}


class CorpusFileView(BaseModel):
    """A corpus file uploaded from the browser, with its lines counted as the CLI's reader counts them."""

    name: str = Field(description="The uploaded file's name.")
    corpus: str = Field(description="What an index run is started with: the file's path on this server.")
    size: int = Field(description="Bytes.")
    sha256: str
    lines: int = Field(description='Usable lines (JSONL: records with a "text").')
    skipped: dict[str, int] = Field(
        description="Lines skipped, by reason (ffmem/engine/mining/text_files.py)."
    )
    uploaded_at: Moment


class CorpusUpload(BaseModel):
    """The JSON answer to an upload: the corpus kept, and whether the same file was there already."""

    corpus: CorpusFileView
    already: bool


class IndexedCorpus(BaseModel):
    """A corpus as an index run read and tokenized it (stored once per tokenizer)."""

    name: str
    source: str = Field(description="Where it was read from.")
    tokenizer: str
    n_sentences: int
    n_tokens: int
    skipped: dict = Field(description="Lines skipped, by reason.")
    created_at: Moment


class CorpusChoice(BaseModel):
    """A corpus the index form offers: its name, and what the form sends (wiki-vital or a path)."""

    name: str
    corpus: str


class CorporaContext(BaseModel):
    """The corpora this server knows: the bundled one, the uploaded files, those the database holds."""

    page: str = "corpora"
    title: str
    bundled: str = Field(description="The bundled corpus: wiki-vital.")
    files: list[CorpusFileView] = Field(description="The uploaded files, the newest first.")
    indexed: list[IndexedCorpus] = Field(description="The corpora index runs read, the newest first.")
    uploaded: CorpusFileView | None = Field(
        None, description="The file just uploaded (`?uploaded=`), shown first."
    )
    max_upload_bytes: int
    skip_reasons: dict[str, str] = Field(description="What each skip reason means.")


def upload_too_large(limit: int) -> AppError:
    """A corpus upload over `limit` bytes (refused by ffmem.web.security before it arrives, or here as it is
    read)."""
    message = (
        f"The file is larger than {limit:,} bytes, the most this server accepts for a corpus upload "
        "(FFMEM_MAX_UPLOAD_BYTES); put a larger one where the workers read it and pass its path."
    )
    return AppError(413, "Corpus too large", message, field="file")


def safe_name(filename: str) -> str:
    """The upload's file name reduced to letters, digits, dot, dash and underscore (no folders)."""
    base = os.path.basename(filename.replace("\\", "/")).strip()
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._") or "corpus"
    stem, suffix = os.path.splitext(cleaned)
    return f"{stem[:80]}{suffix.lower()}"


def store_upload(
    folder: Path, filename: str, stream: BinaryIO, max_bytes: int
) -> tuple[CorpusFileView, bool]:
    """Check the uploaded file and keep it under `folder`; its view, and whether it was there already.

    A name that is not .txt or .jsonl, a binary or empty file, or one without a usable line is a 400 that
    says why; a file over `max_bytes` a 413 (the request limit refuses most before they arrive)."""
    name = safe_name(filename or "")
    suffix = os.path.splitext(name)[1]
    if suffix not in SUFFIXES:
        raise AppError(
            400,
            "Not a corpus file",
            f"{filename or 'The file'} is not a .txt or .jsonl file: upload UTF-8 text (one or more "
            'sentences a line) or JSON lines with a "text" field.',
            field="file",
        )
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".upload-", suffix=suffix)
    path = Path(temporary)
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(handle, "wb") as out:
            while block := stream.read(BLOCK):
                size += len(block)
                if size > max_bytes:
                    raise upload_too_large(max_bytes)
                digest.update(block)
                out.write(block)
        lines, skipped = check(path, filename, jsonl=suffix == ".jsonl")
        sha = digest.hexdigest()
        final = folder / f"{sha[:12]}-{name}"
        already = final.exists() and (final.with_name(final.name + SIDECAR)).exists()
        if not already:
            counts = {
                "name": filename,
                "size": size,
                "sha256": sha,
                "lines": lines,
                "skipped": dict(skipped),
                "uploaded_at": datetime.now(timezone.utc).isoformat(),
            }
            os.replace(path, final)
            sidecar = final.with_name(final.name + SIDECAR)
            partial = sidecar.with_name(f".{sidecar.name}.part")
            partial.write_text(json.dumps(counts))
            os.replace(partial, sidecar)  # listed from now on
        return file_view(final), already
    finally:
        path.unlink(missing_ok=True)


def check(path: Path, shown: str, *, jsonl: bool) -> tuple[int, Counter]:
    """The usable lines of a corpus file and the skipped ones by reason, as the CLI's reader counts them;
    an unusable file is a 400 naming `shown` (the uploaded name) and why."""
    try:
        corpus_file(str(path))
        skipped: Counter = Counter()
        lines = sum(1 for _ in text_lines(path, skipped, jsonl=jsonl))
    except CorpusError as error:
        message = sentence(str(error).replace(str(path), shown))
        raise AppError(400, "Unusable corpus", message, field="file") from None
    if not lines:
        why = ", ".join(f"{n:,} {SKIP_REASONS.get(reason, reason)}" for reason, n in sorted(skipped.items()))
        raise AppError(
            400,
            "Unusable corpus",
            f"{shown} has no usable line (skipped: {why or 'none'}); save it as UTF-8 text"
            + (' with a "text" field on each line.' if jsonl else "."),
            field="file",
        )
    return lines, skipped


def file_view(path: Path) -> CorpusFileView:
    """An uploaded corpus as listed: its counts from the file beside it."""
    counts = json.loads(path.with_name(path.name + SIDECAR).read_text())
    return CorpusFileView(
        name=counts["name"],
        corpus=str(path.resolve()),
        size=counts["size"],
        sha256=counts["sha256"],
        lines=counts["lines"],
        skipped=counts["skipped"],
        uploaded_at=datetime.fromisoformat(counts["uploaded_at"]),
    )


def uploaded_files(folder: Path) -> list[CorpusFileView]:
    """Every complete upload under `folder`, the newest first (a file without its counts is skipped)."""
    if not folder.is_dir():
        return []
    found = []
    for sidecar in folder.glob(f"*{SIDECAR}"):
        path = sidecar.with_name(sidecar.name.removesuffix(SIDECAR))
        if path.is_file() and not path.name.startswith("."):
            try:
                found.append(file_view(path))
            except (OSError, ValueError, KeyError):
                continue  # a damaged counts file: not listed
    return sorted(found, key=lambda view: view.uploaded_at, reverse=True)


def choices(folder: Path) -> list[CorpusChoice]:
    """What the index form offers: the bundled corpus, then the uploaded ones (the newest first)."""
    uploads = [CorpusChoice(name=view.name, corpus=view.corpus) for view in uploaded_files(folder)]
    return [CorpusChoice(name="the bundled Wikipedia summaries", corpus=BUNDLED), *uploads]


def corpora_page(session: Session, settings: Settings, *, uploaded: str | None = None) -> CorporaContext:
    files = uploaded_files(settings.upload_folder)
    indexed = [
        IndexedCorpus(
            name=row.name,
            source=row.source,
            tokenizer=row.tokenizer,
            n_sentences=row.n_sentences,
            n_tokens=row.n_tokens,
            skipped=row.skipped or {},
            created_at=row.created_at,
        )
        for row in corpora.list_corpora(session=session)
    ]
    return CorporaContext(
        title="ffmem: corpora",
        bundled=BUNDLED,
        files=files,
        indexed=indexed,
        uploaded=next((view for view in files if view.corpus == uploaded), None) if uploaded else None,
        max_upload_bytes=settings.max_upload_bytes,
        skip_reasons=SKIP_REASONS,
    )
