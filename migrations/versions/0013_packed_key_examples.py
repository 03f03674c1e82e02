"""Packed key examples (issue 15's storage target): `key_examples.samples` (JSON [[bin, sentence, position,
coefficient], …]) becomes `bands`, 12-byte records (bin int16, sentence index int32, position int16,
coefficient float32); `shading` goes from float16 to int8 codes with a float32 step per sentence (its
largest |m| / 127; code −128: NaN), the steps first, deflated with zlib (ffmem.store.key_examples; the
encoding is copied here so this revision keeps working if it changes). Cutting the shading into sentences
needs the lengths of the shaded sentences: the key's first `positive` and `negative` triggers
(memory_lists) and its samples.
Downgrading restores the JSON and float16 (from the int8 codes: the precision lost stays lost).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-25
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BAND = np.dtype([("bin", "<i2"), ("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])
TRIGGER = np.dtype([("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])
NOT_MINED, STEPS = -128, 127


def _encode(sentences: list[np.ndarray]) -> bytes:
    steps = np.zeros(len(sentences), np.float32)
    codes = []
    for i, values in enumerate(sentences):
        values = values.astype(np.float32)
        mined = ~np.isnan(values)
        steps[i] = (float(np.abs(values[mined]).max()) if mined.any() else 0.0) / STEPS
        scaled = np.rint(np.divide(values, steps[i], out=np.zeros_like(values), where=mined & (steps[i] > 0)))
        codes.append(np.where(mined, np.clip(scaled, -STEPS, STEPS), NOT_MINED).astype(np.int8))
    return zlib.compress(steps.tobytes() + np.concatenate([*codes, np.zeros(0, np.int8)]).tobytes())


def _decode(data: bytes, lengths: list[int]) -> np.ndarray:
    data = zlib.decompress(data)
    steps = np.frombuffer(data, np.float32, count=len(lengths))
    codes = np.frombuffer(data, np.int8, offset=steps.nbytes)
    values = codes.astype(np.float32) * np.repeat(steps, lengths)
    values[codes == NOT_MINED] = np.nan
    return values


def _examples() -> sa.Table:
    return sa.table(
        "key_examples",
        *map(sa.column, ("run_id", "layer", "key", "positive", "negative", "shading", "bands")),
        sa.column("samples", sa.JSON),
    )


def _convert(up: bool) -> None:
    """Rewrite every row, one (run, layer) at a time."""
    connection = op.get_bind()
    examples = _examples()
    lists = sa.table("memory_lists", *map(sa.column, ("run_id", "kind", "sign", "layer", "key", "data")))
    runs = sa.table("runs", sa.column("id"), sa.column("corpus_id"))
    sentences = sa.table(
        "sentences", sa.column("corpus_id"), sa.column("index"), sa.column("token_ids", sa.JSON)
    )
    parts = connection.execute(
        sa.select(examples.c.run_id, examples.c.layer)
        .distinct()
        .order_by(examples.c.run_id, examples.c.layer)
    ).all()
    lengths: dict[int, int] = {}
    current_run = None
    for run_id, layer in parts:
        if run_id != current_run:
            corpus_id = connection.scalar(sa.select(runs.c.corpus_id).where(runs.c.id == run_id))
            query = sa.select(sentences.c.index, sentences.c.token_ids).where(
                sentences.c.corpus_id == corpus_id
            )
            lengths = {index: len(ids) for index, ids in connection.execute(query)}
            current_run = run_id
        c = lists.c
        triggers = {
            (key, sign): np.frombuffer(data, TRIGGER)["sentence_index"]
            for key, sign, data in connection.execute(
                sa.select(c.key, c.sign, c.data).where(
                    c.run_id == run_id, c.kind == "triggers", c.layer == layer
                )
            )
        }
        e = examples.c
        rows = connection.execute(
            sa.select(e.key, e.positive, e.negative, e.shading, e.samples if up else e.bands).where(
                e.run_id == run_id, e.layer == layer
            )
        ).all()
        updates = []
        for key, positive, negative, shading, listed in rows:
            if up:
                samples = [tuple(s) for s in (listed if isinstance(listed, list) else json.loads(listed))]
            else:
                samples = [tuple(s) for s in np.frombuffer(listed, BAND).tolist()]
            shown = [
                *triggers.get((key, 1), np.zeros(0, np.int32))[:positive].tolist(),
                *triggers.get((key, -1), np.zeros(0, np.int32))[:negative].tolist(),
                *(int(s[1]) for s in samples),
            ]
            cut = [lengths[s] for s in shown]
            if up:
                values = np.frombuffer(shading, np.float16).astype(np.float32)
                bands = np.array(
                    [(int(b), int(s), int(p), float(m)) for b, s, p, m in samples], BAND
                ).tobytes()
                pieces = np.split(values, np.cumsum(cut)[:-1]) if cut else []
                updates.append(dict(k=key, shading_=_encode(pieces), bands_=bands, samples_=None))
            else:
                values = _decode(shading, cut).astype(np.float16)
                listed = [[b, s, p, m] for b, s, p, m in samples]
                updates.append(dict(k=key, shading_=values.tobytes(), bands_=None, samples_=listed))
        if updates:
            table = sa.table(
                "key_examples",
                *map(sa.column, ("run_id", "layer", "key", "shading")),
                sa.column("bands", sa.LargeBinary),
                sa.column("samples", sa.JSON),
            )
            target = "bands" if up else "samples"
            statement = (
                sa.update(table)
                .where(table.c.run_id == run_id, table.c.layer == layer, table.c.key == sa.bindparam("k"))
                .values({"shading": sa.bindparam("shading_"), target: sa.bindparam(f"{target}_")})
            )
            connection.execute(statement, updates)


def upgrade() -> None:
    """Add `bands`, pack every row's samples into it and its shading into int8, drop `samples`."""
    with op.batch_alter_table("key_examples") as batch:
        batch.add_column(sa.Column("bands", sa.LargeBinary(), nullable=True))
    _convert(up=True)
    with op.batch_alter_table("key_examples") as batch:
        batch.drop_column("samples")
        batch.alter_column("bands", existing_type=sa.LargeBinary(), nullable=False)


def downgrade() -> None:
    """Restore `samples` (JSON) and the float16 shading; drop `bands`."""
    with op.batch_alter_table("key_examples") as batch:
        batch.add_column(sa.Column("samples", sa.JSON(), nullable=True))
    _convert(up=False)
    with op.batch_alter_table("key_examples") as batch:
        batch.drop_column("bands")
        batch.alter_column("samples", existing_type=sa.JSON(), nullable=False)
