"""`ffmem`: the command line. Heavy imports (torch) happen inside the commands that need them."""

from __future__ import annotations

import signal
from enum import Enum
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from ffmem.config import get_settings
from ffmem.engine.errors import FfmemError

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


class Readout(str, Enum):
    norm = "norm"
    raw = "raw"


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DbOption = Annotated[str | None, typer.Option("--db", help="Database URL (default: settings.database_url).")]


@db_cli.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Create or migrate the database schema to the latest version (Alembic)."""
    from ffmem.store.db import upgrade

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
    first_position: Annotated[
        bool | None,
        typer.Option(
            "--first-position/--no-first-position",
            help="Also mine each sentence's first token (position 0, where the attention sink gives huge "
            "coefficients) when the tokenizer puts no BOS before it. Default: the `first_position` setting.",
        ),
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
    analyze: Annotated[
        bool | None,
        typer.Option(
            "--analyze/--no-analyze",
            help="Then compute the paper's analyses of the run (`ffmem analyze`'s defaults). "
            "Default: the `analyze` setting.",
        ),
    ] = None,
) -> None:
    """Mine trigger prefixes of every FF key, project every value, and store the index.

    Runs in the foreground as a worker for its own run (other workers may help); running the same
    command again after a crash resumes that run from its checkpoints.
    """
    settings = get_settings()
    url = db or settings.database_url
    from ffmem.worker.index import IndexOptions

    options = IndexOptions.from_settings(
        settings,
        model=model,
        corpus=corpus,
        sentences=sentences,
        top_k=top_k,
        first_position=first_position,
        device=device.value,
        dtype=dtype.value,
    )

    from ffmem.store.specs import AnalysisSpec

    analysis = (
        AnalysisSpec.from_settings(settings) if (settings.analyze if analyze is None else analyze) else None
    )

    def enqueue():
        from ffmem.store import jobs
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade

        upgrade(url)
        with make_sessionmaker(make_engine(url))() as session:
            job, what, _ = jobs.enqueue_run(
                session=session, spec=options.spec, again=again, analysis=analysis
            )
            session.commit()
            return job, what

    if queue:
        job, what = _fail_cleanly(enqueue)
        from ffmem.store.jobs import Enqueued

        said = {
            Enqueued.created: "queued",
            Enqueued.resumed: "already queued or running",
            Enqueued.done: "already built",
        }[what]
        typer.echo(f"job {job.id}: {said} (run {job.run_id or '—'}); `ffmem worker --db {url}` builds it")
        return

    def run():
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.worker.loop import build_index

        upgrade(url)
        return build_index(options, make_sessionmaker(make_engine(url)), again=again, analysis=analysis)

    s = _fail_cleanly(run)
    if analysis is not None:
        typer.echo(f"stored the analyses of run {s.run_id}: /m/{s.model}/analysis")
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
    live: Annotated[
        bool | None,
        typer.Option(
            "--live/--no-live",
            help="Answer live traces over HTTP beside the index work (default: unless --once).",
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Live traces: interface (default: from worker_url).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Live traces: port (default: from worker_url).")
    ] = None,
    preload: Annotated[
        str | None,
        typer.Option(help="Model loaded for live traces at start (default: settings.model; '' for none)."),
    ] = None,
) -> None:
    """Claim queued index jobs and open shards and build them; answer live traces (Ctrl-C stops)."""
    settings = get_settings()
    url = db or settings.database_url

    def run():
        from ffmem.engine.allocator import keep_freed_memory
        from ffmem.store import jobs
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.worker.index import IndexOptions
        from ffmem.worker.loop import Worker

        keep_freed_memory()  # a long-running process: reuse freed memory instead of faulting it back in
        upgrade(url)
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        worker = Worker(sessions, IndexOptions.from_settings(settings, device=device.value))
        if engine.dialect.name == "sqlite":
            worker.start()  # a dead worker's leases end first: only a live worker refuses this one
            with sessions() as session:
                holder = jobs.other_live_worker(session=session, worker=worker.name)
            if holder is not None:
                worker.stop()
                raise FfmemError(
                    f"SQLite runs one worker at a time and {holder} is working on {url}; "
                    "use Postgres (--db postgresql+psycopg://…) for several workers"
                )
        server = None
        if live if live is not None else not once:
            address = urlsplit(settings.worker_url)
            where = (host or address.hostname or "127.0.0.1", port or address.port or 8001)
            model = settings.model if preload is None else preload
            server = _serve_live(settings, device.value, model, *where)
        typer.echo(
            f"worker {worker.name} on {url}"
            + (" (one worker: SQLite)" if engine.dialect.name == "sqlite" else "")
            + (f"; live traces on http://{server.config.host}:{server.config.port}" if server else "")
        )
        signal.signal(signal.SIGTERM, _stop)  # like Ctrl-C: release the leases on the way out
        try:
            worker.work(once=once, poll_seconds=poll)
        finally:
            if server is not None:
                server.should_exit = True

    _fail_cleanly(run)


class _LocalWorker:
    """`ffmem serve`'s own worker process, started again (after `pause` seconds) whenever it exits:
    whatever happens to it, the explorer's live view comes back without a restart."""

    def __init__(self, command: list[str], pause: float = 5.0) -> None:
        import subprocess
        import threading

        self.command, self.pause, self.stopping = command, pause, threading.Event()
        self.process = subprocess.Popen(command)
        threading.Thread(target=self._watch, name="local worker", daemon=True).start()

    def _watch(self) -> None:
        import subprocess

        while not self.stopping.is_set():
            code = self.process.wait()
            if self.stopping.wait(self.pause):
                return
            typer.secho(
                f"the local worker exited ({code}); starting it again", fg=typer.colors.YELLOW, err=True
            )
            self.process = subprocess.Popen(self.command)

    def stop(self) -> None:
        self.stopping.set()
        self.process.terminate()
        self.process.wait(timeout=30)


