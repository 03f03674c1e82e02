"""An index run as a job: load → corpus → mine (by shards, checkpointed in the database) → project → store.

`build_index` is `ffmem index` in the foreground: it queues the job (or finds the unfinished one with
the same options, and resumes it) and works on it until it is done. `Worker` is what `ffmem worker`
runs: it claims queued jobs, prepares their runs, mines any run's open shards and finishes runs whose
shards are all done. Several workers on one Postgres share the shards (ffmem.store.jobs); each shard's running
top-T is checkpointed in its row every `checkpoint_batches` batches, so a killed worker loses at most
that much, and the shards merge exactly into the single-worker result.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import transformers
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from ffmem.config import Settings
from ffmem.engine.comparison import memory_weights
from ffmem.engine.corpus import held_out_sentences, mined_from, mined_sentences, read_corpus, tokenize
from ffmem.engine.errors import FfmemError
from ffmem.engine.loading import LoadedModel, shared_model
from ffmem.engine.mined_layer import MinedLayer, histogram_edges
from ffmem.engine.mining import MiningState, mine_batches, shard_batches
from ffmem.engine.neighbours import memory_baselines, memory_neighbours
from ffmem.engine.projection import project_layer, search_arrays, target_ranks
from ffmem.engine.sentence_coefficients import sentence_coefficients
from ffmem.store import jobs, key_examples, memory_search, queries
from ffmem.store.jobs import Enqueued, JobKind, JobStatus, ShardStatus, StageProgress
from ffmem.store.memory_lists import READOUTS, TRIGGERS
from ffmem.store.models import Job, KeyExamples, KeyStats, MemoryList, Run, Shard
from ffmem.worker.analysis_jobs import AnalysisOptions, analyze
from ffmem.worker.comparison import compare_runs
from ffmem.worker.composition import compose
from ffmem.worker.leases import Heartbeat, Presence

log = logging.getLogger(__name__)


def _setting(name: str):
    """The default of a setting: IndexOptions' defaults come from Settings, written once there."""
    default = Settings.model_fields[name].default
    return Path(default) if name == "cache_dir" else default


FIRST_CHECKPOINT = 2  # batches: a shard's first checkpoint, before every `checkpoint_batches`
# Run options older jobs lack: what they did (mined position 0, shaded nothing).
BEFORE_OPTIONS = {"first_position": True, "shaded_triggers": 0, "held_out_every": 0}


@dataclass
class IndexOptions:
    """What a worker needs for an index run: the run's options (jobs.RUN_FIELDS) and its own."""

    model: str = _setting("model")
    corpus: str = _setting("corpus")
    sentences: int | None = _setting("sentences")
    held_out_every: int = _setting("held_out_every")
    top_k: int = _setting("top_k")
    shaded_triggers: int = _setting("shaded_triggers")
    device: str = _setting("device")
    dtype: str = _setting("dtype")
    max_sentence_tokens: int = _setting("max_sentence_tokens")
    first_position: bool = _setting("first_position")
    batch_tokens: int = _setting("batch_tokens")
    shard_sentences: int = _setting("shard_sentences")
    value_tokens: int = _setting("value_tokens")
    cache_dir: Path = _setting("cache_dir")
    progress: bool = True
    checkpoint_batches: int = _setting("checkpoint_batches")
    lease_seconds: float = _setting("lease_seconds")
    max_attempts: int = _setting("max_attempts")

    @classmethod
    def from_settings(cls, settings: Settings, device: str | None = None, **given) -> IndexOptions:
        """A worker's options: the run's options (given, else the settings) and the worker's own."""
        return cls(
            **jobs.run_options(settings, **given),
            device=device or settings.device,
            cache_dir=Path(settings.cache_dir),
            checkpoint_batches=settings.checkpoint_batches,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
        )

    def run_options(self) -> dict:
        """What the job stores: the fields that define the run."""
        return {name: getattr(self, name) for name in jobs.RUN_FIELDS}

    def with_run_options(self, options: dict) -> IndexOptions:
        """These worker settings, with a job's run options (a job queued before an option existed
        gets what was done then)."""
        options = BEFORE_OPTIONS | options
        return IndexOptions(**(asdict(self) | {name: options[name] for name in jobs.RUN_FIELDS}))


@dataclass
class IndexSummary:
    run_id: int
    model: str
    corpus: str
    sentences: int
    tokens: int
    layers: int
    keys: int
    triggers: int
    value_tokens: int
    padding_efficiency: float
    resumed_shards: int
    mining_seconds: float
    projection_seconds: float
    storing_seconds: float
    shading_seconds: float = 0.0  # the second pass (Worker.shade)
    already_built: bool = False


