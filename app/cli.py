"""`ffmem`: the command line. Heavy imports (torch) happen inside the commands that need them."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from app.config import get_settings
from engine.errors import FfmemError

cli = typer.Typer(
    help="Explore the key-value memories inside transformer feed-forward layers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_cli = typer.Typer(help="Database maintenance.", no_args_is_help=True)
cli.add_typer(db_cli, name="db")


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


@db_cli.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Create or migrate the database schema to the latest version (Alembic)."""
    from app.db import upgrade

    url = db or get_settings().database_url
    _fail_cleanly(lambda: upgrade(url))
    typer.echo(f"database at {url} is up to date")


@cli.command()
def index(
    model: Annotated[
        str | None, typer.Option(help="smollm2-135m, a Hugging Face id, a local folder or a .gguf file.")
    ] = None,
    corpus: Annotated[
        str | None, typer.Option(help="wiki-vital, a .txt file or a .jsonl file with a 'text' field.")
    ] = None,
    sentences: Annotated[int | None, typer.Option(min=1, help="Number of corpus sentences to mine.")] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", min=1, max=1000, help="Trigger sentences kept per key and sign.")
    ] = None,
    db: DbOption = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
    dtype: Annotated[
        Dtype, typer.Option(help="auto: float32 on CPU, bfloat16 (or float16) on GPU.")
    ] = Dtype.auto,
) -> None:
    """Mine trigger prefixes of every FF key, project every value, and store the index."""
    settings = get_settings()
    url = db or settings.database_url

    def run():
        from app.db import make_engine, make_sessionmaker, upgrade
        from worker.index import IndexOptions, build_index

        upgrade(url)
        options = IndexOptions(
            model=model or settings.model,
            corpus=corpus or settings.corpus,
            sentences=sentences or settings.sentences,
            top_k=top_k or settings.top_k,
            device=device.value,
            dtype=dtype.value,
            max_sentence_tokens=settings.max_sentence_tokens,
            batch_tokens=settings.batch_tokens,
            shard_sentences=settings.shard_sentences,
            value_tokens=settings.value_tokens,
            cache_dir=Path(settings.cache_dir),
        )
        return build_index(options, make_sessionmaker(make_engine(url)))

    s = _fail_cleanly(run)
    resumed = f", resumed after {s.resumed_shards} shards" if s.resumed_shards else ""
    typer.echo(
        f"stored run {s.run_id}: {s.model} over {s.sentences:,} sentences of {s.corpus} "
        f"({s.tokens:,} tokens), {s.layers} layers × {s.keys:,} keys\n"
        f"  {s.triggers:,} triggers, {s.value_tokens:,} value tokens\n"
        f"  mining {s.mining_seconds:.1f} s ({s.tokens / max(s.mining_seconds, 1e-9):,.0f} tok/s, "
        f"padding efficiency {s.padding_efficiency:.1%}{resumed}), "
        f"projection {s.projection_seconds:.1f} s, storing {s.storing_seconds:.1f} s\n"
        f"  database: {url}"
    )


@cli.command()
def serve(
    db: DbOption = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
) -> None:
    """Serve the explorer (the web process reads the database only; no torch)."""
    import uvicorn

    from app.config import Settings
    from app.db import upgrade
    from app.main import create_app

    url = db or get_settings().database_url
    _fail_cleanly(lambda: upgrade(url))
    app = _fail_cleanly(lambda: create_app(Settings(database_url=url)))
    typer.echo(f"serving {url} on http://{host}:{port}")
    uvicorn.run(app, host=host, port=port, log_level="warning")


@cli.command()
def demo(
    db: DbOption = None,
    serve_after: Annotated[
        bool, typer.Option("--serve/--no-serve", help="Serve the explorer afterwards.")
    ] = True,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the explorer.")] = 8000,
) -> None:
    """Build the default index (SmolLM2-135M over 2,000 Wikipedia sentences) unless it exists; serve it."""
    settings = get_settings()
    url = db or settings.database_url

    def existing():
        from app import queries
        from app.db import make_engine, make_sessionmaker, upgrade

        upgrade(url)
        with make_sessionmaker(make_engine(url))() as session:
            return queries.find_finished_run(
                session=session, model_slug=settings.model, n_sentences=settings.sentences
            )

    run = _fail_cleanly(existing)
    if run is not None:
        typer.echo(f"the default index is already built (run {run.id}); database: {url}")
    else:
        index(
            model=None, corpus=None, sentences=None, top_k=None, db=url, device=Device.auto, dtype=Dtype.auto
        )
    if serve_after:
        serve(db=url, host="127.0.0.1", port=port)


def _fail_cleanly(action):
    """Run `action`; a known user error becomes one clear line and exit code 2, not a traceback."""
    try:
        return action()
    except FfmemError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def main() -> None:
    cli()
