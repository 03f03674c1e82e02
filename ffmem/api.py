"""The index from Python (a notebook): `ffmem.open(url)` → models → runs → layers → keys, as typed objects,
with `.to_pandas()` wherever a table fits (pandas: `pip install 'ffmem[notebook]'`).

    index = ffmem.open("sqlite:///ffmem.db")
    run = index.model("smollm2-135m").run()          # its newest finished run
    key = run.layer(3).key(17)
    key.triggers.to_pandas()                         # sentence, position, coefficient, prefix, shading
    key.values("norm").to_pandas()                   # both directions of one readout

Every read is the explorer's own (ffmem.store: `results_for`, memory_reads, corpora, memory_search,
composition, memory_labels), so a key here is the key page's. No torch: the engine is ffmem.engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Generic, TypeVar

from sqlalchemy import select

from ffmem.store import (
    analyses,
    composition,
    corpora,
    memory_labels,
    memory_reads,
    memory_search,
    runs,
    value_histograms,
    vocabularies,
)
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.memory_lists import READOUTS
from ffmem.store.models import KeyStats
from ffmem.store.models import LanguageModel as StoredModel
from ffmem.store.models import Run as StoredRun
from ffmem.store.results import results_for

Row = TypeVar("Row")


class Table(list, Generic[Row]):
    """A list of typed rows (dataclasses) that becomes a pandas DataFrame, a column per field."""

    def __init__(self, rows=(), columns: tuple[str, ...] = ()) -> None:
        super().__init__(rows)
        self.columns = columns

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame([asdict(row) for row in self], columns=list(self.columns) or None)


def _table(kind: type, rows) -> Table:
    return Table(rows, tuple(field.name for field in fields(kind)))


@dataclass(frozen=True)
class TriggerRow:
    """A trigger prefix: sentence `sentence_index` up to and including token `position`, where the key's
    coefficient is `coefficient`; `prefix` its text, `token` the trigger token, `next_token` the one after
    (None at the sentence's end); `shading`: the coefficient at every token of the sentence, for the top
    triggers the run shades (None beyond them)."""

    sign: int
    rank: int
    sentence_index: int
    position: int
    coefficient: float
    prefix: str
    token: str
    next_token: str | None
    sentence: str
    shading: list[float] | None


@dataclass(frozen=True)
class ValueRow:
    """One of a value's top (`direction` +1) or bottom (−1) tokens under a readout ("raw": v·Eᵀ, the paper's;
    "norm": lm_head(final_norm(v))), with its logit and its probability over the whole vocabulary."""

    readout: str
    direction: int
    rank: int
    token_id: int
    token: str
    logit: float
    prob: float


@dataclass(frozen=True)
class NeighbourRow:
    """A nearest memory by key or by value (`kind`), with the cosine of the two."""

    kind: str
    layer: int
    key: int
    cosine: float


@dataclass(frozen=True)
class QuadrantRow:
    """A gated key's top example of one sign quadrant (pp, pn, np, nn: gate's sign, then the input's)."""

    quadrant: str
    sentence_index: int
    position: int
    coefficient: float
    input: float
    sentence: str


@dataclass(frozen=True)
class Quadrants:
    """A gated key's share of mined positions in each sign quadrant, and each quadrant's top examples."""

    shares: dict[str, float]
    examples: Table[QuadrantRow]


@dataclass(frozen=True)
class Explanation:
    """A memory's automatic description and how well its pattern predicts the coefficient (held out)."""

    text: str
    source: str
    score: float | None
    details: dict


@dataclass(frozen=True)
class Label:
    """A person's label of a memory (its newest)."""

    pattern: str
    tag: str
    author: str


