"""Initial schema: models, vocabulary, corpora and sentences, runs, triggers, value tokens, key stats.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Upgrade the schema."""
    op.create_table(
        "language_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slug", sa.String(length=200), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("revision", sa.String(length=200), nullable=True),
        sa.Column("architecture", sa.String(length=200), nullable=False),
        sa.Column("family", sa.String(length=50), nullable=False),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("n_keys", sa.Integer(), nullable=False),
        sa.Column("d_model", sa.Integer(), nullable=False),
        sa.Column("vocab_size", sa.Integer(), nullable=False),
        sa.Column("activation", sa.String(length=50), nullable=False),
        sa.Column("gated", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_language_models")),
        sa.UniqueConstraint("slug", name=op.f("uq_language_models_slug")),
    )
    op.create_table(
        "tokens",
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("piece", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["language_models.id"],
            name=op.f("fk_tokens_model_id_language_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_id", "token_id", name=op.f("pk_tokens")),
    )
    op.create_table(
        "corpora",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("source_sha256", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("tokenizer", sa.String(length=200), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("n_sentences", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("skipped", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_corpora")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_corpora_fingerprint")),
    )
    op.create_table(
        "sentences",
        sa.Column("corpus_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("offsets", sa.JSON(), nullable=False),
        sa.Column("first_position", sa.SmallInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["corpus_id"], ["corpora.id"], name=op.f("fk_sentences_corpus_id_corpora"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("corpus_id", "index", name=op.f("pk_sentences")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("corpus_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("n_value_tokens", sa.Integer(), nullable=False),
        sa.Column("n_sentences", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=20), nullable=False),
        sa.Column("device", sa.String(length=50), nullable=False),
        sa.Column("package_version", sa.String(length=50), nullable=False),
        sa.Column("provenance", sa.JSON(), nullable=False),
        sa.Column("histogram_edges", sa.JSON(), nullable=False),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["corpus_id"], ["corpora.id"], name=op.f("fk_runs_corpus_id_corpora")),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["language_models.id"],
            name=op.f("fk_runs_model_id_language_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
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
    op.create_index("ix_triggers_sentence", "triggers", ["run_id", "sentence_index"])
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
    op.create_index("ix_value_tokens_token", "value_tokens", ["run_id", "readout", "token_id"])
    op.create_table(
        "key_stats",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.Integer(), nullable=False),
        sa.Column("mean", sa.Float(), nullable=False),
        sa.Column("positive_share", sa.Float(), nullable=False),
        sa.Column("max_coefficient", sa.Float(), nullable=True),
        sa.Column("min_coefficient", sa.Float(), nullable=True),
        sa.Column("value_norm", sa.Float(), nullable=False),
        sa.Column("histogram", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_key_stats_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "layer", "key", name=op.f("pk_key_stats")),
    )


def downgrade() -> None:
    """Downgrade the schema."""
    op.drop_table("key_stats")
    op.drop_index("ix_value_tokens_token", table_name="value_tokens")
    op.drop_table("value_tokens")
    op.drop_index("ix_triggers_sentence", table_name="triggers")
    op.drop_table("triggers")
    op.drop_table("runs")
    op.drop_table("sentences")
    op.drop_table("corpora")
    op.drop_table("tokens")
    op.drop_table("language_models")
