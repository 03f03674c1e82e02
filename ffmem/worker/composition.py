"""How a run's memories work together, computed once per run after its triggers are stored (the
composition step of `IndexPipeline.finish` calls `compose`; it also serves runs stored before, and
bench/weight_graph.py):

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


def compose(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ExplanationOptions | None = None,
    client: httpx.Client | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Compute and store run `run_id`'s weight graph and explanations (replacing any); seconds of each.
    `options` default to the settings; `client`: the HTTP client of the local explainer (default: one
    for `options.explainer_url`)."""
    options = options or ExplanationOptions.from_settings(get_settings(), progress=progress)
    seconds = {}
    start = time.perf_counter()
    links = store_weight_graph(sessions, run_id, loaded)
    seconds["weight_graph"] = time.perf_counter() - start
    _record(sessions, run_id, "weight_graph", {"top": TOP}, links, seconds["weight_graph"])
    start = time.perf_counter()
    summary = store_explanations(sessions, run_id, loaded, options, client)
    seconds["explanations"] = time.perf_counter() - start
    public = asdict(options) | {"explainer_url": bool(options.explainer_url)}  # never store the address
    _record(sessions, run_id, "explanations", public, summary, seconds["explanations"])
    return seconds


def store_weight_graph(sessions: sessionmaker, run_id: int, loaded: LoadedModel) -> dict:
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
        session.commit()
    return {
        "rows": rows,
        "compute_seconds": computed,
        "store_seconds": time.perf_counter() - start - computed,
    }


def _record(
    sessions: sessionmaker, run_id: int, name: str, options: dict, data: dict, seconds: float
) -> None:
    """Store one step's analysis row in its own transaction."""
    with sessions() as session:
        analyses.store_analysis(
            session=session, run_id=run_id, name=name, options=options, data=data, seconds=seconds
        )
        session.commit()