def _serve_live(settings, device: str, preload: str, host: str, port: int):
    """Start the live worker's HTTP server on a thread; None (with a warning) if it cannot listen."""
    import threading
    import time

    import uvicorn

    from ffmem.worker.live_server import Live, create_live_app

    live = Live(
        device=device,
        cache_dir=Path(settings.cache_dir),
        max_tokens=settings.max_prompt_tokens,
        queue=settings.trace_queue,
        models=settings.live_models,
    )
    if preload:
        live.preload(preload)
    server = uvicorn.Server(uvicorn.Config(create_live_app(live), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="ffmem-live-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        typer.secho(f"warning: cannot listen on {host}:{port} (in use?); live traces are off", err=True)
        return None
    return server


@cli.command()
def serve(
    db: DbOption = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    worker_url: Annotated[
        str | None,
        typer.Option(help="A running live worker (e.g. http://gpu-box:8001); without it one starts here."),
    ] = None,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            help="Reverse proxies whose X-Forwarded-For gives the client's address (comma-separated "
            "addresses or networks, '*' any, '' none; default FFMEM_FORWARDED_ALLOW_IPS, 127.0.0.1)."
        ),
    ] = None,
    read_only: Annotated[
        bool | None,
        typer.Option(
            "--read-only/--writable",
            help="Refuse every write and hide the write controls (default: the read_only setting).",
        ),
    ] = None,
) -> None:
    """Serve the explorer (the web process reads the database only; no torch) and start a local worker
    for live traces and index jobs unless --worker-url names one."""
    import uvicorn

    from ffmem.store.db import Retry, upgrade
    from ffmem.web.access import LOOPBACK
    from ffmem.web.main import create_app

    settings = get_settings()
    url = db or settings.database_url
    _fail_cleanly(lambda: upgrade(url, Retry.from_settings(settings)))  # Postgres may still be starting
    live_url = worker_url or settings.worker_url
    update = {"database_url": url, "worker_url": live_url, "host": host}
    configured = settings.model_copy(update=update | ({} if read_only is None else {"read_only": read_only}))
    app = _fail_cleanly(lambda: create_app(configured))
    worker_process = None
    if worker_url is None:
        import sys

        address = urlsplit(live_url)
        command = [sys.executable, "-c", "from ffmem.cli import main; main()", "worker", "--db", url]
        command += ["--host", address.hostname or "127.0.0.1", "--port", str(address.port or 8001)]
        worker_process = _LocalWorker(command)
    signal.signal(signal.SIGTERM, _stop)  # uvicorn re-raises it after shutting down: stop the worker too
    typer.echo(f"serving {url} on http://{host}:{port}; live worker {live_url}")
    if configured.read_only:
        typer.echo("read-only: every write is refused and no write control is shown")
    elif configured.admin_token is None and host not in LOOPBACK:
        typer.secho(
            f"no admin token: writes are refused on {host} (set FFMEM_ADMIN_TOKEN to allow them)", err=True
        )
    try:
        proxies = settings.forwarded_allow_ips if forwarded_allow_ips is None else forwarded_allow_ips
        # The live routes' rate limit counts by the client's address: trust only these to forward it.
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="warning",
            proxy_headers=bool(proxies.strip()),
            forwarded_allow_ips=proxies.strip() or None,
        )
    finally:
        if worker_process is not None:
            worker_process.stop()  # its leases are released; the next start resumes its work


