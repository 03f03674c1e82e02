"""`ffmem`: the command line. Heavy imports (torch) happen inside the commands that need them."""

from __future__ import annotations

import signal
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


def _index_options(settings, device: str | None = None, **given):
    """A worker's IndexOptions: the run's options (given, else the settings) and the worker's own."""
    from app.jobs import run_options
    from worker.index import IndexOptions

    return IndexOptions(
        **run_options(settings, **given),
        device=device or settings.device,
        cache_dir=Path(settings.cache_dir),
        checkpoint_batches=settings.checkpoint_batches,
        lease_seconds=settings.lease_seconds,
    )


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
    queue: Annotated[
        bool, typer.Option("--queue", help="Only queue the run; `ffmem worker` builds it.")
    ] = False,
    again: Annotated[
        bool, typer.Option("--again", help="Build a new run even if this one is built.")
    ] = False,
) -> None:
    """Mine trigger prefixes of every FF key, project every value, and store the index.

    Runs in the foreground as a worker for its own run (other workers may help); running the same
    command again after a crash resumes that run from its checkpoints.
    """
    settings = get_settings()
    url = db or settings.database_url
    options = _index_options(
        settings,
        model=model,
        corpus=corpus,
        sentences=sentences,
        top_k=top_k,
        device=device.value,
        dtype=dtype.value,
    )

    def enqueue():
        from app import jobs
        from app.db import make_engine, make_sessionmaker, upgrade

        upgrade(url)
        with make_sessionmaker(make_engine(url))() as session:
            job, what = jobs.enqueue(session=session, options=options.run_options(), again=again)
            session.commit()
            return job, what

    if queue:
        job, what = _fail_cleanly(enqueue)
        said = {"created": "queued", "resumed": "already queued or running", "done": "already built"}[what]
        typer.echo(f"job {job.id}: {said} (run {job.run_id or '—'}); `ffmem worker --db {url}` builds it")
        return

    def run():
        from app.db import make_engine, make_sessionmaker, upgrade
        from worker.index import build_index

        upgrade(url)
        return build_index(options, make_sessionmaker(make_engine(url)), again=again)

    s = _fail_cleanly(run)
    if s.already_built:
        typer.echo(
            f"run {s.run_id} already indexes {s.model} over these {s.sentences:,} sentences of {s.corpus}: "
            f"reusing it (pass --again to build a new run)\n  database: {url}"
        )
        return
    resumed = f", resumed {s.resumed_shards} shard(s) from checkpoints" if s.resumed_shards else ""
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
def worker(
    db: DbOption = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
    once: Annotated[bool, typer.Option("--once", help="Exit when there is no work left.")] = False,
    poll: Annotated[float, typer.Option(min=0.1, help="Seconds between looks at an empty queue.")] = 2.0,
) -> None:
    """Claim queued index jobs and open shards from the database and build them (Ctrl-C stops)."""
    settings = get_settings()
    url = db or settings.database_url

    def run():
        from app import jobs
        from app.db import make_engine, make_sessionmaker, upgrade
        from worker.index import Worker

        upgrade(url)
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        worker = Worker(sessions, _index_options(settings, device=device.value))
        if engine.dialect.name == "sqlite":
            with sessions() as session:
                holder = jobs.other_live_worker(session=session, worker=worker.name)
            if holder is not None:
                raise FfmemError(
                    f"SQLite runs one worker at a time and {holder} is working on {url}; "
                    "use Postgres (--db postgresql+psycopg://…) for several workers"
                )
        typer.echo(
            f"worker {worker.name} on {url}"
            + (" (one worker: SQLite)" if engine.dialect.name == "sqlite" else "")
        )
        signal.signal(signal.SIGTERM, _stop)  # like Ctrl-C: release the leases on the way out
        worker.work(once=once, poll_seconds=poll)

    _fail_cleanly(run)


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
        bool,
        typer.Option(
            "--serve/--no-serve", help="Serve the explorer (building in the background) or only build."
        ),
    ] = True,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the explorer.")] = 8000,
) -> None:
    """The default index (SmolLM2-135M over 2,000 Wikipedia sentences) and the explorer over it.

    With --serve (the default) the explorer starts at once and a background worker builds the index
    unless it is built; its progress is on the job's page. With --no-serve the index is built in the
    foreground and the command ends.
    """
    settings = get_settings()
    url = db or settings.database_url
    if not serve_after:
        index(
            model=None, corpus=None, sentences=None, top_k=None, db=url, device=Device.auto, dtype=Dtype.auto
        )
        return

    def enqueue():
        from app import jobs, queries
        from app.db import make_engine, make_sessionmaker, upgrade

        upgrade(url)
        with make_sessionmaker(make_engine(url))() as session:
            built = queries.find_finished_run(
                session=session, model_slug=settings.model, n_sentences=settings.sentences
            )
            if built is not None:
                return built.id, "done"
            job, what = jobs.enqueue(session=session, options=jobs.run_options(settings))
            session.commit()
            return job.id, what

    number, what = _fail_cleanly(enqueue)
    signal.signal(signal.SIGTERM, _stop)  # uvicorn re-raises it after shutting down: stop the worker too
    worker_process = None
    if what == "done":
        typer.echo(f"the default index is built (run {number}); database: {url}")
    else:
        import subprocess
        import sys

        command = [sys.executable, "-c", "from app.cli import main; main()", "worker", "--db", url]
        worker_process = subprocess.Popen(command)
        typer.echo(f"building the default index in the background: http://127.0.0.1:{port}/jobs/{number}")
    try:
        serve(db=url, host="127.0.0.1", port=port)
    finally:
        if worker_process is not None:
            worker_process.terminate()  # its lease is released; the next `make demo` resumes the run
            worker_process.wait(timeout=30)


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _fail_cleanly(action):
    """Run `action`; a known user error becomes one clear line and exit code 2, not a traceback."""
    try:
        return action()
    except FfmemError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def main() -> None:
    cli()
