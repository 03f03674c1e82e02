"""Each memory's nearest memories by key and by value direction, with what chance reaches (the neighbours step
of `IndexPipeline.finish`, under the job's lease): computed on the run's model
(ffmem.engine.relations.neighbours) and stored, replacing any the run had (ffmem.store.memory_search)."""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker
from tqdm.auto import tqdm

from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.neighbours import memory_baselines, memory_neighbours, nearest_baseline
from ffmem.store import memory_search
from ffmem.worker.leases import Heartbeat, checked_commit


def neighbours_step(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    lease: Heartbeat | None = None,
    progress: bool = False,
) -> None:
    """Run `run_id`'s neighbours and their baselines, stored and committed after `lease` is checked (when
    there is one): a worker that lost its job stores nothing. They need no corpus, but at prepare they would
    hold back the run's first results; so they add to its finish."""
    bar = tqdm(desc="neighbours", unit="block pair", disable=not progress)

    def report(kind: str, done: int, total: int) -> None:  # keys, then values: `total` pairs each
        bar.total = 2 * total
        bar.set_description(f"neighbours by {kind}", refresh=False)
        bar.n = done + (total if kind == "value" else 0)
        bar.refresh()

    found = memory_neighbours(loaded, report=report)
    bar.close()
    neighbours = {kind: (index.numpy(), cosine.numpy()) for kind, (index, cosine) in found.items()}
    nearest = {kind: nearest_baseline(cosines, loaded.n_keys).numpy() for kind, (_, cosines) in found.items()}
    with sessions() as session:
        memory_search.store_neighbours(
            session=session,
            run_id=run_id,
            n_keys=loaded.n_keys,
            neighbours=neighbours,
            baselines=memory_baselines(loaded),  # what random pairs reach, per layer
            nearest=nearest,  # what any memory's r-th nearest reaches, per layer
        )
        checked_commit(session, lease)
