"""`ffmem index`: build an index run (mine every key's triggers, project every value) in the foreground,
or queue it for `ffmem worker`."""

from __future__ import annotations

from typing import Annotated

import typer

from ffmem.cli.common import DbOption, Device, Dtype, fail_cleanly
from ffmem.config import get_settings


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
        job, what = fail_cleanly(enqueue)
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

    s = fail_cleanly(run)
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
