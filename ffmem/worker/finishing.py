"""Finishing an index run, once every shard is mined: its named steps, each timed by the pipeline
(`IndexPipeline.finish` runs `STEPS` in order) — shading (the second pass), layers (triggers, value tokens
and key statistics: ffmem.store.memory_writes), weight_graph (ffmem.worker.composition), token_change (a
sample of memories' TokenChange: ffmem.worker.token_changes), explanations (ffmem.worker.composition, as the
job's RunSpec says), neighbours (ffmem.worker.neighbours), closing (the run finished, its analyses attached,
the checkpoints dropped). Every step commits only after `lease.check(session)`: a worker that lost its lease
stops before it commits.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from sqlalchemy.orm import Session, sessionmaker
from tqdm.auto import tqdm

from ffmem.engine.mining.corpus import mined_from
from ffmem.engine.mining.sentence_coefficients import sentence_coefficients
from ffmem.engine.mining.state import MiningState
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.bf16_logits import Unembedding
from ffmem.engine.values.projection import target_ranks
from ffmem.store import jobs, key_examples, memory_writes, runs, shards
from ffmem.store.models import Job
from ffmem.store.specs import RunSpec
from ffmem.worker.composition import explanations_step, weight_graph_step
from ffmem.worker.explanations import ExplanationOptions
from ffmem.worker.layer_results import next_token_ids, store_layer
from ffmem.worker.leases import Heartbeat
from ffmem.worker.neighbours import neighbours_step
from ffmem.worker.token_changes import token_change_step

if TYPE_CHECKING:
    from ffmem.worker.index import IndexOptions


@dataclass
class Finishing:
    """What the steps of finishing a run share: its job and lease, its spec and model, the merged mining
    state (until its layers are stored), the corpus (token ids, first mined positions, following tokens)
    and, once shaded, each layer's shading (a key_examples.LayerShading); and of the pipeline that finishes
    it, the sessions, the worker's options and its `timed` (seconds per part)."""

    job: Job
    lease: Heartbeat
    spec: RunSpec
    loaded: LoadedModel
    state: MiningState | None
    token_ids: list[list[int]]
    first_positions: list[int]
    following: torch.Tensor
    positions: int  # mined positions (the state's, kept when the state goes)
    pad_id: int  # what pads a batch of the model's
    sessions: sessionmaker
    options: IndexOptions
    timed: Callable[[str], AbstractContextManager[None]]
    shading: dict[int, key_examples.LayerShading] = field(default_factory=dict)


def shade(run: Finishing) -> None:
    """The second pass: each key's coefficient at every token of its first `shaded_triggers`
    triggers of each sign and of its band samples (engine.sentence_coefficients), a LayerShading
    per layer: one flat float32 array of all its sentences, key after key."""
    state = run.state
    counts, wanted = {}, {}
    for layer in range(state.n_layers):
        blocks = [state.triggers(layer, sign)[1][:, : run.spec.shaded_triggers].numpy() for sign in (1, -1)]
        blocks.append(state.layer(layer).sample_sentence.reshape(state.n_keys, -1))  # by bin, then slot
        valid = [block >= 0 for block in blocks]  # triggers fill ranks 0 … n−1; samples any slot
        counts[layer] = np.stack([v.sum(axis=1) for v in valid], axis=1)  # [keys, 3]
        sentences = np.concatenate([block for block in blocks], axis=1)  # [keys, 2S + bins·samples]
        keep = np.concatenate(valid, axis=1)  # [keys, …]
        keys = np.broadcast_to(np.arange(state.n_keys)[:, None], keep.shape)
        wanted[layer] = np.stack([keys[keep], sentences[keep]], axis=1)  # [n, 2] key-major, in order
    bar = tqdm(desc="shading", unit="sent", disable=not run.options.progress)

    def report(done: int, total: int) -> None:
        bar.total, bar.n = total, done
        bar.refresh()

    found = sentence_coefficients(
        run.loaded,
        run.token_ids,
        mined_from(run.first_positions, first_position=run.spec.first_position),
        wanted,
        batch_tokens=run.spec.batch_tokens,
        pad_id=run.pad_id,
        report=report,
    )
    bar.close()
    for layer, (values, offsets) in found.items():
        run.shading[layer] = key_examples.LayerShading(values, offsets, counts[layer])


