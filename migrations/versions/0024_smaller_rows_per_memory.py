"""Smaller rows a memory, for models of 8B parameters (458,752 memories): ≤ 8 KB a memory on Postgres too.

- `key_stats`' statistics become `real` on Postgres (4 bytes, double precision before): float32 holds
  7 digits, the pages show 3 or 4. SQLite stores every REAL in 8 bytes whatever the declaration: nothing
  changes there.
- A sentence's triggers (`sentence_triggers.data`, rows of ~5 KB that Postgres compresses) use lz4 on
  Postgres where the server has it (its default, pglz, keeps a value only when it saves a quarter: these
  records save ~15 %). Rows stored before keep theirs until rewritten.
- An explanation's token table (`explanations.token_table`, revision 0023) stores its weights as float16
  (6 B a token, 10 a pair; 8 and 12 before): the tables stored before are packed again.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | Sequence[str] | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATISTICS = (  # key_stats' float columns
    "mean",
    "positive_share",
    "max_coefficient",
    "min_coefficient",
    "value_norm",
    "density",
    "max_prob",
    "first_token_change",
    "last_token_change",
    "shallowness",
    "quadrant_pp",
    "quadrant_pn",
    "quadrant_np",
    "quadrant_nn",
)
HEADER = np.dtype([("sign", "i1"), ("tokens", "<u2"), ("pairs", "<u2")])  # composition.TOKEN_TABLE_HEADER
BATCH = 10_000  # explanations packed again per round trip


def upgrade() -> None:
    _statistics("REAL")
    _compression("lz4")
    _repack("<f4", "<f2")


def downgrade() -> None:
    _statistics("DOUBLE PRECISION")
    _compression("default")
    _repack("<f2", "<f4")


def _compression(method: str) -> None:
    """sentence_triggers.data's compression on Postgres; a server built without lz4 keeps its default."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    savepoint = bind.begin_nested()  # the error of a server without lz4 leaves the rest of the upgrade
    try:
        bind.exec_driver_sql(f"ALTER TABLE sentence_triggers ALTER COLUMN data SET COMPRESSION {method}")
    except sa.exc.DBAPIError:
        savepoint.rollback()
    else:
        savepoint.commit()


def _statistics(type_: str) -> None:
    """key_stats' statistics as `type_`, on Postgres (one rewrite of the table)."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE key_stats {', '.join(f'ALTER COLUMN {c} TYPE {type_}' for c in STATISTICS)}")


def _repack(weights_from: str, weights_to: str) -> None:
    """Every stored token table's weights from one float width to the other (ids, header unchanged)."""
    bind = op.get_bind()
    select = sa.text(
        "SELECT run_id, layer, key, token_table FROM explanations WHERE token_table IS NOT NULL "
        "AND (run_id, layer, key) > (:run_id, :layer, :key) ORDER BY run_id, layer, key LIMIT :limit"
    )
    update = sa.text(
        "UPDATE explanations SET token_table = :data WHERE run_id = :run_id AND layer = :layer AND key = :key"
    )
    after = {"run_id": -1, "layer": -1, "key": -1}
    while rows := bind.execute(select, {**after, "limit": BATCH}).all():
        bind.execute(
            update,
            [
                {
                    "run_id": r,
                    "layer": layer,
                    "key": key,
                    "data": _packed(bytes(data), weights_from, weights_to),
                }
                for r, layer, key, data in rows
            ],
        )
        after = dict(zip(("run_id", "layer", "key"), rows[-1][:3], strict=True))


def _packed(data: bytes, weights_from: str, weights_to: str) -> bytes:
    """A token table with its weights (tokens', then pairs') converted, at float16's bound beyond it."""
    header = np.frombuffer(data, HEADER, count=1)[0]
    n, p = int(header["tokens"]), int(header["pairs"])
    parts, at = [data[: HEADER.itemsize]], HEADER.itemsize
    for dtype, count in (("<i4", n), (weights_from, n), ("<i4", 2 * p), (weights_from, p)):
        values = np.frombuffer(data, dtype, count=count, offset=at)
        at += values.nbytes
        if dtype == weights_from:
            bound = float(np.finfo(np.float16).max)
            values = np.clip(values.astype(np.float64), -bound, bound).astype(weights_to)
        parts.append(values.tobytes())
    return b"".join(parts)