@cli.command()
def analyze(
    run: Annotated[
        int | None, typer.Option(min=1, help="Index run (default: the newest finished one).")
    ] = None,
    examples: Annotated[
        int | None, typer.Option(min=1, help="Held-out prefixes (Figs. 7–11). Default: settings.")
    ] = None,
    keys: Annotated[int | None, typer.Option(min=1, help="Keys sampled per layer (Fig. 3).")] = None,
    triggers: Annotated[
        int | None, typer.Option(min=1, max=1000, help="Top trigger prefixes per sampled key (Fig. 3).")
    ] = None,
    db: DbOption = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
    queue: Annotated[
        bool, typer.Option("--queue", help="Only queue the job; `ffmem worker` computes it.")
    ] = False,
    again: Annotated[
        bool, typer.Option("--again", help="Compute again even if these analyses are stored.")
    ] = False,
) -> None:
    """Compute the paper's analyses of an index run and store them (the /m/MODEL/analysis page).

    An analysis job, like an index run: in the foreground here, or with --queue for `ffmem worker`.
    """
    settings = get_settings()
    url = db or settings.database_url
    given = dict(examples=examples, keys=keys, triggers=triggers)

    def enqueue():
        from ffmem.store import jobs
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.models import RunStatus
        from ffmem.store.specs import AnalysisSpec

        upgrade(url)
        sessions = make_sessionmaker(make_engine(url))
        with sessions() as session:
            found = _run_or_newest(session, run)
            if found is None or found.status == RunStatus.failed:
                raise FfmemError(
                    f"no index run {run or ''} to analyze in {url}; build one with `ffmem index`"
                )
            spec = AnalysisSpec.from_settings(settings, **given)
            job, what = jobs.enqueue_analysis(session=session, spec=spec, run_id=found.id, again=again)
            session.commit()
            return sessions, job.id, what, found.id, found.model.slug

    from ffmem.store.jobs import Enqueued

    sessions, job_id, what, run_id, slug = _fail_cleanly(enqueue)
    if what == Enqueued.done:
        typer.echo(
            f"run {run_id} is analyzed with these options (job {job_id}): /m/{slug}/analysis; --again redoes"
        )
        return
    if queue:
        typer.echo(f"job {job_id}: analyses of run {run_id} queued; `ffmem worker --db {url}` computes them")
        return

    def work():
        from ffmem.store import analyses
        from ffmem.worker.index import IndexOptions
        from ffmem.worker.loop import Worker

        Worker(sessions, IndexOptions.from_settings(settings, device=device.value)).work(job_id=job_id)
        with sessions() as session:
            stored = analyses.stored_analyses(session=session, run_id=run_id)
            return {name: analysis.seconds for name, analysis in stored.items()}

    seconds = _fail_cleanly(work)
    spent = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
    typer.echo(f"stored the analyses of run {run_id} ({spent}); see /m/{slug}/analysis")