class LostLease(FfmemError):
    """Another worker took over this shard or job (our lease ran out)."""


def build_index(
    options: IndexOptions,
    sessions: sessionmaker,
    loaded: LoadedModel | None = None,
    again: bool = False,
    analysis: dict | None = None,
) -> IndexSummary:
    """Build (or resume) the index run for `options` in the foreground; returns what was stored.
    With `analysis` (an analysis job's options), then compute the paper's analyses of the run.

    When the same run is already built, returns it with `already_built` (unless `again`).
    """
    with sessions() as session:
        job, what = jobs.enqueue(session=session, options=options.run_options(), again=again)
        if analysis is not None:
            analysis_job, _ = jobs.enqueue_analysis(session=session, options=analysis, after=job.id)
        session.commit()
        job_id = job.id
    worker = Worker(sessions, options, loaded=loaded)
    if what != Enqueued.done:
        worker.work(job_id=job_id)
    if analysis is not None:
        worker.work(job_id=analysis_job.id)
    return worker.summary(job_id, already_built=what == Enqueued.done)


@dataclass
class Worker:
    """Claims and does index and analysis work until its job is done (`work(job_id)`) or, for
    `ffmem worker`, forever."""

    sessions: sessionmaker
    options: IndexOptions  # worker settings (device, cache, progress, lease); run options come from jobs
    loaded: LoadedModel | None = None
    name: str = field(default_factory=jobs.worker_id)  # random per process: see ffmem.worker.leases
    presence: Presence = field(default_factory=Presence)
    timings: dict = field(default_factory=lambda: {"mining": 0.0, "projection": 0.0, "storing": 0.0})
    padding: list = field(default_factory=lambda: [0, 0])  # real, computed tokens
    resumed_shards: int = 0
    _corpus: tuple | None = None  # (corpus id, token ids, first positions, following tokens)
    _loaded_for: tuple | None = None  # (model, dtype) of `loaded`; None: as given

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=self.options.lease_seconds)

    # -- the loop ---------------------------------------------------------------------------------
    def work(self, job_id: int | None = None, poll_seconds: float = 1.0, once: bool = False) -> None:
        """Do work until job `job_id` is done or failed (or, without one and with `once`, until no job
        is queued or running)."""
        self.start()
        try:
            self._work(job_id, poll_seconds, once)
        finally:
            self.stop()

    def start(self) -> None:
        """Announce this worker (its presence file) and end the leases of workers known to be dead."""
        self.presence.announce(self.name)
        with self.sessions() as session:
            for holder in jobs.lease_holders(session=session):
                if holder != self.name and self.presence.is_dead(holder):
                    jobs.end_leases(session=session, worker=holder)
            session.commit()
        self.presence.sweep()  # the files of workers that died holding nothing

    def stop(self) -> None:
        """Give back what this worker holds (uncounted: it did not die) and withdraw its presence."""
        with self.sessions() as session:
            jobs.release_leases(session=session, worker=self.name)
            session.commit()
        self.presence.withdraw(self.name)

    def _work(self, job_id: int | None, poll_seconds: float, once: bool) -> None:
        while True:
            if job_id is not None:
                with self.sessions() as session:
                    job = session.get(Job, job_id)
                    if job.status == JobStatus.done:
                        return
                    if job.status == JobStatus.failed:
                        raise FfmemError(
                            f"{job.kind} job {job_id} failed: {job.error['type']}: {job.error['message']}"
                        )
            try:
                stepped = self.step(job_id)
            except Exception as error:
                if job_id is not None:
                    raise
                # Not a job's failure (those fail their job in `_guarded`): the queue itself, e.g. a
                # database that does not answer. A worker for all jobs waits and tries again.
                log.error("the worker's step failed: %s: %s; trying again", type(error).__name__, error)
                stepped = False
            if not stepped:
                if once and job_id is None and not self._jobs_in_progress():
                    return
                time.sleep(poll_seconds)

    def _jobs_in_progress(self) -> bool:
        """Whether any job is queued or running (maybe held by another worker: it may open shards)."""
        with self.sessions() as session:
            return (
                session.scalars(select(Job.id).where(Job.status.in_(jobs.ACTIVE)).limit(1)).first()
                is not None
            )

    def step(self, job_id: int | None = None) -> bool:
        """One unit of work: mine an open shard, or prepare / finish a job. False when there is none."""
        reraise = job_id is not None  # a worker for all jobs outlives any one job's failure
        with self.sessions() as session:
            for job in jobs.open_jobs(session=session):
                if job_id is not None and job.id != job_id:
                    continue
                shard = jobs.claim_shard(
                    session=session,
                    run_id=job.run_id,
                    worker=self.name,
                    lease=self.lease,
                    max_attempts=self.options.max_attempts,
                )
                session.commit()  # a shard given up on has failed its job
                if shard is not None:
                    held = self._shard_lease(shard)
                    self._guarded(
                        job.id, lambda job=job, shard=shard: self.mine_shard(job, shard), held, reraise
                    )
                    return True
            job = jobs.claim_job(
                session=session,
                worker=self.name,
                lease=self.lease,
                max_attempts=self.options.max_attempts,
                job_id=job_id,
            )
            session.commit()  # jobs given up on are failed
            if job is None:
                return False
        if job.kind == JobKind.analysis:
            self._guarded(job.id, lambda: self.analyze(job), self._job_lease(job.id), reraise)
            return True
        if job.kind == JobKind.comparison:
            self._guarded(job.id, lambda: self.compare(job), self._job_lease(job.id), reraise)
            return True
        if job.run_id is None:
            self._guarded(job.id, lambda: self.prepare(job), self._job_lease(job.id), reraise)
            return True
        with self.sessions() as session:
            shards = jobs.shard_counts(session=session, run_id=job.run_id)
            if shards[ShardStatus.pending] or shards[ShardStatus.running]:  # retried: its shards are open
                jobs.release_job(session=session, job_id=job.id)
                session.commit()
                return True
        self._guarded(job.id, lambda: self.finish(job), self._job_lease(job.id), reraise)
        return True

    def _guarded(self, job_id: int, action, heartbeat: Heartbeat, reraise: bool) -> None:
        """Run `action` while `heartbeat` renews its lease; an error fails the job (stored with its
        traceback), never the worker: it is logged and the worker goes on to the next job, unless
        `reraise` (a caller waiting on this one job, as `ffmem index` does, gets the error itself). A
        lost lease is no error: the work is someone else's now. Interrupts leave everything to be resumed."""
        try:
            with heartbeat:
                action()
        except LostLease:
            return
        except Exception as error:
            with self.sessions() as session:
                jobs.fail_job(session=session, job_id=job_id, error=error)
                session.commit()
            if reraise:
                raise
            log.error(
                "job %s failed (its page: /jobs/%s): %s: %s", job_id, job_id, type(error).__name__, error
            )

    def _job_lease(self, job_id: int) -> Heartbeat:
        """A heartbeat that renews this worker's lease on job `job_id` every third of the lease."""

        def renew() -> bool:
            with self.sessions() as session:
                held = jobs.hold_job(session=session, job_id=job_id, worker=self.name, lease=self.lease)
                session.commit()
            return held

        return Heartbeat(renew, self.options.lease_seconds / 3, name=f"lease of job {job_id}")

    def _shard_lease(self, shard: Shard) -> Heartbeat:
        """A heartbeat that renews this worker's lease on `shard` every third of the lease."""
        run_id, index = shard.run_id, shard.index

        def renew() -> bool:
            with self.sessions() as session:
                held = jobs.hold_shard(
                    session=session, run_id=run_id, index=index, worker=self.name, lease=self.lease
                )
                session.commit()
            return held

        return Heartbeat(
            renew, self.options.lease_seconds / 3, name=f"lease of shard {index} of run {run_id}"
        )

    # -- the three kinds of work ------------------------------------------------------------------
    def prepare(self, job: Job) -> None:
        """Load the model, store the corpus, create the run and its shards; then open them to all."""
        options = self.options.with_run_options(job.options)
        loaded = self.model(options)
        text = read_corpus(options.corpus, options.sentences)
        tokenizer_name = f"{loaded.slug}@{loaded.revision or 'unknown'}"
        fingerprint = jobs.fingerprint(
            {
                "corpus": text.sha256,
                "n": len(text.sentences),
                "tokenizer": tokenizer_name,
                "max_tokens": options.max_sentence_tokens,
            }
        )
        with self.sessions() as session, loaded.lock:  # the tokenizer is shared with live traces
            model_row = _store_model(session, loaded)
            corpus = queries.find_corpus(session=session, fingerprint=fingerprint)
            if corpus is None:
                tokenized = tokenize(text.sentences, loaded.tokenizer, options.max_sentence_tokens)
                corpus = queries.store_corpus(
                    session=session,
                    name=text.name,
                    source=text.source,
                    source_sha256=text.sha256,
                    fingerprint=fingerprint,
                    tokenizer=tokenizer_name,
                    max_tokens=options.max_sentence_tokens,
                    skipped=dict(text.skipped),
                    sentences=((s.text, s.token_ids, s.offsets, s.first_position) for s in tokenized),
                )
            if not jobs.hold_job(session=session, job_id=job.id, worker=self.name, lease=self.lease):
                raise LostLease(f"job {job.id} was taken over")
            run = queries.create_run(
                session=session,
                model_id=model_row.id,
                corpus_id=corpus.id,
                top_k=options.top_k,
                n_value_tokens=options.value_tokens,
                n_sentences=len(mined_sentences(corpus.n_sentences, options.held_out_every)),
                dtype=str(loaded.dtype).removeprefix("torch."),
                device=str(loaded.device),
                package_version=version("ffmem"),
                provenance=_provenance(loaded, corpus, options),
                histogram_edges=histogram_edges(),
                started_at=job.started_at,
            )
            jobs.create_shards(
                session=session,
                run_id=run.id,
                n_sentences=run.n_sentences,
                shard_sentences=options.shard_sentences,
            )
            self.project_values(session, job, run.id, loaded, options)
            session.get(Job, job.id).run_id = run.id
            jobs.release_job(session=session, job_id=job.id)
            session.commit()

    def mine_shard(self, job: Job, shard: Shard) -> None:
        """Mine one shard from its last checkpoint, checkpointing as it goes; merge it into the run."""
        options = self.options.with_run_options(job.options)
        loaded = self.model(options)
        with self.sessions() as session:
            run = session.get(Run, job.run_id)
            corpus_id, total = run.corpus_id, run.n_sentences
            saved, batches_done = jobs.load_checkpoint(
                session=session, run_id=shard.run_id, index=shard.index
            )
            done_before = jobs.progress(session=session, run=run).sentences_done
        if batches_done:
            self.resumed_shards += 1
        token_ids, first_positions, _ = self.corpus(corpus_id)
        first_positions = mined_from(first_positions, first_position=options.first_position)
        if saved:
            state = _state(saved, loaded.device)
        else:
            state = MiningState(loaded.n_layers, loaded.n_keys, options.top_k, device=loaded.device)
        batches = shard_batches(
            token_ids,
            first_positions,
            shard=shard.index,
            shard_sentences=options.shard_sentences,
            batch_tokens=options.batch_tokens,
            pad_id=_pad_id(loaded),
            held_out_every=options.held_out_every,
        )
        sentences_done = sum(len(b.sentence_index) for b in batches[:batches_done])
        tokens_done = sum(b.real_tokens for b in batches[:batches_done])
        bar = tqdm(
            total=total,
            initial=done_before,
            unit="sent",
            desc=f"mining {loaded.slug} (shard {shard.index})",
            disable=not options.progress,
        )
        started = time.perf_counter()
        mined_tokens = 0
        for number, batch in enumerate(batches[batches_done:], start=batches_done + 1):
            with loaded.lock:  # one forward pass at a time on the shared model (live traces wait)
                mine_batches(loaded, [batch], state)
            sentences_done += len(batch.sentence_index)
            tokens_done += batch.real_tokens
            mined_tokens += batch.real_tokens
            self.padding[0] += batch.real_tokens
            self.padding[1] += batch.computed_tokens
            # The first checkpoint comes early, so the pages show provisional triggers within seconds.
            due = number % options.checkpoint_batches == 0 or number == FIRST_CHECKPOINT
            checkpoint = due and number < len(batches)
            with self.sessions() as session:
                held = jobs.checkpoint_shard(
                    session=session,
                    shard=shard,
                    worker=self.name,
                    lease=self.lease,
                    batches_done=number,
                    sentences_done=sentences_done,
                    tokens_done=tokens_done,
                    layers=_layers(state) if checkpoint else None,
                )
                session.commit()
            if not held:
                bar.close()
                raise LostLease(f"shard {shard.index} of run {shard.run_id} was taken over")
            elapsed = time.perf_counter() - started
            bar.set_postfix_str(
                f"{mined_tokens / max(elapsed, 1e-9):,.0f} tok/s, "
                f"padding eff. {self.padding[0] / max(self.padding[1], 1):.1%}"
            )
            bar.update(len(batch.sentence_index))
        bar.close()
        self.timings["mining"] += time.perf_counter() - started
        with self.sessions() as session:
            jobs.lock_run(session=session, run_id=shard.run_id)  # one merge at a time
            current = session.get(Shard, (shard.run_id, shard.index), populate_existing=True)
            if current.status != ShardStatus.done:  # a shard taken over and finished twice merges once
                snapshot = jobs.load_snapshot(session=session, run_id=shard.run_id)
                layers = [state.layer(layer) for layer in range(state.n_layers)]
                if snapshot is not None:
                    layers = [
                        MinedLayer.merge([MinedLayer.from_bytes(s), m])
                        for s, m in zip(snapshot, layers, strict=True)
                    ]
                jobs.save_snapshot(
                    session=session, run_id=shard.run_id, layers=[m.to_bytes() for m in layers]
                )
                jobs.complete_shard(session=session, shard=shard, tokens_done=tokens_done)
            session.commit()

    def finish(self, job: Job) -> None:
        """Every shard is mined: store the triggers and key statistics (with key–value agreement)."""
        options = self.options.with_run_options(job.options)
        loaded = self.model(options)
        with self.sessions() as session:
            run_id = job.run_id
            layers = jobs.load_snapshot(session=session, run_id=run_id)
            state = _state(layers, loaded.device)
            corpus_id = session.get(Run, run_id).corpus_id
            triggers = (MemoryList.run_id == run_id, MemoryList.kind == TRIGGERS)
            session.execute(delete(MemoryList).where(*triggers))  # a finisher that died may have stored some
            for table in (KeyStats, KeyExamples):
                session.execute(delete(table).where(table.run_id == run_id))
            session.commit()
        token_ids, first_positions, following = self.corpus(corpus_id)
        shading = self.shade(state, token_ids, first_positions, loaded, options)
        with self.sessions() as session:
            for layer in tqdm(
                range(loaded.n_layers), desc="storing", unit="layer", disable=not options.progress
            ):
                t0 = time.perf_counter()
                _, sentence, position = state.triggers(layer, 1)  # [keys, T] each
                next_tokens = next_token_ids(following, sentence, position)  # [keys, T]
                ranks = target_ranks(loaded, layer, next_tokens[:, 0])  # [keys]
                norms = loaded.value_norms[layer].cpu()  # [keys]
                t1 = time.perf_counter()
                _store_layer(session, run_id, layer, state, next_tokens, ranks, norms)
                key_examples.store_key_examples(
                    session=session,
                    run_id=run_id,
                    layer=layer,
                    mined=state.layer(layer),
                    **shading.pop(layer),
                )
                if not jobs.hold_job(session=session, job_id=job.id, worker=self.name, lease=self.lease):
                    session.rollback()
                    raise LostLease(f"job {job.id} was taken over while storing")
                session.commit()
                self.timings["projection"] += t1 - t0
                self.timings["storing"] += time.perf_counter() - t1
            compose(self.sessions, run_id, loaded, progress=options.progress)  # weight graph, explanations
            self.store_neighbours(session, run_id, loaded, options)
            queries.finish_run(session=session, run_id=run_id, n_tokens=state.positions)
            jobs.finish_job(session=session, job_id=job.id)
            jobs.attach_analyses(session=session, index_job=job)
            jobs.drop_layers(session=session, run_id=run_id)
            session.commit()

    def shade(self, state: MiningState, token_ids, first_positions, loaded: LoadedModel, options) -> dict:
        """The second pass: each key's coefficient at every token of its first `shaded_triggers`
        triggers of each sign and of its band samples (engine.sentence_coefficients). Per layer, the
        arguments of key_examples.store_key_examples: {"positive", "negative", "samples"}, per key a
        list of float32 arrays."""
        t0 = time.perf_counter()
        counts, wanted = {}, {}
        for layer in range(state.n_layers):
            blocks = [
                state.triggers(layer, sign)[1][:, : options.shaded_triggers].numpy() for sign in (1, -1)
            ]
            blocks.append(state.layer(layer).sample_sentence.reshape(state.n_keys, -1))  # by bin, then slot
            valid = [block >= 0 for block in blocks]  # triggers fill ranks 0 … n−1; samples any slot
            counts[layer] = np.stack([v.sum(axis=1) for v in valid], axis=1)  # [keys, 3]
            sentences = np.concatenate([block for block in blocks], axis=1)  # [keys, 2S + bins·samples]
            keep = np.concatenate(valid, axis=1)  # [keys, …]
            keys = np.broadcast_to(np.arange(state.n_keys)[:, None], keep.shape)
            wanted[layer] = np.stack([keys[keep], sentences[keep]], axis=1)  # [n, 2] key-major, in order
        bar = tqdm(desc="shading", unit="sent", disable=not options.progress)

        def report(done: int, total: int) -> None:
            bar.total, bar.n = total, done
            bar.refresh()

        found = sentence_coefficients(
            loaded,
            token_ids,
            mined_from(first_positions, first_position=options.first_position),
            wanted,
            batch_tokens=options.batch_tokens,
            pad_id=_pad_id(loaded),
            report=report,
        )
        bar.close()
        shading = {}
        for layer, arrays in found.items():
            bounds = np.concatenate([[0], np.cumsum(counts[layer].reshape(-1))])  # per key: +, −, samples
            parts = [arrays[start:stop] for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
            shading[layer] = {
                name: [parts[3 * key + i] for key in range(state.n_keys)]
                for i, name in enumerate(("positive", "negative", "samples"))
            }
        self.timings["shading"] = self.timings.get("shading", 0.0) + time.perf_counter() - t0
        return shading

    def store_neighbours(self, session: Session, run_id: int, loaded: LoadedModel, options) -> None:
        """Each memory's nearest memories by key and by value direction. They need no corpus, but at
        prepare they would hold back the run's first results; here they add to its finish."""
        t0 = time.perf_counter()
        bar = tqdm(desc="neighbours", unit="block pair", disable=not options.progress)

        def report(kind: str, done: int, total: int) -> None:  # keys, then values: `total` pairs each
            bar.total = 2 * total
            bar.set_description(f"neighbours by {kind}", refresh=False)
            bar.n = done + (total if kind == "value" else 0)
            bar.refresh()

        found = memory_neighbours(loaded, report=report)
        bar.close()
        neighbours = {kind: (index.numpy(), cosine.numpy()) for kind, (index, cosine) in found.items()}
        memory_search.store_neighbours(
            session=session,
            run_id=run_id,
            n_keys=loaded.n_keys,
            neighbours=neighbours,
            baselines=memory_baselines(loaded),  # what random pairs reach, per layer
        )
        self.timings["neighbours"] = self.timings.get("neighbours", 0.0) + time.perf_counter() - t0

    def project_values(self, session: Session, job: Job, run_id: int, loaded: LoadedModel, options) -> None:
        """Every value's top and bottom tokens under both readouts: they need no corpus, so the pages
        show them while the run is still mining; and the arrays of full-vocabulary token search."""
        log_z = {}
        for layer in tqdm(
            range(loaded.n_layers), desc="projecting values", unit="layer", disable=not options.progress
        ):
            t0 = time.perf_counter()
            projected = list(project_layer(loaded, layer, options.value_tokens))
            t1 = time.perf_counter()
            for p in projected:
                log_z[layer, p.readout] = p.log_z
                queries.store_value_tokens(
                    session=session,
                    run_id=run_id,
                    layer=layer,
                    readout=p.readout,
                    direction=p.direction,
                    token_ids=p.token_ids.numpy(),
                    logits=p.logits.numpy(),
                    log_z=p.log_z.numpy(),
                )
            if not jobs.hold_job(session=session, job_id=job.id, worker=self.name, lease=self.lease):
                raise LostLease(f"job {job.id} was taken over while projecting")
            self.timings["projection"] += t1 - t0
            self.timings["storing"] += time.perf_counter() - t1
        memory_search.store_run_arrays(session=session, run_id=run_id, arrays=search_arrays(loaded, log_z))

    def analyze(self, job: Job) -> None:
        """The paper's analyses of the job's (finished) run, on the model that built it; progress
        and the lease are renewed in the job's row every few seconds."""
        options = self.run_model_options(job.run_id)
        loaded = self.model(options)
        given = {name: job.options[name] for name in (*jobs.ANALYSIS_FIELDS, "seed")}
        chosen = AnalysisOptions(**given, progress=options.progress)
        analyze(self.sessions, job.run_id, loaded, chosen, report=self._reporter(job.id))
        with self.sessions() as session:
            jobs.finish_job(session=session, job_id=job.id)
            session.commit()

    def compare(self, job: Job) -> None:
        """Two finished runs side by side (ffmem.worker.comparison), each run's weights read from the
        model that built it, one model after the other."""
        a, b = job.options["runs"]
        compare_runs(
            self.sessions, a, b, lambda run_id: memory_weights(self.model(self.run_model_options(run_id)))
        )
        with self.sessions() as session:
            jobs.finish_job(session=session, job_id=job.id)
            session.commit()

    def run_model_options(self, run_id: int) -> IndexOptions:
        """The options that load the model of run `run_id` as its index job loaded it (or by its source)."""
        with self.sessions() as session:
            built_by = session.scalars(
                select(Job).where(Job.kind == JobKind.index, Job.run_id == run_id).order_by(Job.id.desc())
            ).first()
            source = session.get(Run, run_id).model.source
        return (
            self.options.with_run_options(built_by.options)
            if built_by
            else replace(self.options, model=source)
        )

    def _reporter(self, job_id: int, every: float = 2.0):
        """report(analysis, done, total) for `analyze`: stores the progress and renews the lease at
        most every `every` seconds, and at each analysis's start and end; raises LostLease when the
        job was taken over."""
        last = {"at": float("-inf"), "stage": None}

        def report(stage: str, done: int, total: int) -> None:
            moment = time.monotonic()
            if moment - last["at"] < every and stage == last["stage"] and done < total:
                return
            last["at"], last["stage"] = moment, stage
            progress = StageProgress(stage=stage, done=done, total=total)
            with self.sessions() as session:
                held = jobs.set_progress(
                    session=session, job_id=job_id, worker=self.name, lease=self.lease, progress=progress
                )
                session.commit()
            if not held:
                raise LostLease(f"job {job_id} was taken over")

        return report

    # -- what a worker holds ----------------------------------------------------------------------
    def model(self, options: IndexOptions) -> LoadedModel:
        """The job's model: the process's one copy (shared with its live traces), taken once per worker
        (again when a job names another)."""
        wanted = (options.model, options.dtype)
        if self.loaded is None or self._loaded_for not in (None, wanted):
            self.loaded = None  # ours goes first: no two models at once unless someone else holds it
            self.loaded = shared_model(
                options.model, device=options.device, dtype=options.dtype, cache_dir=options.cache_dir
            )
        self._loaded_for = wanted
        return self.loaded

    def corpus(self, corpus_id: int) -> tuple[list[list[int]], list[int], torch.Tensor]:
        """(token ids, first mined positions, following tokens) of a stored corpus, read once."""
        if self._corpus is None or self._corpus[0] != corpus_id:
            with self.sessions() as session:
                ids = queries.load_sentence_tokens(session=session, corpus_id=corpus_id)
                first = queries.load_first_positions(session=session, corpus_id=corpus_id)
            self._corpus = (corpus_id, ids, first, _following_tokens(ids))
        return self._corpus[1:]

    def summary(self, job_id: int, already_built: bool = False) -> IndexSummary:
        with self.sessions() as session:
            job = session.get(Job, job_id)
            run = session.get(Run, job.run_id)
            model = run.model
            count = queries.count_entries
            return IndexSummary(
                run_id=run.id,
                model=model.slug,
                corpus=run.corpus.name,
                sentences=run.n_sentences,
                tokens=run.n_tokens,
                layers=model.n_layers,
                keys=model.n_keys,
                triggers=count(session=session, run_id=run.id, kind=TRIGGERS),
                value_tokens=sum(count(session=session, run_id=run.id, kind=r) for r in READOUTS),
                padding_efficiency=self.padding[0] / self.padding[1] if self.padding[1] else 1.0,
                resumed_shards=self.resumed_shards,
                mining_seconds=self.timings["mining"],
                projection_seconds=self.timings["projection"],
                storing_seconds=self.timings["storing"],
                shading_seconds=self.timings.get("shading", 0.0),
                already_built=already_built,
            )


def _layers(state: MiningState) -> list[bytes]:
    return [state.layer(layer).to_bytes() for layer in range(state.n_layers)]


def _state(layers: list[bytes], device) -> MiningState:
    return MiningState.from_layers([MinedLayer.from_bytes(data) for data in layers], device=device)


def _provenance(loaded: LoadedModel, corpus, options: IndexOptions) -> dict:
    return {
        "model_source": loaded.source,
        "model_revision": loaded.revision,
        "weights_sha256": loaded.weights_sha256,
        "architecture": type(loaded.model).__name__,
        "corpus": corpus.name,
        "corpus_sha256": corpus.source_sha256,
        "sentences": corpus.n_sentences,
        "held_out_every": options.held_out_every,
        "held_out": _held_out_rule(corpus.n_sentences, options.held_out_every),
        "shard_order": "shard k of n mines every n-th mined sentence from the k-th: each spans the corpus",
        "max_sentence_tokens": options.max_sentence_tokens,
        "first_position": options.first_position,
        "mined_positions": _mined_positions(loaded, options.first_position),
        "batch_tokens": options.batch_tokens,
        "shard_sentences": options.shard_sentences,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _held_out_rule(n_sentences: int, every: int) -> str:
    """Which sentences the run holds out of mining, in words (ffmem.engine.corpus.held_out_sentences)."""
    if not every:
        return "none: every sentence read is mined"
    held = len(held_out_sentences(n_sentences, every))
    return (
        f"every {every}th sentence (index % {every} = {every - 1}): {held:,} sentences, not mined; "
        "the analyses and the explanations' scores read them"
    )


def _mined_positions(loaded: LoadedModel, first_position: bool) -> str:
    """The run's position policy in words (ffmem.engine.corpus.mined_from)."""
    if loaded.bos_prepended:
        where = f"from 1: the tokenizer puts {loaded.tokenizer.bos_token} first (never mined)"
    elif first_position:
        where = "from 0: the tokenizer puts no BOS first; the first token (attention sink) is mined"
    else:
        where = "from 1: the tokenizer puts no BOS first; the first token (attention sink) is not mined"
    return f"{where}. Triggers and every statistic (histogram, mean, shares, tokens) cover these positions"


def _store_model(session: Session, loaded: LoadedModel):
    config = loaded.config
    model_row = queries.upsert_model(
        session=session,
        slug=loaded.slug,
        source=loaded.source,
        revision=loaded.revision,
        architecture=type(loaded.model).__name__,
        family=loaded.adapter.family,
        n_layers=loaded.n_layers,
        n_keys=loaded.n_keys,
        d_model=config.hidden_size if hasattr(config, "hidden_size") else config.n_embd,
        vocab_size=len(loaded.tokenizer),
        activation=loaded.adapter.activation(config),
        gated=loaded.adapter.gates is not None,
    )
    ids = list(range(len(loaded.tokenizer)))
    queries.store_vocabulary(
        session=session,
        model_id=model_row.id,
        texts=[loaded.tokenizer.decode([i]) for i in ids],
        pieces=[str(p) for p in loaded.tokenizer.convert_ids_to_tokens(ids)],
    )
    return model_row


def _following_tokens(token_ids: list[list[int]]) -> torch.Tensor:
    """[sentences, max_len + 1]: the token after each position (−1 past a sentence's end)."""
    following = torch.full((len(token_ids), max(map(len, token_ids), default=0) + 1), -1, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        following[row, : len(ids) - 1] = torch.tensor(ids[1:], dtype=torch.long)
    return following


def next_token_ids(following: torch.Tensor, sentence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The token that follows each trigger prefix ([keys, T]; −1 at a sentence's end or an empty slot)."""
    found = following[sentence.clamp(min=0), position]  # [keys, T]
    return torch.where(sentence >= 0, found, -1)


def _store_layer(
    session: Session,
    run_id: int,
    layer: int,
    state: MiningState,
    next_tokens: torch.Tensor,
    ranks: torch.Tensor,
    norms: torch.Tensor,
) -> int:
    """Store one layer's triggers (both signs) and key statistics; returns triggers stored.

    Key–value agreement: how many of a key's positive triggers are followed by one of its value's
    top raw tokens (stored when the run was prepared); and `ranks`, the raw rank of the token after
    each key's top trigger (the paper's Figs. 4–5).
    """
    top_ids, top_probs = queries.layer_value_tokens(
        session=session, run_id=run_id, layer=layer, readout="raw", direction=1
    )  # [keys, n] each
    agrees = (next_tokens[:, :, None] == torch.from_numpy(top_ids)[:, None, :]).any(dim=-1)  # [keys, T]
    stored = 0
    for sign in (1, -1):
        coefficients, sentence, position = state.triggers(layer, sign)  # [keys, T] each
        stored += queries.store_triggers(
            session=session,
            run_id=run_id,
            layer=layer,
            sign=sign,
            coefficients=coefficients.numpy(),
            sentence_index=sentence.numpy(),
            position=position.numpy(),
        )
    top, _, _ = state.triggers(layer, 1)
    bottom, _, _ = state.triggers(layer, -1)
    queries.store_key_stats(
        session=session,
        run_id=run_id,
        layer=layer,
        mean=state.mean(layer).numpy(),
        positive_share=state.positive_share(layer).numpy(),
        max_coefficient=top[:, 0].numpy(),
        min_coefficient=bottom[:, 0].numpy(),
        value_norm=norms.numpy(),
        histogram=state.histogram[layer].cpu().numpy(),
        density=state.density(layer).numpy(),
        max_prob=top_probs[:, 0],
        agreement=(agrees & (next_tokens >= 0)).sum(dim=-1).numpy(),
        next_token_rank=ranks.numpy(),
    )
    return stored


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0
