"""What every `ffmem` command shares: the device and dtype choices, the --db option, and one way to
turn a known user error into a clear line."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from ffmem.engine.errors import FfmemError


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DbOption = Annotated[str | None, typer.Option("--db", help="Database URL (default: settings.database_url).")]


def fail_cleanly(action):
    """Run `action`; a known user error becomes one clear line and exit code 2, not a traceback."""
    try:
        return action()
    except FfmemError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
