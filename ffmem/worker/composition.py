"""How a run's memories work together, computed once per run after its triggers are stored
(`Worker.finish` calls `compose`; `compose` also serves runs stored before, and bench/weight_graph.py):

- the weight graph (ffmem.engine.weight_graph): for every memory the 10 earlier memories whose values
  write most into its key and the 10 later keys that read its value most, from the weights alone;
- explanations (ffmem.engine.explanations): for every memory a short description read off the index
  (how its top triggers end, the words that set them apart, its value's top tokens, its shallowness),
  scored on the run's held-out sentences (ffmem.worker.held_out), the same ones the census analysis
  samples (worker/analysis_jobs.py), `explain_sentences` of them. A run with none held out leaves the
  explanations unscored.

With `explainer_url` set, a local model behind that OpenAI-compatible URL writes each description
instead (`LocalExplainer`): it gets the same evidence, answers in JSON with the tokens its pattern
matches, and is scored the same way; a key it fails on keeps the heuristic description. Nothing is
sent anywhere unless the setting is set.

Each step's figures and seconds are stored in `analyses` ("weight_graph", "explanations").
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import httpx
import numpy as np
import torch
from sqlalchemy import delete, select
from sqlalchemy.orm import sessionmaker
from tqdm.auto import tqdm

from ffmem.config import Settings, get_settings
from ffmem.engine.corpus import length_bucketed_batches
from ffmem.engine.errors import FfmemError
from ffmem.engine.explanations import (
    LONGEST,
    MAX_CONTEXT,
    MAX_FINAL,
    Description,
    Pattern,
    PatternScores,
    describe,
    document_frequency,
    word_like,
)
from ffmem.engine.hooks import capture
from ffmem.engine.loading import LoadedModel
from ffmem.engine.weight_graph import TOP, weight_graph
from ffmem.store import composition, queries
from ffmem.store.memory_lists import TRIGGERS, decode_triggers
from ffmem.store.models import Analysis, KeyStats, MemoryList, Run, Token
from ffmem.worker.held_out import held_out

HEURISTIC = "heuristic"


@dataclass
class ComposeOptions:
    """What `compose` needs besides the run and its model (defaults: the settings of the same names)."""

    explain_sentences: int = Settings.model_fields["explain_sentences"].default
    batch_tokens: int = Settings.model_fields["batch_tokens"].default
    explainer_url: str = ""
    explainer_model: str = ""
    explainer_timeout: float = Settings.model_fields["explainer_timeout"].default
    progress: bool = False

    @classmethod
    def from_settings(cls, settings: Settings, progress: bool = False) -> ComposeOptions:
        return cls(
            explain_sentences=settings.explain_sentences,
            batch_tokens=settings.batch_tokens,
            explainer_url=settings.explainer_url,
            explainer_model=settings.explainer_model,
            explainer_timeout=settings.explainer_timeout,
            progress=progress,
        )


def compose(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ComposeOptions | None = None,
    client: httpx.Client | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Compute and store run `run_id`'s weight graph and explanations (replacing any); seconds of each.
    `options` default to the settings; `client`: the HTTP client of the local explainer (default: one
    for `options.explainer_url`)."""
    options = options or ComposeOptions.from_settings(get_settings(), progress=progress)
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
        rows = {
            direction: composition.store_links(
                session=session,
                run_id=run_id,
                direction=direction,
                layers=layers.numpy(),
                keys=keys.numpy(),
                scores=scores.numpy(),
            )
            for direction, layers, keys, scores in (
                ("in", graph.inbound_layer, graph.inbound_key, graph.inbound_score),
                ("out", graph.outbound_layer, graph.outbound_key, graph.outbound_score),
            )
        }
        session.commit()
    return {
        "rows": rows,
        "compute_seconds": computed,
        "store_seconds": time.perf_counter() - start - computed,
    }


# ---- explanations -------------------------------------------------------------------------------


@dataclass
class Evidence:
    """What the index knows about one memory."""

    layer: int
    key: int
    prefixes: list[list[int]]  # top positive trigger prefixes, the strongest first
    value_tokens: list[int]  # the value's top tokens (norm readout), the strongest first
    shallowness: float | None
    heuristic: Description  # read off the rest (ffmem.engine.explanations.describe)


