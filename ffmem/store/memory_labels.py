"""People's labels of memories in the database (a memory's newest label is its label, the earlier ones
its history): written and read by the explorer's label forms and pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from ffmem.store.models import Label, now
from ffmem.store.vocabularies import stored_text


def add_label(
    *, session: Session, model_id: int, layer: int, key: int, pattern: str, tag: str, author: str
) -> Label:
    """A memory's new label; its earlier ones stay as its history."""
    label = Label(
        model_id=model_id, layer=layer, key=key, pattern=pattern, tag=tag, author=author, created_at=now()
    )
    session.add(label)
    session.flush()
    return label


def label_history(*, session: Session, model_id: int, layer: int, key: int) -> list[Label]:
    """A memory's labels, the newest (its label) first."""
    query = select(Label).where(Label.model_id == model_id, Label.layer == layer, Label.key == key)
    return list(session.scalars(query.order_by(Label.id.desc())))


def get_label(*, session: Session, label_id: int) -> Label | None:
    return session.get(Label, label_id)


def delete_label(*, session: Session, label_id: int) -> None:
    """Delete one label; when it was its memory's newest, the one before it is the label again."""
    session.execute(delete(Label).where(Label.id == label_id))


def _newest_labels(model_id: int):
    """The ids of each labelled memory's newest label."""
    return (
        select(func.max(Label.id)).where(Label.model_id == model_id).group_by(Label.layer, Label.key)
    ).scalar_subquery()


def current_labels(*, session: Session, model_id: int, layer: int, keys: Sequence[int]) -> dict[int, Label]:
    """key → its label, for the labelled ones among `keys` of `layer`."""
    query = select(Label).where(
        Label.id.in_(_newest_labels(model_id)), Label.layer == layer, Label.key.in_(list(keys))
    )
    return {label.key: label for label in session.scalars(query)}


def search_labels(*, session: Session, model_id: int, text: str, limit: int) -> list[Label]:
    """Current labels whose pattern, tag or author contains `text` (any case), by layer and key."""
    needle = stored_text(text).lower()
    matches = [
        func.lower(column).contains(needle, autoescape=True)
        for column in (Label.pattern, Label.tag, Label.author)
    ]
    query = select(Label).where(Label.id.in_(_newest_labels(model_id)), or_(*matches))
    return list(session.scalars(query.order_by(Label.layer, Label.key).limit(limit)))


LABEL_SORTS = ("key", "label", "date")


def model_labels(*, session: Session, model_id: int, sort: str = "key") -> list[Label]:
    """Every labelled memory's current label (its newest) of a model, sorted by memory ("key": layer, then
    key), by the label's text ("label": case-folded, then by memory) or by date ("date": the newest first).
    The text is sorted here, not by the database, whose collation differs between SQLite and Postgres."""
    if sort not in LABEL_SORTS:
        raise ValueError(f"unknown label sort {sort!r}; choose from {LABEL_SORTS}")
    query = select(Label).where(Label.model_id == model_id, Label.id.in_(_newest_labels(model_id)))
    labels = list(session.scalars(query.order_by(Label.layer, Label.key)))
    if sort == "label":
        labels.sort(key=lambda label: (label.pattern.casefold(), label.pattern))  # stable: then by memory
    elif sort == "date":
        labels.sort(key=lambda label: (label.created_at, label.id), reverse=True)
    return labels
