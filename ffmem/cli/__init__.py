"""`ffmem`: the command line, one app whose commands live in the modules beside this one. Heavy imports
(torch) happen inside the commands that need them."""

from __future__ import annotations

import typer

from ffmem.cli import db, index, runs, serve, trace, transfer

cli = typer.Typer(
    help="Explore the key-value memories inside transformer feed-forward layers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cli.command()(index.index)
cli.command()(serve.worker)
cli.command()(serve.serve)
cli.command()(runs.analyze)
cli.command()(runs.compose)
cli.command()(transfer.export)
cli.command("import")(transfer.import_)
cli.command("trace")(trace.trace_command)
cli.command()(serve.demo)

db_cli = typer.Typer(help="Database maintenance.", no_args_is_help=True)
db_cli.command("upgrade")(db.db_upgrade)
cli.add_typer(db_cli, name="db")


def main() -> None:
    cli()