def store_explanations(
    sessions: sessionmaker,
    run_id: int,
    loaded: LoadedModel,
    options: ComposeOptions,
    client: httpx.Client | None = None,
) -> dict:
    """Describe every memory of the run, score the descriptions on held-out sentences and store them."""
    timings = {}
    start = time.perf_counter()
    with sessions() as session:
        run = session.get(Run, run_id)
        if run is None:
            raise FfmemError(f"there is no run {run_id}")
        n_layers, n_keys = run.model.n_layers, run.model.n_keys
        sentences = queries.load_sentence_tokens(session=session, corpus_id=run.corpus_id)
        query = select(Token.token_id, Token.text).where(Token.model_id == run.model_id)
        vocabulary = dict(session.execute(query).all())
        texts = [
            vocabulary.get(i, "") for i in range(max(len(loaded.tokenizer), max(vocabulary, default=0) + 1))
        ]
        shown = queries.vocabulary(session=session, model_id=run.model_id)  # byte tokens as ⟨0x80⟩
        names = [shown.get(i, text) for i, text in enumerate(texts)]
        stats = session.execute(
            select(KeyStats.layer, KeyStats.key, KeyStats.max_coefficient, KeyStats.shallowness).where(
                KeyStats.run_id == run_id
            )
        ).all()
        fires_at = torch.full((n_layers, n_keys), float("nan"))
        shallowness = {}
        for layer, key, largest, shallow in stats:
            if largest is not None and largest > 0:
                fires_at[layer, key] = largest / 2
            shallowness[layer, key] = shallow
        frequency = document_frequency(sentences, len(texts))
        words = word_like(texts)
        evidence: list[list[Evidence]] = []
        for layer in tqdm(range(n_layers), desc="describing", unit="layer", disable=not options.progress):
            prefixes = _layer_prefixes(session, run_id, layer, n_keys, sentences)
            value_ids, _ = queries.layer_value_tokens(
                session=session, run_id=run_id, layer=layer, readout="norm", direction=1, n=5
            )
            row = []
            for key in range(n_keys):
                values = value_ids[key].tolist() if key < len(value_ids) else []
                shallow = shallowness.get((layer, key))
                heuristic = describe(prefixes[key], values, shallow, frequency, words, names)
                row.append(Evidence(layer, key, prefixes[key], values, shallow, heuristic))
            evidence.append(row)
    timings["describe_seconds"] = time.perf_counter() - start

    descriptions = {(e.layer, e.key): (HEURISTIC, e.heuristic) for row in evidence for e in row}
    failures = 0
    if options.explainer_url or client is not None:
        start = time.perf_counter()
        explainer = LocalExplainer(options, loaded, texts, client)
        for row in tqdm(evidence, desc="asking the local model", unit="layer", disable=not options.progress):
            for found in row:
                written = explainer.describe(found)
                if written is None:
                    failures += 1
                else:
                    descriptions[found.layer, found.key] = (
                        f"llm:{options.explainer_model or 'default'}",
                        written,
                    )
        timings["explainer_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    with sessions() as session:
        held = held_out(session, session.get(Run, run_id), options.explain_sentences, loaded)
    patterns = [[descriptions[layer, key][1].pattern for key in range(n_keys)] for layer in range(n_layers)]
    scores = score_patterns(loaded, patterns, fires_at, held, options)
    timings["score_seconds"] = time.perf_counter() - start

    start = time.perf_counter()
    rows = []
    for layer in range(n_layers):
        for key, score in enumerate(scores[layer]):
            source, description = descriptions[layer, key]
            details = score.details() if held else {"positions": 0, "matches": 0, "auroc": None}
            rows.append(
                (
                    layer,
                    key,
                    source,
                    description.text,
                    score.correlation,
                    description.pattern.to_dict(),
                    details,
                )
            )
    with sessions() as session:
        composition.delete_explanations(session=session, run_id=run_id)
        composition.store_explanations(session=session, run_id=run_id, rows=rows)
        session.commit()
        summary = composition.explanation_summary(session=session, run_id=run_id)
    timings["store_seconds"] = time.perf_counter() - start
    correlations = np.array([r[4] for r in rows if r[4] is not None], dtype=np.float64)
    aurocs = np.array([r[6]["auroc"] for r in rows if r[6]["auroc"] is not None], dtype=np.float64)
    return (
        summary
        | timings
        | {
            "held_out_sentences": len(held),
            "held_out_positions": scores[0][0].positions if held and scores and scores[0] else 0,
            "median_score": float(np.median(correlations)) if correlations.size else None,
            "median_auroc": float(np.median(aurocs)) if aurocs.size else None,
            "explainer_failures": failures,
        }
    )


def _layer_prefixes(
    session, run_id: int, layer: int, n_keys: int, sentences: list[list[int]]
) -> list[list[list[int]]]:
    """Each key's top positive trigger prefixes (token ids), the strongest first."""
    rows = session.execute(
        select(MemoryList.key, MemoryList.data).where(
            MemoryList.run_id == run_id,
            MemoryList.kind == TRIGGERS,
            MemoryList.sign == 1,
            MemoryList.layer == layer,
        )
    ).all()
    prefixes: list[list[list[int]]] = [[] for _ in range(n_keys)]
    for key, data in rows:
        for sentence, position, _ in decode_triggers(data).tolist():  # strongest first
            prefixes[key].append(sentences[sentence][: position + 1])
    return prefixes


def score_patterns(
    loaded: LoadedModel,
    patterns: list[list[Pattern]],
    fires_at: torch.Tensor,
    held_out: list,
    options: ComposeOptions,
):
    """Each pattern's PatternScore on the held-out sentences (positions from the sentence's first mined
    one, and never position 0, where the attention sink gives some keys outsized coefficients)."""
    scores = PatternScores(patterns, fires_at, device=loaded.device)
    if held_out:
        ids = [s.token_ids for s in held_out]
        first = [max(s.first_position, 1) for s in held_out]
        pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
        batches = list(
            length_bucketed_batches(
                ids, first, indices=range(len(ids)), batch_tokens=options.batch_tokens, pad_id=pad
            )
        )
        current = []

        def fold(layer: int, coefficients: torch.Tensor) -> None:
            batch = current[0]
            scores.update(
                layer, coefficients, batch.input_ids, batch.mined
            )  # coefficients: [batch, pos, keys]

        with (
            loaded.lock,
            torch.inference_mode(),
            capture(loaded.model, loaded.adapter, fields=("coefficients",), on_coefficients=fold),
        ):
            for batch in tqdm(
                batches, desc="scoring explanations", unit="batch", disable=not options.progress
            ):
                current[:] = [batch.to(loaded.device)]
                loaded.model.base_model(
                    input_ids=current[0].input_ids, attention_mask=current[0].attention_mask, use_cache=False
                )
    return [scores.scores(layer) for layer in range(len(patterns))]


def _record(
    sessions: sessionmaker, run_id: int, name: str, options: dict, data: dict, seconds: float
) -> None:
    with sessions() as session:
        session.execute(delete(Analysis).where(Analysis.run_id == run_id, Analysis.name == name))
        session.add(
            Analysis(
                run_id=run_id,
                name=name,
                options=options,
                data=data,
                seconds=seconds,
                created_at=datetime.now(timezone.utc),
            )
        )
        session.commit()


# ---- an optional local model --------------------------------------------------------------------

PROMPT = """You describe one memory of a transformer language model's feed-forward layer.
Its key fires most on the last token of these text prefixes (the trigger token is in ⟦ ⟧):
{prefixes}
Automatic summary: {heuristic}
Answer in JSON only: {{"description": "<at most 15 words: what the prefixes have in common>", \
"ends_with": ["<tokens or short phrases the prefixes end with>"], "context": ["<words earlier in the \
prefixes that mark the pattern>"]}}"""


class LocalExplainer:
    """Descriptions written by a local model behind an OpenAI-compatible URL (`/chat/completions`)."""

    def __init__(self, options: ComposeOptions, loaded: LoadedModel, texts: list[str], client=None):
        self.options = options
        self.tokenizer = loaded.tokenizer
        self.texts = texts
        self.client = client or httpx.Client(
            base_url=options.explainer_url, timeout=options.explainer_timeout
        )

    def prompt(self, evidence: Evidence) -> str:
        shown = []
        for ids in evidence.prefixes[:10]:
            head = "".join(self.texts[t] for t in ids[-12:-1])
            shown.append(f"- …{head}⟦{self.texts[ids[-1]]}⟧")
        return PROMPT.format(prefixes="\n".join(shown) or "(none)", heuristic=evidence.heuristic.text)

    def describe(self, evidence: Evidence) -> Description | None:
        """The local model's description of one memory, or None when it gave no usable answer."""
        body = {"messages": [{"role": "user", "content": self.prompt(evidence)}], "temperature": 0}
        if self.options.explainer_model:
            body["model"] = self.options.explainer_model
        try:
            answer = self.client.post("chat/completions", json=body)
            answer.raise_for_status()
            content = answer.json()["choices"][0]["message"]["content"]
            found = json.loads(re.search(r"\{.*\}", content, re.S).group(0))
            text = str(found["description"]).strip()
        except (httpx.HTTPError, KeyError, IndexError, TypeError, AttributeError, ValueError):
            return None
        if not text:
            return None
        final, ngram = [], []
        for phrase in _strings(found.get("ends_with")):
            ids = self._ids(phrase)
            if len(ids) == 1 and len(final) < MAX_FINAL and ids[0] not in final:
                final.append(ids[0])
            elif len(ids) > 1 and not ngram:
                ngram = ids[-LONGEST:]
        context = []
        for word in _strings(found.get("context")):
            ids = self._ids(word)
            if ids and len(context) < MAX_CONTEXT and ids[0] not in context:
                context.append(ids[0])
        return Description(text=text[:500], pattern=Pattern(final=final, ngram=ngram, context=context))

    def _ids(self, phrase: str) -> list[int]:
        """The phrase's token ids as the prefixes would hold it: with a leading space when it fits in fewer
        tokens that way (a word inside a sentence)."""
        plain = self.tokenizer(phrase, add_special_tokens=False).input_ids
        spaced = self.tokenizer(" " + phrase.lstrip(), add_special_tokens=False).input_ids
        return spaced if len(spaced) <= len(plain) else plain


def _strings(value) -> list[str]:
    return [v for v in value if isinstance(v, str) and v.strip()] if isinstance(value, list) else []
