"""Free-text search reads a sentence's triggers from the database: `sentence_triggers` (per run and corpus
sentence, the run's positive triggers in it: memory int32, position int16, coefficient float32, by
memory; ffmem.store.memory_lists packs them) instead of every trigger list of the run decoded into each
web process (~70 MB a run for SmolLM2, ~700 MB at Llama-3.1-8B's size). Runs stored before get theirs
from their stored trigger lists here, so their free-text search keeps working.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As revision 0012 packed a trigger list, and as this revision packs a sentence's triggers (frozen here).
TRIGGER = np.dtype([("sentence_index", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])
SENTENCE_TRIGGER = np.dtype([("memory", "<i4"), ("position", "<i2"), ("coefficient", "<f4")])


def upgrade() -> None:
    table = op.create_table(
        "sentence_triggers",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("sentence_index", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_sentence_triggers_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "sentence_index", name=op.f("pk_sentence_triggers")),
    )
    connection = op.get_bind()
    runs = connection.execute(
        sa.text("SELECT runs.id, m.n_keys FROM runs JOIN language_models m ON m.id = runs.model_id")
    ).all()
    for run_id, n_keys in runs:
        lists = connection.execute(
            sa.text(
                "SELECT layer, key, data FROM memory_lists "
                "WHERE run_id = :run AND kind = 'triggers' AND sign = 1"
            ),
            {"run": run_id},
        ).all()
        if lists:
            op.bulk_insert(table, list(_rows(run_id, n_keys, lists)))


def _rows(run_id: int, n_keys: int, lists) -> list[dict]:
    """A run's sentence rows from its positive trigger lists ((layer, key, blob) each)."""
    entries = [np.frombuffer(data, TRIGGER) for _, _, data in lists]
    memory = np.repeat([layer * n_keys + key for layer, key, _ in lists], [len(e) for e in entries])
    entries = np.concatenate(entries)  # [triggers]
    order = np.lexsort((entries["position"], memory, entries["sentence_index"]))
    packed = np.empty(len(order), SENTENCE_TRIGGER)
    packed["memory"] = memory[order]
    packed["position"], packed["coefficient"] = entries["position"][order], entries["coefficient"][order]
    sentences, starts = np.unique(entries["sentence_index"][order], return_index=True)
    parts = np.split(packed, starts[1:])
    return [
        {"run_id": run_id, "sentence_index": int(s), "data": p.tobytes()}
        for s, p in zip(sentences.tolist(), parts, strict=True)
    ]


def downgrade() -> None:
    op.drop_table("sentence_triggers")