@cli.command()
def compose(
    run: Annotated[
        int | None, typer.Option(min=1, help="Index run (default: the newest finished one).")
    ] = None,
    db: DbOption = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
) -> None:
    """Compute an index run's weight graph (which memories feed which) and its memories' explanations.

    A run computes both when it is stored; this fills them in for runs stored before, or again.
    """
    settings = get_settings()
    url = db or settings.database_url

    def work():
        from ffmem.engine.loading import load_model
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.models import RunStatus
        from ffmem.worker.composition import compose as compose_run

        upgrade(url)
        sessions = make_sessionmaker(make_engine(url))
        with sessions() as session:
            found = _run_or_newest(session, run)
            if found is None or found.status != RunStatus.done:
                raise FfmemError(f"no finished index run {run or ''} in {url}; build one with `ffmem index`")
            run_id, slug, source, dtype = found.id, found.model.slug, found.model.source, found.dtype
        loaded = load_model(source, device=device.value, dtype=dtype, cache_dir=settings.cache_dir)
        return run_id, slug, compose_run(sessions, run_id, loaded, progress=True)

    run_id, slug, seconds = _fail_cleanly(work)
    spent = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
    typer.echo(f"stored the weight graph and explanations of run {run_id} ({spent}); see /m/{slug}")


@cli.command()
def export(
    run: Annotated[int, typer.Argument(min=1, help="The index run to export.")],
    format: Annotated[str, typer.Option("--format", help="jsonl or parquet (needs pyarrow).")] = "jsonl",
    out: Annotated[Path | None, typer.Option(help="Folder to write (default: export-run-RUN).")] = None,
    db: DbOption = None,
) -> None:
    """Write a run's triggers, values, statistics, analyses and labels as JSON Lines or Parquet files."""
    url = db or get_settings().database_url
    folder = out or Path(f"export-run-{run}")

    def work():
        from ffmem.store.db import make_engine, make_sessionmaker
        from ffmem.store.export import export_run

        with make_sessionmaker(make_engine(url))() as session:
            return export_run(session=session, run_id=run, folder=folder, fmt=format)

    written = _fail_cleanly(work)
    rows = ", ".join(f"{name} {count:,}" for name, count in written.items())
    typer.echo(f"wrote run {run} to {folder}/ ({format}): {rows}")


@cli.command("trace")
def trace_command(
    text: Annotated[str, typer.Argument(help="The prompt.")],
    model: Annotated[str | None, typer.Option(help="Model (default: settings.model).")] = None,
    position: Annotated[int | None, typer.Option(min=0, help="Token position (default: the last).")] = None,
    memories: Annotated[int, typer.Option(min=1, max=100, help="Memories listed per layer.")] = 3,
    readout: Annotated[
        Readout, typer.Option(help="norm: the model's final norm + unembedding; raw: r·E.")
    ] = (Readout.norm),
    intervene: Annotated[
        str, typer.Option(help="Memories to edit: L12K345 (off), L12K345*0.5 (scale), L12K345=3.2 (on).")
    ] = "",
    generate: Annotated[int, typer.Option(min=0, max=20, help="Greedy tokens, with and without edits.")] = 0,
    target: Annotated[
        str | None,
        typer.Option(help="Who pushes this token (' London' or #5188; default: the prediction)."),
    ] = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
) -> None:
    """Trace a prompt: per layer top(r), top(y), top(o), the final token under r, the case, the memories;
    then who pushes the target token: per layer the memories' contributions m_i·(v_i·e_t) and their sum
    beside the FF's change to its logit."""
    from ffmem.cli_trace import print_trace

    settings = get_settings()

    def run():
        from ffmem.engine.attribution_terms import target_tokens
        from ffmem.engine.interventions import parse_interventions
        from ffmem.engine.loading import load_model
        from ffmem.engine.trace import trace

        loaded = load_model(model or settings.model, device=device.value, cache_dir=settings.cache_dir)
        ids = loaded.tokenizer(text).input_ids
        if not text.strip() or not ids:
            raise FfmemError("the prompt is empty")
        if len(ids) > settings.max_prompt_tokens:
            raise FfmemError(f"the prompt has {len(ids)} tokens; the limit is {settings.max_prompt_tokens}")
        if position is not None and position >= len(ids):
            raise FfmemError(f"position {position} is past the prompt's {len(ids)} tokens (0–{len(ids) - 1})")
        edits = parse_interventions(intervene, loaded.n_layers, loaded.n_keys)
        typed = target_tokens(loaded.tokenizer, loaded.model.config.vocab_size, target)
        result = trace(
            loaded,
            ids,
            position,
            memories=memories,
            readout=readout.value,
            interventions=edits,
            generate_tokens=generate,
            value_tokens=3,
            target=typed[0] if typed else None,
        )
        return loaded, result

    loaded, result = _fail_cleanly(run)
    print_trace(result, loaded.tokenizer)


