"""Packed memory lists (issue 15's storage target): `memory_lists`, one row per run, kind, sign, layer and
key holding the whole ranked list as bytes, replaces the row-per-entry tables `triggers` and
`value_tokens` and their three indexes (ffmem.store.memory_lists describes the encoding; its dtypes are
copied here so this revision keeps working if they change). Value tokens keep no per-token probability:
each list stores the log-normaliser of its readout, log_z = logit − log(prob) of its top token, so
prob = exp(logit − log_z). Downgrading unpacks the lists into the old tables again.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from itertools import groupby

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIGGER = np.dtype([("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])
VALUE_HEADER = np.dtype([("token_bytes", "u1"), ("log_z", "<f4")])
CHUNK = 20_000


def _value_entry(token_bytes: int) -> np.dtype:
    return np.dtype([("token_id", "<u2" if token_bytes == 2 else "<i4"), ("logit", "<f4")])


def _memory_lists() -> sa.Table:
    return sa.table(
        "memory_lists",
        sa.column("run_id", sa.Integer()),
        sa.column("kind", sa.String()),
        sa.column("sign", sa.SmallInteger()),
        sa.column("layer", sa.SmallInteger()),
        sa.column("key", sa.Integer()),
        sa.column("data", sa.LargeBinary()),
    )


def _old_tables() -> tuple[sa.Table, sa.Table]:
    triggers = sa.table(
        "triggers",
        *(sa.column(name) for name in ("run_id", "layer", "key", "sign", "rank")),
        *(sa.column(name) for name in ("sentence_index", "position", "coefficient")),
    )
    value_tokens = sa.table(
        "value_tokens",
        *(sa.column(name) for name in ("run_id", "layer", "key", "readout", "direction", "rank")),
        *(sa.column(name) for name in ("token_id", "logit", "prob")),
    )
    return triggers, value_tokens


def _insert(connection, table: sa.Table, rows: Iterator[dict]) -> None:
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) >= CHUNK:
            connection.execute(sa.insert(table), batch)
            batch.clear()
    if batch:
        connection.execute(sa.insert(table), batch)


def upgrade() -> None:
    """Create memory_lists, pack every run's triggers and value tokens into it, drop the old tables."""
    op.create_table(
        "memory_lists",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("sign", sa.SmallInteger(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_memory_lists_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "kind", "sign", "layer", "key", name=op.f("pk_memory_lists")),
    )
    connection = op.get_bind()
    triggers, value_tokens = _old_tables()
    c = triggers.c
    query = sa.select(c.run_id, c.layer, c.key, c.sign, c.sentence_index, c.position, c.coefficient).order_by(
        c.run_id, c.layer, c.key, c.sign, c.rank
    )

    def packed_triggers() -> Iterator[dict]:
        rows = connection.execute(query.execution_options(stream_results=True, yield_per=CHUNK))
        for (run_id, layer, key, sign), entries in groupby(rows, key=lambda r: tuple(r[:4])):
            packed = np.array([tuple(r[4:]) for r in entries], TRIGGER)  # [T]
            yield dict(run_id=run_id, kind="triggers", sign=sign, layer=layer, key=key, data=packed.tobytes())

    _insert(connection, _memory_lists(), packed_triggers())
    v = value_tokens.c
    widest = connection.scalar(sa.select(sa.func.max(v.token_id)))
    width = 2 if widest is None or widest < 2**16 else 4
    query = sa.select(v.run_id, v.layer, v.key, v.readout, v.direction, v.token_id, v.logit, v.prob).order_by(
        v.run_id, v.layer, v.key, v.readout, v.direction.desc(), v.rank
    )

    def packed_values() -> Iterator[dict]:
        rows = connection.execute(query.execution_options(stream_results=True, yield_per=CHUNK))
        log_z = math.nan
        for (run_id, layer, key, readout, direction), entries in groupby(rows, key=lambda r: tuple(r[:5])):
            entries = list(entries)
            if direction == 1 or math.isnan(log_z):  # the top list comes first: its top token is the surest
                token = max(entries, key=lambda r: r.prob)
                log_z = token.logit - math.log(token.prob) if token.prob > 0 else math.nan
            header = np.array([(width, log_z)], VALUE_HEADER)
            packed = np.array([(r.token_id, r.logit) for r in entries], _value_entry(width))
            data = header.tobytes() + packed.tobytes()
            yield dict(run_id=run_id, kind=readout, sign=direction, layer=layer, key=key, data=data)
            if direction == -1:
                log_z = math.nan

    _insert(connection, _memory_lists(), packed_values())
    op.drop_index("ix_value_tokens_token", table_name="value_tokens")
    op.drop_table("value_tokens")
    op.drop_index("ix_triggers_sentence", table_name="triggers")
    op.drop_table("triggers")


def downgrade() -> None:
    """Recreate triggers and value_tokens (with their indexes) from the packed lists; drop memory_lists."""
    op.create_table(
        "triggers",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("sign", sa.SmallInteger(), nullable=False),
        sa.Column("rank", sa.SmallInteger(), nullable=False),
        sa.Column("sentence_index", sa.Integer(), nullable=False),
        sa.Column("position", sa.SmallInteger(), nullable=False),
        sa.Column("coefficient", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_triggers_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", "sign", "rank", name=op.f("pk_triggers")),
    )
    op.create_table(
        "value_tokens",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("readout", sa.String(length=8), nullable=False),
        sa.Column("direction", sa.SmallInteger(), nullable=False),
        sa.Column("rank", sa.SmallInteger(), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("logit", sa.Float(), nullable=False),
        sa.Column("prob", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_value_tokens_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "layer", "key", "readout", "direction", "rank", name=op.f("pk_value_tokens")
        ),
    )
    connection = op.get_bind()
    lists = _memory_lists()
    triggers, value_tokens = _old_tables()
    query = sa.select(lists.c.run_id, lists.c.kind, lists.c.sign, lists.c.layer, lists.c.key, lists.c.data)

    def unpacked(kind_is_triggers: bool) -> Iterator[dict]:
        where = lists.c.kind == "triggers" if kind_is_triggers else lists.c.kind != "triggers"
        rows = connection.execute(query.where(where).execution_options(stream_results=True, yield_per=CHUNK))
        for run_id, kind, sign, layer, key, data in rows:
            memory = dict(run_id=run_id, layer=layer, key=key)
            if kind_is_triggers:
                for rank, (s, p, c) in enumerate(np.frombuffer(data, TRIGGER).tolist()):
                    yield memory | dict(sign=sign, rank=rank, sentence_index=s, position=p, coefficient=c)
                continue
            header = np.frombuffer(data, VALUE_HEADER, count=1)[0]
            entries = np.frombuffer(
                data, _value_entry(int(header["token_bytes"])), offset=VALUE_HEADER.itemsize
            )
            probs = np.exp(entries["logit"].astype(np.float64) - float(header["log_z"])).tolist()
            for rank, ((t, logit), prob) in enumerate(zip(entries.tolist(), probs, strict=True)):
                yield memory | dict(
                    readout=kind, direction=sign, rank=rank, token_id=t, logit=logit, prob=prob
                )

    _insert(connection, triggers, unpacked(True))
    _insert(connection, value_tokens, unpacked(False))
    op.create_index(
        "ix_triggers_sentence", "triggers", ["run_id", "sentence_index", "sign", "coefficient", "position"]
    )
    op.create_index("ix_value_tokens_token", "value_tokens", ["run_id", "readout", "token_id"])
    op.drop_table("memory_lists")