class Key:
    """One memory of a run: its key's triggers and its value's tokens, statistics, quadrants, neighbours,
    explanation and label, each read when first asked for."""

    def __init__(self, run: Run, layer: int, key: int) -> None:
        self.run, self.layer, self.key = run, layer, key

    def __repr__(self) -> str:
        return f"<Key {self.run.model.slug} run {self.run.id} layer {self.layer} key {self.key}>"

    @property
    def _session(self):
        return self.run.model.index.session

    @cached_property
    def triggers(self) -> Table[TriggerRow]:
        """The strongest positive triggers (m > 0), strongest first."""
        return self._triggers(1)

    @cached_property
    def negative_triggers(self) -> Table[TriggerRow]:
        """The strongest negative triggers (m < 0), lowest first."""
        return self._triggers(-1)

    @cached_property
    def _trigger_lists(self) -> dict[int, list]:
        """sign → the key's stored triggers, with the sentences they point into and the shading of the top
        ones (one read: the stored shading runs over the shaded positive triggers, then the negative)."""
        results, session = self.run.results, self._session
        found = {sign: results.triggers(self.layer, self.key, sign) for sign in (1, -1)}
        sentences = corpora.get_sentences(
            session=session,
            corpus_id=self.run.stored.corpus_id,
            indices=[t.sentence_index for sign in found for t in found[sign]],
        )
        shaded = results.shaded_triggers(self.layer, self.key)
        lit = [*found[1][: shaded[0]], *found[-1][: shaded[1]]]
        lengths = [len(sentences[t.sentence_index].token_ids) for t in lit]
        arrays = results.trigger_shading(self.layer, self.key, lengths)
        shading = {1: arrays[: shaded[0]], -1: arrays[shaded[0] :]}
        return {sign: [found[sign], sentences, shading[sign]] for sign in (1, -1)}

    def _triggers(self, sign: int) -> Table[TriggerRow]:
        found, sentences, shading = self._trigger_lists[sign]
        texts = self.run.model.vocabulary
        rows = []
        for i, trigger in enumerate(found):
            sentence = sentences[trigger.sentence_index]
            ids, end = sentence.token_ids, sentence.offsets[trigger.position][1]
            following = trigger.position + 1
            rows.append(
                TriggerRow(
                    sign=sign,
                    rank=trigger.rank,
                    sentence_index=trigger.sentence_index,
                    position=trigger.position,
                    coefficient=trigger.coefficient,
                    prefix=sentence.text[:end],
                    token=texts.get(ids[trigger.position], ""),
                    next_token=texts.get(ids[following], "") if following < len(ids) else None,
                    sentence=sentence.text,
                    shading=shading[i].tolist() if i < len(shading) else None,
                )
            )
        return _table(TriggerRow, rows)

    @cached_property
    def value_tokens(self) -> Table[ValueRow]:
        """The value's top and bottom tokens under both readouts."""
        readouts = self.run.results.value_readouts(self.layer, self.key)
        texts = self.run.model.vocabulary
        rows = [
            ValueRow(v.readout, v.direction, v.rank, v.token_id, texts.get(v.token_id, ""), v.logit, v.prob)
            for readout in READOUTS
            for direction in (1, -1)
            for v in readouts[readout, direction]
        ]
        return _table(ValueRow, rows)

    def values(self, readout: str = "raw", direction: int | None = None) -> Table[ValueRow]:
        """The value's tokens under one readout ("raw" or "norm"), of one direction (+1 top, −1 bottom)
        or both."""
        if readout not in READOUTS:
            raise ValueError(f"readout is one of {', '.join(READOUTS)}, not {readout!r}")
        return _table(
            ValueRow,
            (
                v
                for v in self.value_tokens
                if v.readout == readout and (direction is None or v.direction == direction)
            ),
        )

    @cached_property
    def stats(self) -> dict | None:
        """The key's statistics over every mined position (KeyStats' columns), None where the run has none."""
        found = self.run.results.key_stats(self.layer, self.key)
        if found is None:
            return None
        return {c.name: getattr(found, c.name) for c in KeyStats.__table__.columns if c.name != "run_id"}

    @cached_property
    def quadrants(self) -> Quadrants | None:
        """A gated key's sign quadrants; None for a plain FF."""
        found = self.run.results.quadrants(self.layer, self.key)
        if found is None:
            return None
        from ffmem.engine.mining.mined_layer import QUADRANTS

        sentences = corpora.get_sentences(
            session=self._session,
            corpus_id=self.run.stored.corpus_id,
            indices=[e.sentence_index for e in found.examples],
        )
        examples = [
            QuadrantRow(
                QUADRANTS[e.quadrant], e.sentence_index, e.position, e.coefficient, e.input,
                sentences[e.sentence_index].text,
            )
            for e in found.examples
        ]  # fmt: skip
        return Quadrants(dict(zip(QUADRANTS, found.shares, strict=True)), _table(QuadrantRow, examples))

    @cached_property
    def value_histograms(self) -> dict | None:
        """readout → the value's logits over the whole vocabulary in equal bins (`edges`, `counts`); None
        where the run stores none."""
        return value_histograms.value_histogram(
            session=self._session, run_id=self.run.id, layer=self.layer, key=self.key
        )

    @cached_property
    def neighbours(self) -> Table[NeighbourRow]:
        """The nearest memories by key, then by value, the nearest first."""
        found = memory_search.get_neighbours(
            session=self._session, run_id=self.run.id, layer=self.layer, key=self.key
        )
        rows = [NeighbourRow(kind, int(lay), int(k), c) for kind, near in found.items() for lay, k, c in near]
        return _table(NeighbourRow, rows)

    @cached_property
    def explanation(self) -> Explanation | None:
        found = composition.get_explanation(
            session=self._session, run_id=self.run.id, layer=self.layer, key=self.key
        )
        return None if found is None else Explanation(found.text, found.source, found.score, found.details)

    @cached_property
    def label(self) -> Label | None:
        """The memory's label (labels belong to the model: every run shows it)."""
        history = memory_labels.label_history(
            session=self._session, model_id=self.run.model.id, layer=self.layer, key=self.key
        )
        return Label(history[0].pattern, history[0].tag, history[0].author) if history else None