DEMO_ANALYSIS = {"examples": 500, "keys": 10, "triggers": 10}  # a few CPU minutes


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
    """The default index (SmolLM2-135M over the bundled Wikipedia sentences) and the explorer over it.

    With --serve (the default) the explorer starts at once with its worker, which builds the index
    unless it is built (its progress is on the job's page), then the paper's analyses at a demo's
    size (500 held-out examples; 10 keys × 10 triggers a layer for Fig. 3; `ffmem analyze` for the
    full size), and answers live traces. With --no-serve the index is built in the foreground and the
    command ends.
    """
    settings = get_settings()
    url = db or settings.database_url
    if not serve_after:
        index(
            model=None, corpus=None, sentences=None, top_k=None, db=url, device=Device.auto, dtype=Dtype.auto
        )
        return

    def enqueue():
        from ffmem.store import jobs
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.specs import AnalysisSpec, RunSpec

        upgrade(url)
        with make_sessionmaker(make_engine(url))() as session:
            analysis = AnalysisSpec.from_settings(settings, **DEMO_ANALYSIS)
            job, what, _ = jobs.enqueue_run(  # built before: analyzed unless that was done too
                session=session, spec=RunSpec.from_settings(settings), analysis=analysis, keep_analyses=True
            )
            session.commit()
            return (job.run_id if what == jobs.Enqueued.done else job.id), what

    from ffmem.store.jobs import Enqueued

    number, what = _fail_cleanly(enqueue)
    if what == Enqueued.done:
        typer.echo(f"the default index is built (run {number}); database: {url}")
    else:
        typer.echo(f"building the default index in the background: http://127.0.0.1:{port}/jobs/{number}")
    serve(db=url, host="127.0.0.1", port=port, worker_url=None)


def _stop(signum, frame) -> None:
    """SIGTERM as Ctrl-C: unwind (the worker's leases are released on the way out) and exit 128 + signum.

    The unwinding may cut a database read short; SQLAlchemy then logs, with a traceback, that it
    could not close the interrupted cursor. That is this stop, not an error: quieten its loggers.
    """
    import logging

    logging.getLogger("sqlalchemy").setLevel(logging.CRITICAL)
    raise SystemExit(128 + signum)


def _run_or_newest(session, run_id: int | None):
    """Index run `run_id`, or the newest finished one (of any model) when it is None; or None."""
    from ffmem.store import runs

    if run_id:
        return runs.get_run(session=session, run_id=run_id)
    return runs.latest_finished_run(session=session)


def _fail_cleanly(action):
    """Run `action`; a known user error becomes one clear line and exit code 2, not a traceback."""
    try:
        return action()
    except FfmemError as error:
        typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def main() -> None:
    cli()
