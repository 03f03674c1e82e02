"""Corpora: the list of those this server knows, and uploading one from the browser (a write)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Query, Request, UploadFile
from fastapi.responses import JSONResponse, RedirectResponse

from ffmem.web import urls
from ffmem.web.deps import SessionDep, SettingsDep
from ffmem.web.pages import corpora
from ffmem.web.pages.corpora import CorporaContext, CorpusUpload
from ffmem.web.rendering import render
from ffmem.web.routes import action, page
from ffmem.web.wants import wants_fragment, wants_json

router = APIRouter()

UPLOAD_ERRORS = {
    400: "Not a .txt or .jsonl file, or a binary, empty or unusable one; the message says why.",
    413: "The file is larger than FFMEM_MAX_UPLOAD_BYTES.",
}


@page(router, "/corpora", "corpora", CorporaContext)
def corpora_list(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    uploaded: Annotated[
        str | None, Query(max_length=1000, description="A corpus just uploaded (its path): shown first.")
    ] = None,
):
    """The corpora this server knows (bundled, uploaded, read by index runs); the upload form."""
    ctx = corpora.corpora_page(session, settings, uploaded=uploaded)
    return render(request, "corpora.html", ctx, fragment="corpora")


@action(router, "/corpora", "upload_corpus", CorpusUpload, status=201, errors=UPLOAD_ERRORS)
def upload_corpus(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    file: Annotated[UploadFile, File(description='A UTF-8 .txt file or a .jsonl file with a "text" field.')],
):
    """Upload a corpus file: checked as `ffmem index` checks one, its skipped lines counted, then listed."""
    view, already = corpora.store_upload(
        settings.upload_folder, file.filename or "", file.file, settings.max_upload_bytes
    )
    if wants_json(request):
        body = CorpusUpload(corpus=view, already=already)
        return JSONResponse(body.model_dump(mode="json"), status_code=200 if already else 201)
    if wants_fragment(request):  # the corpora section with the file's counts, the page kept
        ctx = corpora.corpora_page(session, settings, uploaded=view.corpus)
        return render(request, "corpora.html", ctx, fragment="corpora")
    return RedirectResponse(urls.corpora_url(uploaded=view.corpus), status_code=303)
