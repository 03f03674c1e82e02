"""The labels index of a model (`/m/{model}/labels`): every labelled memory with its current label — the
names people gave memories, which otherwise only the search finds — sortable by memory, by the label's
text or by date; its JSON twin renders the same context, and `labels.csv` the same rows as CSV. Also the
JSON answers to labelling a memory and to deleting a label (on its key page)."""

from __future__ import annotations

import csv
import io
from datetime import timezone
from typing import Literal

from pydantic import BaseModel, Field

from ffmem.store import memory_labels
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel
from ffmem.web import urls
from ffmem.web.views import LabelHit, LabelView, ModelPage, label_view

LabelSort = Literal["key", "label", "date"]  # memory_labels.LABEL_SORTS
SORT_NAMES = {"key": "layer and key", "label": "label", "date": "newest first"}
CSV_COLUMNS = ("layer", "key", "pattern", "tag", "author", "created_at", "url")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula


class LabelSortLink(BaseModel):
    """One way to sort the labels, and this page sorted so."""

    name: str = Field(description="The `sort` value.")
    title: str = Field(description="What it sorts by, in words.")
    url: str


class LabelsContext(ModelPage):
    """Every memory of a model that has a label, with its current (newest) label."""

    page: str = "labels"
    sort: LabelSort = Field(
        description="key: by layer, then key; label: by the label's text; date: newest first."
    )
    sorts: list[LabelSortLink] = Field(description="Each way to sort, and this page sorted so.")
    csv_url: str = Field(description="The same labels, in the same order, as CSV.")
    labels: list[LabelHit] = Field(
        description="Each labelled memory's current label, its place and its page."
    )


class LabelAnswer(BaseModel):
    """The JSON answer to a new label: the label, and how many earlier ones stay as its history."""

    label: LabelView
    history: int = Field(description="Earlier labels of the memory, kept as its history.")


class LabelDeleted(BaseModel):
    """The JSON answer to deleting a label: it, the memory's label now (the one before it, if any), and how
    many earlier ones stay."""

    deleted: LabelView
    label: LabelView | None = Field(description="The memory's label now (null: none).")
    history: int = Field(description="Earlier labels of the memory, kept as its history.")


def labels_page(session: Session, model: LanguageModel, sort: LabelSort) -> LabelsContext:
    found = memory_labels.model_labels(session=session, model_id=model.id, sort=sort)
    return LabelsContext(
        title=f"{model.slug}: labels",
        model=model.slug,
        sort=sort,
        sorts=[
            LabelSortLink(name=name, title=title, url=urls.model_labels_url(model.slug, sort=name))
            for name, title in SORT_NAMES.items()
        ],
        csv_url=urls.model_labels_url(model.slug, "csv", sort=sort),
        labels=[
            LabelHit(
                layer=label.layer,
                key=label.key,
                url=urls.key_url(model.slug, label.layer, label.key),
                **label_view(label).model_dump(),
            )
            for label in found
        ],
    )


def labels_csv(ctx: LabelsContext) -> str:
    """The context's labels as CSV (RFC 4180: quoted where needed, CRLF line ends), one row a label, with a
    header row; times in UTC, RFC 3339 to the second; its texts safe to open in a spreadsheet."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for label in ctx.labels:
        created = label.created_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        texts = [label.pattern, label.tag, label.author]
        writer.writerow([label.layer, label.key, *map(spreadsheet_text, texts), created, label.url])
    return out.getvalue()


def spreadsheet_text(text: str) -> str:
    """A text cell a spreadsheet opens as text: one starting with = + - @, a tab or a carriage return gets
    a leading ' (OWASP's advice on CSV injection: `=HYPERLINK(…)` stays words, not a live formula). Only
    text cells: the numbers (layer, key) stay numbers."""
    return f"'{text}" if text.startswith(FORMULA_STARTS) else text
