"""Bulk inserts in the session's transaction: COPY on Postgres, a driver-level executemany per chunk on
SQLite (about twice as fast as Core's dict rows), Core's portable insert on any other backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

from sqlalchemy import JSON, Table, insert
from sqlalchemy.orm import Session

from ffmem.store.db import json_dumps

CHUNK_ROWS = 50_000  # rows per executemany


def bulk_insert(session: Session, table: Table, columns: Sequence[str], rows: Iterable[tuple]) -> None:
    """Insert tuples of `columns` in the session's transaction: COPY on Postgres, executemany on SQLite."""
    connection = session.connection()
    dialect = connection.dialect.name
    if dialect not in ("postgresql", "sqlite"):  # any other backend: the portable, slower Core path
        for chunk in chunks(rows, CHUNK_ROWS):
            connection.execute(insert(table), [dict(zip(columns, row, strict=True)) for row in chunk])
        return
    json_columns = [i for i, column in enumerate(columns) if isinstance(table.c[column].type, JSON)]
    if json_columns:
        rows = (_json_encoded(row, json_columns) for row in rows)
    quote = connection.dialect.identifier_preparer
    target = f"{quote.format_table(table)} ({', '.join(quote.quote(column) for column in columns)})"
    if dialect == "postgresql":
        driver = connection.connection.driver_connection  # psycopg: COPY joins the session's transaction
        with driver.cursor() as cursor, cursor.copy(f"COPY {target} FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
    else:
        sql = f"INSERT INTO {target} VALUES ({', '.join('?' * len(columns))})"
        for chunk in chunks(rows, CHUNK_ROWS):
            connection.exec_driver_sql(sql, chunk)


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