def store_layers(run: Finishing) -> None:
    """Each layer's triggers and key statistics (with key–value agreement) and its key examples,
    committed a layer at a time."""
    run_id, loaded, state = run.job.run_id, run.loaded, run.state
    with run.sessions() as session:
        for layer in tqdm(
            range(loaded.n_layers), desc="storing", unit="layer", disable=not run.options.progress
        ):
            with run.timed("projection"):
                _, sentence, position = state.triggers(layer, 1)  # [keys, T] each
                next_tokens = next_token_ids(run.following, sentence, position)  # [keys, T]
                ranks = target_ranks(loaded, layer, next_tokens[:, 0])  # [keys]
                norms = loaded.value_norms[layer].cpu()  # [keys]
            with run.timed("storing"):
                store_layer(session, run_id, layer, state, next_tokens, ranks, norms)
                key_examples.store_key_examples(
                    session=session,
                    run_id=run_id,
                    layer=layer,
                    mined=state.layer(layer),
                    shading=run.shading.pop(layer),
                )
                run.lease.check(session)
                session.commit()
        Unembedding.forget(loaded)  # the ranks' bf16 copy of the output embedding and its buffers, if made
        with run.timed("storing"):
            store_sentence_triggers(session, run)
            run.lease.check(session)
            session.commit()
    run.state = state = None  # all stored: the steps after read the store and the model
    release_freed_memory()  # the shading and the state: gigabytes at 131,072 memories


def store_sentence_triggers(session: Session, run: Finishing) -> None:
    """The run's positive triggers grouped by sentence, for free-text search."""
    n_keys, state = run.loaded.n_keys, run.state
    parts = []
    for layer in range(run.loaded.n_layers):
        coefficient, sentence, position = state.triggers(layer, 1)  # [keys, T] each
        memory = layer * n_keys + torch.arange(n_keys)[:, None].expand_as(sentence)  # [keys, T]
        parts.append([t.reshape(-1).numpy() for t in (memory, sentence, position, coefficient)])
    memory, sentence, position, coefficient = (np.concatenate(p) for p in zip(*parts, strict=True))
    memory_writes.store_sentence_triggers(
        session=session,
        run_id=run.job.run_id,
        memory=memory,
        sentence_index=sentence,
        position=position,
        coefficient=coefficient,
    )


def store_weight_graph(run: Finishing) -> None:
    """Which memories write into which keys, from the weights (ffmem.worker.composition)."""
    weight_graph_step(run.sessions, run.job.run_id, run.loaded, lease=run.lease)


def explain(run: Finishing) -> None:
    """Every memory described and scored, as the run's spec says (ffmem.worker.explanations)."""
    options = ExplanationOptions.of(run.spec, run.options)
    explanations_step(run.sessions, run.job.run_id, run.loaded, options, lease=run.lease)


def store_neighbours(run: Finishing) -> None:
    """Each memory's nearest memories by key and by value direction (ffmem.worker.neighbours)."""
    neighbours_step(run.sessions, run.job.run_id, run.loaded, lease=run.lease, progress=run.options.progress)


def close(run: Finishing) -> None:
    """The run is done: its job too; the analyses waiting for it get it; its mined layers go."""
    job = run.job
    with run.sessions() as session:
        run.lease.check(session)
        runs.finish_run(session=session, run_id=job.run_id, n_tokens=run.positions)
        jobs.finish_job(session=session, job_id=job.id)
        jobs.attach_analyses(session=session, index_job=job)
        shards.drop_layers(session=session, run_id=job.run_id)
        session.commit()


STEPS: tuple[tuple[str, Callable[[Finishing], None]], ...] = (
    ("shading", shade),
    ("layers", store_layers),
    ("weight_graph", store_weight_graph),
    ("token_change", token_change_step),  # before the explanations: the explainer may read it
    ("explanations", explain),
    ("neighbours", store_neighbours),
    ("closing", close),
)  # the names of `IndexPipeline.timings`


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing where the C library
    is another). Storing the layers frees gigabytes at 131,072 memories, much of it in blocks under the
    allocator's mmap threshold that it would keep otherwise: composition then starts from the size the
    process needs, not the size it reached. Once a finish, as a trim walks the whole heap; and no
    gc.collect: what is freed here has no cycles, and in the test suite collections doubled a finish."""
    try:
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: glibc's where it is glibc
    except (OSError, AttributeError):
        pass
