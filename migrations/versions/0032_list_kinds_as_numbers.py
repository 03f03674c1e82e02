"""A memory list's kind as a number, and the write-once primary keys of Postgres filled (issue 41: ≤ 8 KB
a memory). `memory_lists.kind` was text ("norm", "raw", "triggers"): 4–9 bytes in each of a memory's six
rows and in each entry of the primary key's index, whose entries of unequal width (32 bytes) Postgres's
B-tree split in halves as a run's layers were written (59 % full after a write). It is now SMALLINT 1, 2, 3
(models.Coded: the names' sorted order kept, so ORDER BY kind sorts as before), 24-byte entries of equal
width that the B-tree fills to its fillfactor. On Postgres the primary keys of the tables a run writes once,
a row a memory, token or layer in key order, are filled to 100 % (from their next page split on: the pages
already written stay as they are). An explanation's token table packs its ids as wide as they need from
this revision on (ffmem.store.composition); the tables stored before read as they were, and downgrading
writes the new ones back with int32 ids.

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0032"
down_revision: str | Sequence[str] | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = ("norm", "raw", "triggers")  # as 1, 2, 3 (models.memories.LIST_KINDS)
WRITTEN_ONCE = (  # the primary keys of a run's rows, written in key order and then only read
    "pk_memory_lists",
    "pk_key_stats",
    "pk_key_orders",
    "pk_key_examples",
    "pk_value_histograms",
    "pk_token_memories",
    "pk_sentence_triggers",
    "pk_neighbours",
    "pk_memory_links",
    "pk_explanations",
)


def _numbers(column: str) -> str:
    return "CASE " + column + "".join(f" WHEN '{kind}' THEN {i}" for i, kind in enumerate(KINDS, 1)) + " END"


def _names(column: str) -> str:
    return "CASE " + column + "".join(f" WHEN {i} THEN '{kind}'" for i, kind in enumerate(KINDS, 1)) + " END"


HEADER = np.dtype([("sign", "i1"), ("tokens", "<u2"), ("pairs", "<u2")])  # composition.TOKEN_TABLE_HEADER
PACKED_TABLE = 0x40  # composition.PACKED_TABLE: a packed table's first byte is this + 4 · width + sign + 1


def upgrade() -> None:
    """Every stored kind as its number; the primary keys' fillfactor 100 on Postgres."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE memory_lists ALTER COLUMN kind TYPE smallint USING ({_numbers('kind')})")
        for index in WRITTEN_ONCE:
            op.execute(f"ALTER INDEX {index} SET (fillfactor = 100)")
        return
    op.execute(f"UPDATE memory_lists SET kind = {_numbers('kind')}")  # the digits, while the column is text
    with op.batch_alter_table("memory_lists", recreate="always") as batch:
        batch.alter_column("kind", type_=sa.SmallInteger(), existing_type=sa.String(8), nullable=False)


def downgrade() -> None:
    """Every kind as its name again; the primary keys' fillfactor as Postgres's default; the token tables
    packed since with int32 ids."""
    _unpack_token_tables()
    if op.get_bind().dialect.name == "postgresql":
        for index in WRITTEN_ONCE:
            op.execute(f"ALTER INDEX {index} RESET (fillfactor)")
        op.execute(f"ALTER TABLE memory_lists ALTER COLUMN kind TYPE varchar(8) USING ({_names('kind')})")
        return
    with op.batch_alter_table("memory_lists", recreate="always") as batch:
        batch.alter_column("kind", type_=sa.String(8), existing_type=sa.SmallInteger(), nullable=False)
    op.execute(f"UPDATE memory_lists SET kind = {_names('CAST(kind AS INTEGER)')}")


def _unpack_token_tables() -> None:
    """Every token table packed with narrow ids written as revision 0024 wrote it (ids int32), a run's
    layer at a time."""
    bind = op.get_bind()
    layers = bind.execute(sa.text("SELECT DISTINCT run_id, layer FROM explanations")).all()
    for run_id, layer in layers:
        where = {"run_id": run_id, "layer": layer}
        tables = bind.execute(
            sa.text(
                "SELECT key, token_table FROM explanations "
                "WHERE run_id = :run_id AND layer = :layer AND token_table IS NOT NULL"
            ),
            where,
        ).all()
        narrow = [(key, bytes(data)) for key, data in tables if PACKED_TABLE <= bytes(data)[0] < 0x80]
        if narrow:
            bind.execute(
                sa.text(
                    "UPDATE explanations SET token_table = :data "
                    "WHERE run_id = :run_id AND layer = :layer AND key = :key"
                ),
                [{**where, "key": key, "data": _int32_ids(data)} for key, data in narrow],
            )


def _int32_ids(data: bytes) -> bytes:
    """A packed token table as revision 0024's: the sign alone in the first byte, every id in int32."""
    header = np.frombuffer(data, HEADER, count=1).copy()
    width, sign = (data[0] - PACKED_TABLE) // 4, (data[0] & 3) - 1
    n, p = int(header[0]["tokens"]), int(header[0]["pairs"])
    header["sign"] = sign
    parts, at = [header.tobytes()], HEADER.itemsize
    for ids, count in ((True, n), (False, n), (True, 2 * p), (False, p)):
        size = count * (width if ids else 2)
        chunk = np.frombuffer(data, np.uint8, count=size, offset=at)
        at += size
        if ids:
            wide = np.zeros((count, 8), np.uint8)  # [count, 8]
            wide[:, :width] = chunk.reshape(count, width)
            values = wide.view("<i8")[:, 0]  # [count]
            values[values == 256**width - 1] = -1  # all ones: a pair's start of sentence
            chunk = values.astype("<i4")
        parts.append(chunk.tobytes())
    return b"".join(parts)