class Layer:
    """One FF layer of a run: its keys, and their statistics as a table."""

    def __init__(self, run: Run, layer: int) -> None:
        self.run, self.layer = run, layer

    def __repr__(self) -> str:
        return f"<Layer {self.layer} of run {self.run.id} ({len(self)} keys)>"

    def __len__(self) -> int:
        return self.run.model.n_keys

    def key(self, key: int) -> Key:
        if not 0 <= key < self.run.model.n_keys:
            raise IndexError(f"key {key} is out of range: 0 to {self.run.model.n_keys - 1}")
        return Key(self.run, self.layer, key)

    @property
    def keys(self) -> list[Key]:
        return [Key(self.run, self.layer, key) for key in range(len(self))]

    def to_pandas(self):
        """Every key's statistics in this layer, a row a key."""
        frame = self.run.key_stats()
        return frame[frame["layer"] == self.layer].reset_index(drop=True)


class Run:
    """One index run of a model over a corpus."""

    def __init__(self, model: Model, stored: StoredRun) -> None:
        self.model, self.stored = model, stored
        self.id, self.status = stored.id, stored.status.value
        self.corpus, self.n_sentences, self.n_tokens = stored.corpus.name, stored.n_sentences, stored.n_tokens
        self.top_k, self.started_at, self.finished_at = stored.top_k, stored.started_at, stored.finished_at

    def __repr__(self) -> str:
        return f"<Run {self.id} of {self.model.slug} over {self.corpus} ({self.status})>"

    @cached_property
    def results(self):
        """The explorer's reads of this run (ffmem.store.results: stored, or provisional while it mines)."""
        return results_for(self.model.index.session, self.stored)

    @property
    def layers(self) -> list[Layer]:
        return [Layer(self, layer) for layer in range(self.model.n_layers)]

    def layer(self, layer: int) -> Layer:
        if not 0 <= layer < self.model.n_layers:
            raise IndexError(f"layer {layer} is out of range: 0 to {self.model.n_layers - 1}")
        return Layer(self, layer)

    def key(self, layer: int, key: int) -> Key:
        return self.layer(layer).key(key)

    def sentences(self, indices) -> dict:
        """These sentences of the run's corpus, by index: rows of text, token_ids, offsets."""
        return corpora.get_sentences(
            session=self.model.index.session, corpus_id=self.stored.corpus_id, indices=indices
        )

    def key_stats(self):
        """Every key's statistics, a row a key (layer, key, then KeyStats' columns) as a DataFrame."""
        import pandas as pd

        columns = [c.name for c in KeyStats.__table__.columns if c.name != "run_id"]
        found = memory_reads.run_key_stats(session=self.model.index.session, run_id=self.id, columns=columns)
        return pd.DataFrame([tuple(row) for row in found], columns=columns)

    @cached_property
    def analyses(self) -> dict[str, dict]:
        """The paper's analyses computed on this run: name → their data."""
        stored = analyses.stored_analyses(session=self.model.index.session, run_id=self.id)
        return {name: analysis.data for name, analysis in stored.items()}


