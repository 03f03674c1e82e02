"""Bulk inserts in the session's transaction: COPY on Postgres (binary where every column's type has a
binary form written from the same Python values: half the server's work of parsing the text form, a third
of ours of writing it), a driver-level executemany per chunk on SQLite (about twice as fast as Core's dict
rows), Core's portable insert on any other backend."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice

from sqlalchemy import JSON, Connection, Table, insert, text
from sqlalchemy.orm import Session

from ffmem.store.db import json_dumps
from ffmem.store.models import Coded

CHUNK_ROWS = 50_000  # rows per executemany


def bulk_insert(
    session: Session,
    table: Table,
    columns: Sequence[str],
    rows: Iterable[tuple],
    *,
    fixed: dict[str, object] | None = None,
    json_text: Sequence[str] = (),
) -> None:
    """Insert tuples of `columns` in the session's transaction: COPY on Postgres, executemany on SQLite;
    the cycle collector paused meanwhile (`collector_paused`). `fixed` gives columns of one value for
    every row (a run's id, a layer), written before the rows' own and converted once, not a row at a time;
    the JSON columns named in `json_text` come as the JSON text db.json_dumps writes (made in bulk)."""
    with collector_paused():
        done, values = 0, tuple((fixed or {}).values())
        dialect = session.connection().dialect
        if json_text and dialect.name not in BULK_DIALECTS:  # Core encodes JSON itself: the values back
            at = [columns.index(name) for name in json_text]
            rows = (tuple(json.loads(v) if i in at else v for i, v in enumerate(row)) for row in rows)
            json_text = ()
        if values:
            if dialect.name in BULK_DIALECTS:  # converted here once (Core converts any other's itself)
                values, done = next(iter(_converted(table, list(fixed), [values], dialect))), len(values)
            rows = map(values.__add__, rows)  # each row: the fixed values, then its own
            columns = (*fixed, *columns)
        _insert(session, table, columns, rows, done, set(json_text))


BULK_DIALECTS = ("postgresql", "sqlite")  # COPY and executemany; any other takes Core's portable insert


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off for the while: the rows of a bulk write are tuples of numbers, bytes
    and text, which make no cycles, but their hundreds of thousands of allocations would run it again and
    again over every object the process holds (a tenth to a half of an explanations' or key statistics'
    write)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _converted(
    table: Table,
    columns: Sequence[str],
    rows: Iterable[tuple],
    dialect,
    done: int = 0,
    text: set = frozenset(),
):
    """The rows with their JSON columns as text and their Coded ones as numbers (models.Coded), as the
    engine writes them; the first `done` columns, and the JSON ones named in `text`, are already so."""
    json_columns = [
        i for i, c in enumerate(columns) if i >= done and c not in text and isinstance(table.c[c].type, JSON)
    ]
    if json_columns:
        rows = (_json_encoded(row, json_columns) for row in rows)
    coded = [i for i, c in enumerate(columns) if i >= done and isinstance(table.c[c].type, Coded)]
    if coded:  # a name as its number (models.Coded), as the engine writes it
        rows = _numbered(rows, {i: table.c[columns[i]].type for i in coded}, dialect)
    return rows


def _insert(
    session: Session,
    table: Table,
    columns: Sequence[str],
    rows: Iterable[tuple],
    done: int = 0,
    json_text: set = frozenset(),
) -> None:
    connection = session.connection()
    dialect = connection.dialect.name
    if dialect not in BULK_DIALECTS:  # any other backend: the portable, slower Core path
        for chunk in chunks(rows, CHUNK_ROWS):
            connection.execute(insert(table), [dict(zip(columns, row, strict=True)) for row in chunk])
        return
    rows = _converted(table, columns, rows, connection.dialect, done, json_text)
    quote = connection.dialect.identifier_preparer
    target = f"{quote.format_table(table)} ({', '.join(quote.quote(column) for column in columns)})"
    if dialect == "postgresql":
        types = _binary_types(connection, quote.format_table(table), columns)
        binary = " (FORMAT BINARY)" if types else ""
        driver = connection.connection.driver_connection  # psycopg: COPY joins the session's transaction
        with driver.cursor() as cursor, cursor.copy(f"COPY {target} FROM STDIN{binary}") as copy:
            if types:
                copy.set_types(types)
            for row in rows:
                copy.write_row(row)
    else:
        sql = f"INSERT INTO {target} VALUES ({', '.join('?' * len(columns))})"
        for chunk in chunks(rows, CHUNK_ROWS):
            connection.exec_driver_sql(sql, chunk)


# Postgres types whose binary COPY form psycopg writes from the values the text form is written from (ints,
# floats, bytes, str): by name, the type it is written as. JSON's binary form is its text.
BINARY_COPY = {
    "int2": "int2",
    "int4": "int4",
    "int8": "int8",
    "float4": "float4",
    "float8": "float8",
    "bytea": "bytea",
    "text": "text",
    "varchar": "varchar",
    "json": "text",
}


def _binary_types(connection: Connection, table: str, columns: Sequence[str]) -> list[str] | None:
    """The types a binary COPY into these columns declares, or None where one has no binary form here."""
    query = text(
        "SELECT a.attname, t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "WHERE a.attrelid = to_regclass(:table) AND a.attnum > 0 AND NOT a.attisdropped"
    )
    found = dict(connection.execute(query, {"table": table}).all())
    types = [BINARY_COPY.get(found.get(column, "")) for column in columns]
    return None if None in types else types


def _numbered(rows: Iterable[tuple], coded: dict[int, Coded], dialect) -> Iterator[tuple]:
    """The rows with each Coded column's name as its number (a name not of the column: KeyError)."""
    numbers = {
        i: {name: kind.process_bind_param(name, dialect) for name in kind.names} for i, kind in coded.items()
    }
    for row in rows:
        row = list(row)
        for i, number in numbers.items():
            row[i] = number[row[i]]
        yield tuple(row)


def _json_encoded(row: tuple, json_columns: list[int]) -> tuple:
    row = list(row)
    for i in json_columns:
        row[i] = json_dumps(row[i])  # as the engine writes JSON: compact
    return tuple(row)


def chunks(rows: Iterable[tuple], size: int) -> Iterator[list[tuple]]:
    """The rows in lists of at most `size`, in order."""
    iterator = iter(rows)
    while chunk := list(islice(iterator, size)):
        yield chunk
