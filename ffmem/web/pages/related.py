"""The memories related to one (the key page loads them as a section): the nearest memories by key and by
value direction across all layers, and who feeds it and whom it feeds in the run's weight graph."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ffmem.store import memory_search
from ffmem.store.db import Session
from ffmem.store.models import LanguageModel, Run
from ffmem.web import urls
from ffmem.web.pages.composition import WeightGraphView, weight_graph_view
from ffmem.web.views import ModelPage, RunInfo, run_info


class Neighbour(BaseModel):
    """A memory near another one: its place, the cosine and its page."""

    layer: int
    key: int
    cosine: float
    url: str
    chance: bool | None = Field(
        None,
        description="The cosine is at or below the layer's nearest-neighbour baseline at this rank: no "
        "nearer than an ordinary memory's neighbour of that rank (null: unknown for this run).",
    )


class NeighbourBaseline(BaseModel):
    """What random pairs reach: a memory of this layer and any other memory
    (ffmem.engine.relations.neighbours)."""

    pairs: int = Field(description="Random pairs sampled (fixed, seeded).")
    mean: float = Field(description="Their mean |cosine|.")
    p99: float = Field(description="The 99th percentile of their |cosine|.")
    nearest: list[float] | None = Field(
        None,
        description="Rank r (1 first): the median over this layer's memories of their own r-th nearest "
        "neighbour's cosine; a neighbour at rank r at or below it is marked ≈ chance (null: a run indexed "
        "before it was stored, the baseline is unknown).",
    )


class MemoryNeighbours(BaseModel):
    """A memory's nearest memories across all layers (ffmem.engine.relations.neighbours), the highest cosine
    first."""

    gated: bool = Field(
        description="Key cosine = cos(gate) · cos(up) (the cosine of g·uᵀ); else the cosine of the keys."
    )
    by_key: list[Neighbour]
    by_value: list[Neighbour]
    key_baseline: NeighbourBaseline | None = Field(None, description="Null: a run stored before baselines.")
    value_baseline: NeighbourBaseline | None = None


class RelatedContext(ModelPage):
    """The memories related to one: nearest by direction, and feeding or fed by it in the weight graph (the
    key page loads them as a section)."""

    page: str = "related"
    layer: int
    key: int
    n_layers: int
    run: RunInfo
    neighbours: MemoryNeighbours | None = Field(None, description="Null: not computed for this run (yet).")
    weight_graph: WeightGraphView | None = Field(
        None, description="Who feeds it, whom it feeds (null: not computed)."
    )


def related_page(session: Session, model: LanguageModel, run: Run, layer: int, key: int) -> RelatedContext:
    """The memories related to one: its neighbours by key and value direction, and its weight graph."""
    return RelatedContext(
        title=f"{model.slug}: layer {layer}, key {key}, related memories",
        model=model.slug,
        layer=layer,
        key=key,
        n_layers=model.n_layers,
        run=run_info(run),
        neighbours=memory_neighbours(session, model, run, layer, key),
        weight_graph=weight_graph_view(session, model.slug, run, layer, key),
    )


def memory_neighbours(
    session: Session, model: LanguageModel, run: Run, layer: int, key: int
) -> MemoryNeighbours | None:
    """The memory's nearest memories by key and by value direction, each marked when at or below its layer's
    nearest-neighbour baseline at its rank (none stored: nothing marked), or None when the run has none."""
    found = memory_search.get_neighbours(session=session, run_id=run.id, layer=layer, key=key)
    if not found:
        return None
    stored = memory_search.get_neighbour_baselines(session=session, run_id=run.id, layer=layer)
    baselines = {
        kind: NeighbourBaseline(pairs=b.pairs, mean=b.mean, p99=b.p99, nearest=b.nearest)
        for kind, b in stored.items()
    }

    def view(kind: str) -> list[Neighbour]:
        baseline = baselines.get(kind)
        medians = None if baseline is None else baseline.nearest  # [k], rank 1 first
        return [
            Neighbour(
                layer=int(n_layer),
                key=int(n_key),
                cosine=cosine,
                url=urls.key_url(model.slug, int(n_layer), int(n_key), run=run.id),
                chance=None if medians is None else cosine <= medians[rank],
            )
            for rank, (n_layer, n_key, cosine) in enumerate(found.get(kind, []))
        ]

    return MemoryNeighbours(
        gated=model.gated,
        by_key=view("key"),
        by_value=view("value"),
        key_baseline=baselines.get("key"),
        value_baseline=baselines.get("value"),
    )
