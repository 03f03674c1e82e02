"""What every table shares: the declarative `Base` (with stable constraint names), the 4-byte `Float32` of a
statistic, `now` (every timestamp's UTC), `stored_as_text` (an enum column as text with a CHECK) and `Coded`
(a column of a few names held as small integers)."""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum

from sqlalchemy import Enum, Float, MetaData, SmallInteger, TypeDecorator
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


class Coded(TypeDecorator):
    """A column holding one of a few names, stored as its number (SMALLINT: 1 for the first name, 2 for the
    next…) and read back as the name: 2 bytes where the name's text took 4–9 in a row of every memory and
    in its primary key's index. Give the names in sorted order and ORDER BY the column sorts as the names
    did. A name outside them is refused on writing (KeyError)."""

    impl = SmallInteger
    cache_ok = True

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names

    def process_bind_param(self, value: str | None, dialect) -> int | None:
        if value is None:
            return None
        if value not in self.names:
            raise KeyError(f"{value!r} is none of {self.names}")
        return self.names.index(value) + 1

    def process_result_value(self, value: int | None, dialect) -> str | None:
        return None if value is None else self.names[value - 1]


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
