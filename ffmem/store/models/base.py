"""What every table shares: the declarative `Base` (with stable constraint names), the 4-byte `Float32` of a
statistic, `now` (every timestamp's UTC), and `stored_as_text` (an enum column as text with a CHECK)."""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum

from sqlalchemy import Enum, Float, MetaData
from sqlalchemy.dialects.postgresql import REAL
from sqlalchemy.orm import DeclarativeBase

# A statistic of a memory: 4 bytes on Postgres (real; double precision before revision 0024) where a table
# holds a row per memory; SQLite stores every REAL in 8 bytes whatever the declaration.
Float32 = Float().with_variant(REAL(), "postgresql")


def now() -> datetime:
    """The time every timestamp column stores: now, in UTC."""
    return datetime.now(timezone.utc)


def stored_as_text(enum: type[StrEnum], name: str) -> Enum:
    """A column holding one of `enum`'s values as text (VARCHAR(20) and the CHECK constraint `name` on
    every backend, not a Postgres ENUM type), read back as the enum member."""
    return Enum(
        enum,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=20,
        values_callable=lambda members: [member.value for member in members],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    """Declarative base; constraints get stable names so Alembic (and SQLite batch mode) can alter them."""

    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
