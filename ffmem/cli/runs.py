"""What `ffmem` does with a stored index run: `analyze` (the paper's analyses), `compose` (the weight graph
and explanations); moving a run between databases is ffmem.cli.transfer."""

from __future__ import annotations

from typing import Annotated

import typer

from ffmem.cli.common import DbOption, Device, fail_cleanly
from ffmem.config import get_settings
from ffmem.engine.errors import FfmemError


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

    sessions, job_id, what, run_id, slug = fail_cleanly(enqueue)
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

    seconds = fail_cleanly(work)
    spent = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
    typer.echo(f"stored the analyses of run {run_id} ({spent}); see /m/{slug}/analysis")


def compose(
    run: Annotated[
        int | None, typer.Option(min=1, help="Index run (default: the newest finished one).")
    ] = None,
    explain_sentences: Annotated[
        int | None,
        typer.Option(min=0, help="Held-out sentences scoring the explanations. Default: settings."),
    ] = None,
    db: DbOption = None,
    device: Annotated[Device, typer.Option(help="auto picks CUDA when there is one.")] = Device.auto,
    queue: Annotated[
        bool, typer.Option("--queue", help="Only queue the job; `ffmem worker` computes it.")
    ] = False,
) -> None:
    """Compute an index run's weight graph (which memories feed which) and its memories' explanations.

    A run computes both when it is stored; this computes them again (for runs stored before, or with
    other options) as a composition job: in the foreground here, or with --queue for `ffmem worker`.
    """
    settings = get_settings()
    url = db or settings.database_url

    def enqueue():
        from ffmem.store import jobs
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.models import RunStatus
        from ffmem.store.specs import CompositionSpec

        upgrade(url)
        sessions = make_sessionmaker(make_engine(url))
        with sessions() as session:
            found = _run_or_newest(session, run)
            if found is None or found.status != RunStatus.done:
                raise FfmemError(f"no finished index run {run or ''} in {url}; build one with `ffmem index`")
            spec = CompositionSpec.from_settings(settings, explain_sentences=explain_sentences)
            job, _ = jobs.enqueue(session=session, spec=spec, run_id=found.id, again=True)
            session.commit()
            return sessions, job.id, found.id, found.model.slug

    sessions, job_id, run_id, slug = fail_cleanly(enqueue)
    if queue:
        typer.echo(f"job {job_id}: run {run_id}'s composition queued; `ffmem worker --db {url}` computes it")
        return

    def work():
        from ffmem.store import analyses
        from ffmem.worker.index import IndexOptions
        from ffmem.worker.loop import Worker

        Worker(sessions, IndexOptions.from_settings(settings, device=device.value)).work(job_id=job_id)
        with sessions() as session:
            stored = analyses.stored_analyses(session=session, run_id=run_id)
            return {name: stored[name].seconds for name in ("weight_graph", "explanations")}

    seconds = fail_cleanly(work)
    spent = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
    typer.echo(f"stored the weight graph and explanations of run {run_id} ({spent}); see /m/{slug}")


def _run_or_newest(session, run_id: int | None):
    """Index run `run_id`, or the newest finished one (of any model) when it is None; or None."""
    from ffmem.store import runs

    if run_id:
        return runs.get_run(session=session, run_id=run_id)
    return runs.latest_finished_run(session=session)