class Model:
    """An indexed model: its shape, its runs and its vocabulary."""

    def __init__(self, index: Index, stored: StoredModel) -> None:
        self.index, self.id, self.slug = index, stored.id, stored.slug
        self.source, self.revision, self.architecture = stored.source, stored.revision, stored.architecture
        self.n_layers, self.n_keys, self.d_model = stored.n_layers, stored.n_keys, stored.d_model
        self.vocab_size, self.gated = stored.vocab_size, stored.gated

    def __repr__(self) -> str:
        return f"<Model {self.slug}: {self.n_layers} layers × {self.n_keys} keys>"

    @property
    def runs(self) -> list[Run]:
        query = select(StoredRun).where(StoredRun.model_id == self.id).order_by(StoredRun.id)
        return [Run(self, stored) for stored in self.index.session.scalars(query)]

    def run(self, run_id: int | None = None) -> Run:
        """Run `run_id`, or the newest finished one."""
        session = self.index.session
        if run_id is None:
            stored = runs.latest_finished_run(session=session, model_id=self.id)
            if stored is None:
                raise LookupError(f"{self.slug} has no finished run")
        else:
            stored = runs.get_run(session=session, run_id=run_id)
            if stored is None or stored.model_id != self.id:
                raise LookupError(f"{self.slug} has no run {run_id}")
        return Run(self, stored)

    @cached_property
    def vocabulary(self) -> dict[int, str]:
        """token id → its text as the explorer shows it."""
        return vocabularies.vocabulary(session=self.index.session, model_id=self.id)


class Index:
    """An ffmem database, read-only: its models. Close it (or use `with`) to release the connection."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.session = make_sessionmaker(self.engine)()

    def __repr__(self) -> str:
        return f"<Index {self.engine.url.render_as_string(hide_password=True)}>"

    @property
    def models(self) -> list[Model]:
        return [Model(self, stored) for stored in runs.list_models(session=self.session)]

    def model(self, slug: str | None = None) -> Model:
        """The model `slug`, or the only one."""
        models = self.models
        if slug is None:
            if len(models) != 1:
                raise LookupError(
                    f"name a model: this index holds {', '.join(m.slug for m in models) or 'none'}"
                )
            return models[0]
        for model in models:
            if model.slug == slug:
                return model
        raise LookupError(
            f"no model {slug!r}: this index holds {', '.join(m.slug for m in models) or 'none'}"
        )

    def close(self) -> None:
        self.session.close()
        self.engine.dispose()

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open(url: str) -> Index:  # noqa: A001 - ffmem.open, as the notebook says it
    """The ffmem database at `url` (sqlite:///path or postgresql+psycopg://…), to read from Python."""
    return Index(url)
