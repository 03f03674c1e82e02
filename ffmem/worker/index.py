"""The stages of an index run: prepare (load → corpus → run and shards → project the values), mine a
shard (checkpointed in the database) and finish (shade → store the layers → compose → neighbours: the steps of
ffmem.worker.finishing).

A worker (ffmem.worker.loop) takes each stage up as a step of the run's job: it prepares a queued
job's run, mines any run's open shards and finishes runs whose shards are all done. Several workers on
one Postgres share the shards (ffmem.store.shards), sized by the model
(ffmem.engine.mining.corpus.shard_size); each shard's running top-T is checkpointed in its row every
`checkpoint_seconds` (or `checkpoint_batches` batches), so a killed worker loses at most that much, and the
shards merge exactly into the single-worker result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import torch
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from ffmem.config import Settings
from ffmem.engine.mining.batches import mine_batches, shard_batches
from ffmem.engine.mining.corpus import mined_from, mined_sentences, read_corpus, shard_size, tokenize
from ffmem.engine.mining.mined_layer import MinedLayer, histogram_edges
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.bf16_logits import Unembedding
from ffmem.engine.values.projection import project_layer
from ffmem.engine.values.token_memories import TokenMemories
from ffmem.store import (
    corpora,
    jobs,
    memory_search,
    memory_writes,
    runs,
    shards,
    value_histograms,
)
from ffmem.store.memory_lists import READOUTS, TRIGGERS
from ffmem.store.models import Job, Run, Shard, ShardStatus
from ffmem.store.specs import RunSpec, fingerprint
from ffmem.worker.finishing import STEPS, Finishing
from ffmem.worker.layer_results import following_tokens
from ffmem.worker.leases import Heartbeat
from ffmem.worker.provenance import provenance, store_model

FIRST_CHECKPOINT = 2  # batches: the run's first shard's first checkpoint, so its pages show triggers early


@dataclass
class IndexOptions:
    """What a worker needs: the run `ffmem index` builds (`spec`; a worker for all jobs reads each job's
    own) and the worker's own settings (device, cache, progress, checkpoints, lease, attempts, the local
    explainer it may reach)."""

    spec: RunSpec
    device: str
    cache_dir: Path
    progress: bool
    checkpoint_batches: int
    checkpoint_seconds: float
    lease_seconds: float
    max_attempts: int
    explainer_url: str = ""
    explainer_timeout: float = Settings.model_fields["explainer_timeout"].default
    compiled_fold: bool = False  # the torch fold's passes compiled (Settings.compiled_fold)
    # Told of each timed step (IndexPipeline.timed): (name, None) at its start, (name, seconds) at its end.
    observer: Callable[[str, float | None], None] | None = None

    @classmethod
    def from_settings(
        cls, settings: Settings, device: str | None = None, progress: bool = True, **given
    ) -> IndexOptions:
        """A worker's options: the run `given` names (None: the setting) and the worker's own settings."""
        return cls(
            spec=RunSpec.from_settings(settings, **given),
            device=device or settings.device,
            cache_dir=Path(settings.cache_dir),
            progress=progress,
            checkpoint_batches=settings.checkpoint_batches,
            checkpoint_seconds=settings.checkpoint_seconds,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
            explainer_url=settings.explainer_url,
            explainer_timeout=settings.explainer_timeout,
            compiled_fold=settings.compiled_fold,
        )

    @property
    def lease(self) -> timedelta:
        """How long a worker holds a job or shard after its last renewal."""
        return timedelta(seconds=self.lease_seconds)


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
    shading_seconds: float = 0.0  # the second pass (ffmem.worker.finishing.shade)
    already_built: bool = False


@dataclass
class IndexPipeline:
    """A worker's index stages (`prepare`, `mine_shard`, `finish`), each taken up under its job's or
    shard's lease (a Heartbeat: `check` before each commit), and what they measured (`summary`)."""

    sessions: sessionmaker
    options: IndexOptions  # the worker's: progress, checkpoints, lease
    model: Callable[[RunSpec], LoadedModel]  # the worker's one model, as a run's spec loads it
    worker: str  # the worker's id (jobs.worker_id), holder of the shards it mines
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step and part (`timed`)
    padding: list = field(default_factory=lambda: [0, 0])  # real, computed tokens
    resumed_shards: int = 0
    _corpus: tuple | None = None  # (corpus id, token ids, first positions, following tokens)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds the block takes to `timings[name]`; tell `options.observer` its start and end."""
        observer = self.options.observer or (lambda _name, _seconds: None)
        observer(name, None)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.timings[name] = self.timings.get(name, 0.0) + seconds
            observer(name, seconds)

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, job: Job, lease: Heartbeat) -> None:
        """Load the model, store the corpus, create the run and its shards; then open them to all."""
        spec = job.spec
        loaded = self.model(spec)
        text = read_corpus(spec.corpus, spec.sentences)
        tokenizer_name = f"{loaded.slug}@{loaded.revision or 'unknown'}"
        corpus_key = fingerprint(
            {
                "corpus": text.sha256,
                "n": len(text.sentences),
                "tokenizer": tokenizer_name,
                "max_tokens": spec.max_sentence_tokens,
            }
        )
        with self.sessions() as session, loaded.lock:  # the tokenizer is shared with live traces
            model_row = store_model(session, loaded)
            corpus = corpora.find_corpus(session=session, fingerprint=corpus_key)
            if corpus is None:
                tokenized = tokenize(text.sentences, loaded.tokenizer, spec.max_sentence_tokens)
                corpus = corpora.store_corpus(
                    session=session,
                    name=text.name,
                    source=text.source,
                    source_sha256=text.sha256,
                    fingerprint=corpus_key,
                    tokenizer=tokenizer_name,
                    max_tokens=spec.max_sentence_tokens,
                    skipped=dict(text.skipped),
                    sentences=((s.text, s.token_ids, s.offsets, s.first_position) for s in tokenized),
                )
            lease.check(session)
            shard_sentences = run_shard_size(spec, loaded, corpus)
            run = runs.create_run(
                session=session,
                model_id=model_row.id,
                corpus_id=corpus.id,
                top_k=spec.top_k,
                n_value_tokens=spec.value_tokens,
                n_sentences=len(mined_sentences(corpus.n_sentences, spec.held_out_every)),
                dtype=str(loaded.dtype).removeprefix("torch."),
                device=str(loaded.device),
                package_version=version("ffmem"),
                provenance=provenance(loaded, corpus, spec, shard_sentences),
                histogram_edges=histogram_edges(),
                started_at=job.started_at,
            )
            shards.create_shards(
                session=session,
                run_id=run.id,
                n_sentences=run.n_sentences,
                shard_sentences=shard_sentences,
            )
            self.project_values(session, lease, run.id, loaded, spec)
            session.get(Job, job.id).run_id = run.id
            jobs.release_job(session=session, job_id=job.id)
            session.commit()

    def project_values(
        self, session: Session, lease: Heartbeat, run_id: int, loaded: LoadedModel, spec: RunSpec
    ) -> None:
        """Every value's top and bottom tokens and logit histogram under both readouts: they need no
        corpus, so the pages show them while the run is still mining; with them, from the same logits,
        the token → memories table of full-vocabulary token search."""
        token_memories = (
            {r: TokenMemories.of(loaded, spec.token_memories) for r in READOUTS}
            if spec.token_memories
            else None
        )
        for layer in tqdm(
            range(loaded.n_layers), desc="projecting values", unit="layer", disable=not self.options.progress
        ):
            with self.timed("projection"):
                projected = list(
                    project_layer(loaded, layer, spec.value_tokens, token_memories=token_memories)
                )
            with self.timed("storing"):
                for p in projected:
                    memory_writes.store_value_tokens(
                        session=session,
                        run_id=run_id,
                        layer=layer,
                        readout=p.readout,
                        direction=p.direction,
                        token_ids=p.token_ids.numpy(),
                        logits=p.logits.numpy(),
                        log_z=p.log_z.numpy(),
                    )
                histograms = (p.histogram for p in projected if p.direction == 1)  # one per readout
                value_histograms.store_value_histograms(
                    session=session,
                    run_id=run_id,
                    layer=layer,
                    histograms={
                        h.readout: (h.low.numpy(), h.high.numpy(), h.counts.numpy()) for h in histograms
                    },
                )
                lease.check(session)
        Unembedding.forget(loaded)  # the projection's bf16 copy of the output embedding, if it made one
        for readout, table in (token_memories or {}).items():
            with self.timed("storing"):
                memories, scores = table.lists()
                memory_search.store_token_memories(
                    session=session,
                    run_id=run_id,
                    readout=readout,
                    memories=memories.numpy(),
                    scores=scores.numpy(),
                )
                lease.check(session)

    # -- mine a shard -----------------------------------------------------------------------------
    def mine_shard(self, job: Job, shard: Shard, lease: Heartbeat) -> None:
        """Mine one shard from its last checkpoint, checkpointing as it goes; merge it into the run."""
        spec = job.spec
        loaded = self.model(spec)
        with self.sessions() as session:
            run = session.get(Run, job.run_id)
            corpus_id, total = run.corpus_id, run.n_sentences
            shard_sentences = run_shard_size(spec, loaded, run.corpus)
            saved, batches_done = shards.load_checkpoint(
                session=session, run_id=shard.run_id, index=shard.index
            )
            done_before = shards.progress(session=session, run=run).sentences_done
        if batches_done:
            self.resumed_shards += 1
        token_ids, first_positions, _ = self.corpus(corpus_id)
        first_positions = mined_from(first_positions, first_position=spec.first_position)
        compiled_fold = self.options.compiled_fold
        if saved:
            state = _state(saved, loaded.device, compiled_fold)
        else:
            gated = loaded.adapter.gates is not None
            state = MiningState(
                loaded.n_layers, loaded.n_keys, spec.top_k, loaded.device, gated, compiled_fold=compiled_fold
            )
        batches = shard_batches(
            token_ids,
            first_positions,
            shard=shard.index,
            shard_sentences=shard_sentences,
            batch_tokens=spec.batch_tokens,
            pad_id=_pad_id(loaded),
            held_out_every=spec.held_out_every,
        )
        sentences_done = sum(len(b.sentence_index) for b in batches[:batches_done])
        tokens_done = sum(b.real_tokens for b in batches[:batches_done])
        bar = tqdm(
            total=total,
            initial=done_before,
            unit="sent",
            desc=f"mining {loaded.slug} (shard {shard.index})",
            disable=not self.options.progress,
        )
        started = time.perf_counter()
        mined_tokens = 0
        checkpoints = Checkpoints(self.options.checkpoint_batches, self.options.checkpoint_seconds, started)
        with bar, self.timed("mining"):
            for number, batch in enumerate(batches[batches_done:], start=batches_done + 1):
                with loaded.lock:  # one forward pass at a time on the shared model (live traces wait)
                    mine_batches(loaded, [batch], state)
                sentences_done += len(batch.sentence_index)
                tokens_done += batch.real_tokens
                mined_tokens += batch.real_tokens
                self.padding[0] += batch.real_tokens
                self.padding[1] += batch.computed_tokens
                checkpoint = number < len(batches) and checkpoints.due(number, first=shard.index == 0)
                begun = time.perf_counter()
                with self.sessions() as session:
                    lease.check(session)
                    shards.checkpoint_shard(
                        session=session,
                        shard=shard,
                        worker=self.worker,
                        lease=self.options.lease,
                        batches_done=number,
                        sentences_done=sentences_done,
                        tokens_done=tokens_done,
                        layers=_layers(state) if checkpoint else None,
                    )
                    session.commit()
                if checkpoint:
                    checkpoints.taken(begun)
                elapsed = time.perf_counter() - started
                bar.set_postfix_str(
                    f"{mined_tokens / max(elapsed, 1e-9):,.0f} tok/s, "
                    f"padding eff. {self.padding[0] / max(self.padding[1], 1):.1%}"
                )
                bar.update(len(batch.sentence_index))
        with self.sessions() as session:
            shards.lock_run(session=session, run_id=shard.run_id)  # one merge at a time
            current = session.get(Shard, (shard.run_id, shard.index), populate_existing=True)
            if current.status != ShardStatus.done:  # a shard taken over and finished twice merges once
                snapshot = shards.load_snapshot(session=session, run_id=shard.run_id)
                layers = [state.layer(layer) for layer in range(state.n_layers)]
                if snapshot is not None:
                    layers = [
                        MinedLayer.merge([MinedLayer.from_bytes(s), m])
                        for s, m in zip(snapshot, layers, strict=True)
                    ]
                shards.save_snapshot(
                    session=session, run_id=shard.run_id, layers=[m.to_bytes() for m in layers]
                )
                shards.complete_shard(session=session, shard=shard, tokens_done=tokens_done)
            session.commit()

    # -- finish -----------------------------------------------------------------------------------
    def finish(self, job: Job, lease: Heartbeat) -> None:
        """Every shard is mined: store the run, step by step (ffmem.worker.finishing), each step timed into
        `timings`."""
        spec = job.spec
        loaded = self.model(spec)
        with self.sessions() as session:
            state = _state(shards.load_snapshot(session=session, run_id=job.run_id), loaded.device)
            corpus_id = session.get(Run, job.run_id).corpus_id
            # A finisher that died may have stored some results: they go before it starts again.
            runs.clear_results(session=session, run_id=job.run_id)
            session.commit()
        token_ids, first_positions, following = self.corpus(corpus_id)
        run = Finishing(
            job=job,
            lease=lease,
            spec=spec,
            loaded=loaded,
            state=state,
            token_ids=token_ids,
            first_positions=first_positions,
            following=following,
            positions=state.positions,
            pad_id=_pad_id(loaded),
            sessions=self.sessions,
            options=self.options,
            timed=self.timed,
        )
        del state
        for name, step in STEPS:
            with self.timed(name):
                step(run)

    # -- what the stages read and measured --------------------------------------------------------
    def corpus(self, corpus_id: int) -> tuple[list[list[int]], list[int], torch.Tensor]:
        """(token ids, first mined positions, following tokens) of a stored corpus, read once."""
        if self._corpus is None or self._corpus[0] != corpus_id:
            with self.sessions() as session:
                ids = corpora.load_sentence_tokens(session=session, corpus_id=corpus_id)
                first = corpora.load_first_positions(session=session, corpus_id=corpus_id)
            self._corpus = (corpus_id, ids, first, following_tokens(ids))
        return self._corpus[1:]

    def summary(self, job_id: int, already_built: bool = False) -> IndexSummary:
        """What job `job_id`'s run stored, and what this worker measured building it."""
        with self.sessions() as session:
            job = session.get(Job, job_id)
            run = session.get(Run, job.run_id)
            model = run.model
            count = runs.count_entries
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
                mining_seconds=self.timings.get("mining", 0.0),
                projection_seconds=self.timings.get("projection", 0.0),
                storing_seconds=self.timings.get("storing", 0.0),
                shading_seconds=self.timings.get("shading", 0.0),
                already_built=already_built,
            )


