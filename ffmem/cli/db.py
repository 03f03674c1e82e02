"""`ffmem db`: database maintenance."""

from __future__ import annotations

import typer

from ffmem.cli.common import DbOption, fail_cleanly
from ffmem.config import get_settings


def db_upgrade(db: DbOption = None) -> None:
    """Create or migrate the database schema to the latest version (Alembic)."""
    from ffmem.store.db import upgrade

    url = db or get_settings().database_url
    fail_cleanly(lambda: upgrade(url))
    typer.echo(f"database at {url} is up to date")
