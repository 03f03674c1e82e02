"""How a run's memories work together, computed once per run after its triggers are stored (the
weight_graph and explanations steps of `IndexPipeline.finish`, under the job's lease; `compose` runs both
for a run stored before, and bench/weight_graph.py):

- the weight graph (ffmem.engine.relations.weight_graph): for every memory the 10 earlier memories whose
  values write most into its key and the 10 later keys that read its value most, from the weights alone;
- explanations (ffmem.worker.explanations): for every memory a short description read off the index,
  scored on the run's held-out sentences.

Each step's figures and seconds are stored in `analyses` ("weight_graph", "explanations").
"""

from __future__ import annotations

import time
from dataclasses import asdict

import httpx
from sqlalchemy.orm import sessionmaker

from ffmem.config import get_settings
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.relations.weight_graph import TOP, weight_graph
from ffmem.store import analyses, composition
from ffmem.worker.explanations import ExplanationOptions, store_explanations
from ffmem.worker.leases import Heartbeat, checked_commit


def compose(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ExplanationOptions | None = None,
    client: httpx.Client | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Compute and store run `run_id`'s weight graph and explanations (replacing any), outside an index
    job; seconds of each. `options` default to the settings; `client`: the HTTP client of the local
    explainer (default: one for `options.explainer_url`)."""
    options = options or ExplanationOptions.from_settings(get_settings(), progress=progress)
    return {
        "weight_graph": weight_graph_step(sessions, run_id, loaded),
        "explanations": explanations_step(sessions, run_id, loaded, options, client),
    }


def weight_graph_step(
    sessions: sessionmaker, run_id: int, loaded: LoadedModel, lease: Heartbeat | None = None
) -> float:
    """The weight graph of the run's model, stored with its analysis row (each commit after `lease` is
    checked, when there is one); its seconds."""
    start = time.perf_counter()
    links = store_weight_graph(sessions, run_id, loaded, lease)
    seconds = time.perf_counter() - start
    _record(sessions, run_id, "weight_graph", {"top": TOP}, links, seconds, lease)
    return seconds


def explanations_step(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ExplanationOptions,
    client: httpx.Client | None = None,
    lease: Heartbeat | None = None,
) -> float:
    """Every memory's explanation, scored and stored with the step's analysis row (each commit after
    `lease` is checked, when there is one); its seconds."""
    start = time.perf_counter()
    summary = store_explanations(sessions, run_id, loaded, options, client, lease)
    seconds = time.perf_counter() - start
    public = asdict(options) | {"explainer_url": bool(options.explainer_url)}  # never store the address
    _record(sessions, run_id, "explanations", public, summary, seconds, lease)
    return seconds


def store_weight_graph(
    sessions: sessionmaker, run_id: int, loaded: LoadedModel, lease: Heartbeat | None = None
) -> dict:
    """The weight graph of the run's model, stored; what was stored and how long each part took."""
    start = time.perf_counter()
    graph = weight_graph(loaded)
    computed = time.perf_counter() - start
    with sessions() as session:
        composition.delete_links(session=session, run_id=run_id)
        rows = composition.store_links(
            session=session,
            run_id=run_id,
            links={
                "in": (graph.inbound_layer.numpy(), graph.inbound_key.numpy(), graph.inbound_score.numpy()),
                "out": (
                    graph.outbound_layer.numpy(),
                    graph.outbound_key.numpy(),
                    graph.outbound_score.numpy(),
                ),
            },
        )
        checked_commit(session, lease)
    return {
        "rows": rows,
        "compute_seconds": computed,
        "store_seconds": time.perf_counter() - start - computed,
    }


def _record(
    sessions: sessionmaker,
    run_id: int,
    name: str,
    options: dict,
    data: dict,
    seconds: float,
    lease: Heartbeat | None = None,
) -> None:
    """Store one step's analysis row in its own transaction."""
    with sessions() as session:
        analyses.store_analysis(
            session=session, run_id=run_id, name=name, options=options, data=data, seconds=seconds
        )
        checked_commit(session, lease)
