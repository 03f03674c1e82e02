"""A vocabulary entry found by its text through an index, not a scan of the model's vocabulary: token
search and the layer page's token filter named a token by scanning every row of the model's tokens (22 ms
at Llama-3's 128,256 tokens, per query).

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_tokens_text", "tokens", ["model_id", "text"])


def downgrade() -> None:
    op.drop_index("ix_tokens_text", table_name="tokens")