def _layers(state: MiningState) -> list[bytes]:
    return [state.layer(layer).to_bytes() for layer in range(state.n_layers)]


def run_shard_size(spec: RunSpec, loaded: LoadedModel, corpus) -> int:
    """Sentences a shard of the run (`spec.shard_sentences`, 0: sized by the model and the corpus)."""
    return shard_size(spec.shard_sentences, memories=loaded.n_layers * loaded.n_keys,
                      corpus_tokens=corpus.n_tokens, corpus_sentences=corpus.n_sentences)  # fmt: skip


@dataclass
class Checkpoints:
    """When a shard's running top-T is checkpointed: every `batches` batches; or, with `batches` 0, once
    `seconds` have passed since the last checkpoint (the shard's start) and ten times as long as that one
    took, so that checkpoints (1.2 GB at 8B) take at most a tenth of the mining. The run's first shard
    checkpoints at FIRST_CHECKPOINT as well, so its pages show provisional triggers within seconds."""

    batches: int
    seconds: float
    last: float  # when the last checkpoint ended (time.perf_counter; first, the shard's start)
    cost: float = 0.0  # seconds the last one took

    def due(self, number: int, *, first: bool) -> bool:
        if first and number == FIRST_CHECKPOINT:
            return True
        if self.batches:
            return number % self.batches == 0
        return time.perf_counter() - self.last >= max(self.seconds, 10 * self.cost)

    def taken(self, begun: float) -> None:
        """A checkpoint begun at `begun` (time.perf_counter) is stored."""
        self.last = time.perf_counter()
        self.cost = self.last - begun


def _state(layers: list[bytes], device, compiled_fold: bool = False) -> MiningState:
    mined = [MinedLayer.from_bytes(data) for data in layers]
    return MiningState.from_layers(mined, device=device, compiled_fold=compiled_fold)


def _pad_id(loaded: LoadedModel) -> int:
    tokenizer = loaded.tokenizer
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0
