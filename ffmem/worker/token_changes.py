"""The token_change step of finishing a run: a stratified sample of its memories (`token_change_memories`, the
same number from every layer, seeded), each one's TokenChange over the held-out contexts where its key fires
most (`token_change_contexts` of them, among the run's first `explain_sentences` held-out sentences,
ffmem.worker.held_out) and its output score against a control memory's (ffmem.engine.values.token_change);
stored one row a memory (ffmem.store.token_changes), the figures per depth third in the analysis row
"token_change" with its seconds. The sample is committed after the lease is checked."""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from ffmem.engine.live.protocol import CHANGE_FACTOR, CHANGE_TOP
from ffmem.engine.values.token_change import firing_contexts, scored, token_change
from ffmem.store import analyses, token_changes
from ffmem.store.models import Run
from ffmem.worker.held_out import held_out
from ffmem.worker.leases import checked_commit

if TYPE_CHECKING:
    from ffmem.worker.finishing import Finishing

CHUNK = 2048  # memories measured at once, each sentence read once: [CHUNK, vocab] sums (400 MB at 49,152)
SEED = 0


def sample_memories(n_layers: int, n_keys: int, wanted: int, seed: int = SEED) -> list[tuple[int, int]]:
    """`wanted` memories stratified by layer: ⌈wanted / layers⌉ keys of every layer (all of them where the
    layer has fewer), drawn without replacement by a seeded generator, by layer and key."""
    per_layer = min(n_keys, -(-wanted // n_layers))
    draw = random.Random(seed)
    return [
        (layer, key) for layer in range(n_layers) for key in sorted(draw.sample(range(n_keys), per_layer))
    ]


def token_change_step(run: Finishing) -> None:
    """Measure and store the run's sample (nothing when its spec asks for none)."""
    spec, loaded = run.spec, run.loaded
    if spec.token_change_memories <= 0:
        return
    start = time.perf_counter()
    memories = sample_memories(loaded.n_layers, loaded.n_keys, spec.token_change_memories)
    with run.sessions() as session:
        held = held_out(session, session.get(Run, run.job.run_id), spec.explain_sentences, loaded)
    sentences = [s.token_ids for s in held]
    with loaded.lock:
        contexts = firing_contexts(
            loaded,
            sentences,
            [max(s.first_position, 1) for s in held],
            memories,
            per_memory=spec.token_change_contexts,
            batch_tokens=spec.batch_tokens,
            pad_id=run.pad_id,
        )
    rows = []
    for first in tqdm(
        range(0, len(memories), CHUNK), desc="token change", unit="chunk", disable=not run.options.progress
    ):
        chunk, wanted = memories[first : first + CHUNK], contexts[first : first + CHUNK]
        with loaded.lock:
            found = token_change(loaded, sentences, chunk, wanted, factor=CHANGE_FACTOR, probabilities=False)
            scores = scored(loaded, found, chunk, CHANGE_TOP)
        for row, ((layer, key), score) in enumerate(zip(chunk, scores, strict=True)):
            if not found.contexts[row]:
                continue  # its key never fires on the held-out sentences
            change = found.change[row]  # [vocab]
            rows.append(
                dict(
                    layer=layer,
                    key=key,
                    contexts=found.contexts[row],
                    promoted=change.topk(CHANGE_TOP).indices.tolist(),
                    suppressed=change.topk(CHANGE_TOP, largest=False).indices.tolist(),
                    overlap=score.score.overlap,
                    spearman=score.score.spearman,
                    control_key=score.control_key,
                    control_overlap=score.control.overlap,
                    control_spearman=score.control.spearman,
                )
            )
    seconds = time.perf_counter() - start
    options = {
        "memories": spec.token_change_memories,
        "contexts": spec.token_change_contexts,
        "factor": CHANGE_FACTOR,
        "top": CHANGE_TOP,
        "held_out_sentences": len(held),
        "seed": SEED,
    }
    with run.sessions() as session:
        token_changes.delete_token_changes(session=session, run_id=run.job.run_id)
        token_changes.store_token_changes(session=session, run_id=run.job.run_id, rows=rows)
        analyses.store_analysis(
            session=session,
            run_id=run.job.run_id,
            name="token_change",
            options=options,
            data=depth_summary(rows, loaded.n_layers) | {"sampled": len(memories), "measured": len(rows)},
            seconds=seconds,
        )
        checked_commit(session, run.lease)


def depth_summary(rows: list[dict], n_layers: int) -> dict:
    """Per depth third (lower, middle, upper layers) the medians of the output scores and of the controls'."""
    thirds = {}
    for third, name in enumerate(("lower", "middle", "upper")):
        inside = [r for r in rows if r["layer"] * 3 // n_layers == third]
        thirds[name] = {
            "memories": len(inside),
            **{
                figure: statistics.median(r[figure] for r in inside) if inside else None
                for figure in ("overlap", "spearman", "control_overlap", "control_spearman")
            },
        }
    return {"thirds": thirds}
