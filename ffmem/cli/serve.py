"""The long-running processes: `ffmem worker` (index jobs and live traces), `ffmem serve` (the explorer
and its local worker, started again whenever it exits) and `ffmem demo` (both over the default index)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from ffmem.cli.common import DbOption, Device, Dtype, fail_cleanly
from ffmem.cli.index import index
from ffmem.config import get_settings
from ffmem.engine.errors import FfmemError


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
        _stop_on_sigterm()  # like Ctrl-C: release the leases on the way out
        try:
            worker.work(once=once, poll_seconds=poll)
        finally:
            if server is not None:
                server.should_exit = True

    fail_cleanly(run)


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
        import subprocess

        self.stopping.set()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # it did not stop: its leases lapse, the next start resumes it
            self.process.kill()
            self.process.wait()


def _serve_live(settings, device: str, preload: str, host: str, port: int):
    """Start the live worker's HTTP server on a thread; None (with a warning) if it cannot listen."""
    import threading
    import time

    import uvicorn

    from ffmem.worker.live_app import create_live_app
    from ffmem.worker.live_executor import Live

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
    fail_cleanly(lambda: upgrade(url, Retry.from_settings(settings)))  # Postgres may still be starting
    live_url = worker_url or settings.worker_url
    update = {"database_url": url, "worker_url": live_url, "host": host}
    configured = settings.model_copy(update=update | ({} if read_only is None else {"read_only": read_only}))
    app = fail_cleanly(lambda: create_app(configured, local_worker=worker_url is None))
    worker_process = None
    if worker_url is None:
        import sys

        address = urlsplit(live_url)
        command = [sys.executable, "-c", "from ffmem.cli import main; main()", "worker", "--db", url]
        command += ["--host", address.hostname or "127.0.0.1", "--port", str(address.port or 8001)]
        worker_process = _LocalWorker(command)
    _stop_on_sigterm()  # uvicorn re-raises it after shutting down: stop the worker too
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


DEMO_ANALYSIS = {"examples": 500, "keys": 10, "triggers": 10}  # a few CPU minutes


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

    number, what = fail_cleanly(enqueue)
    if what == Enqueued.done:
        typer.echo(f"the default index is built (run {number}); database: {url}")
    else:
        typer.echo(f"building the default index in the background: http://127.0.0.1:{port}/jobs/{number}")
    serve(db=url, host="127.0.0.1", port=port, worker_url=None)


def _stop_on_sigterm() -> None:
    """SIGTERM stops this process as Ctrl-C does (`_stop`), even where it lands in a weakref callback or a
    `__del__`, whose exceptions Python ignores (`_stop_lost`)."""
    import sys

    signal.signal(signal.SIGTERM, _stop)
    sys.unraisablehook = _stop_lost


def _stop_lost(unraisable) -> None:
    """sys.unraisablehook: `_stop`'s SystemExit raised inside a weakref callback or a `__del__` (ignored
    there: the process would run on) is raised again: the signal is sent anew from a thread, so that `_stop`
    runs in the main thread once it is out of the callback; anything else as Python reports it."""
    import sys
    import threading

    stopped = unraisable.exc_value
    if isinstance(stopped, SystemExit) and stopped.code == 128 + signal.SIGTERM:
        threading.Timer(0.01, signal.raise_signal, (signal.SIGTERM,)).start()
        return
    sys.__unraisablehook__(unraisable)


def _stop(signum, frame) -> None:
    """SIGTERM as Ctrl-C: unwind (the worker's leases are released on the way out) and exit 128 + signum.

    The unwinding may cut a database read short; SQLAlchemy then logs, with a traceback, that it
    could not close the interrupted cursor. That is this stop, not an error: quieten its loggers.
    """
    import logging

    logging.getLogger("sqlalchemy").setLevel(logging.CRITICAL)
    raise SystemExit(128 + signum)
