"""Page builders: a session and validated parameters in, one context (ffmem.web.contexts) out.

They raise AppError for anything a person asked for that does not exist, with the valid range
or the known names in the message.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np
from sqlalchemy.orm import Session, object_session

from ffmem.engine.model_names import slugify
from ffmem.store import jobs, key_examples, memory_search, queries
from ffmem.store.memory_lists import READOUTS
from ffmem.store.memory_lists import Trigger as TriggerRow
from ffmem.store.models import Job, JobKind, JobStatus, Label, LanguageModel, Run, Sentence
from ffmem.store.results import has_results, results_for
from ffmem.web import patterns, token_search, urls
from ffmem.web.composition_view import explanation_hits, key_explanation, weight_graph_view
from ffmem.web.contexts import (
    Agreement,
    BandSample,
    CorpusChoice,
    Histogram,
    HomeContext,
    JobContext,
    JobInfo,
    JobsContext,
    KeyContext,
    KeyRow,
    KeyStatsView,
    LabelHit,
    LabelView,
    LayerContext,
    Links,
    MemoryNeighbours,
    ModelContext,
    ModelEntry,
    ModelInfo,
    Neighbour,
    NeighbourBaseline,
    Progress,
    RelatedContext,
    RunInfo,
    SamplesContext,
    SearchContext,
    SentenceKey,
    SentenceMatch,
    ShadedText,
    StartHere,
    TextPart,
    TokenMatch,
    TokenScore,
    Trigger,
    ValueReadout,
)
from ffmem.web.display import percent, visible
from ffmem.web.errors import AppError
from ffmem.web.shading import shade, token_pieces

KEY_JUMP = re.compile(
    r"^\s*(?:L\s*)?(\d+)\s*(?:/|\s+|,)\s*(?:K\s*)?(\d+)\s*$|^\s*L\s*(\d+)\s*K\s*(\d+)\s*$", re.I
)
VISIBLE_SPACE = "\u2423"  # ␣


# ---- shared lookups -----------------------------------------------------------------------------


BUILDING_RETRY = 10  # seconds a client waits before asking again for a model whose index is being built


def model_or_404(session: Session, slug: str) -> LanguageModel:
    model = queries.get_model(session=session, slug=slug)
    if model is None:
        for job in jobs.preparing(session=session):
            if slugify(str(job.options.get("model", ""))) == slug:
                raise being_built(job, f"Job {job.id} is preparing the index of {slug!r}")
        known = [m.slug for m in queries.list_models(session=session)]
        listed = ", ".join(known) if known else "none yet (build one with `ffmem index`)"
        raise AppError(404, "Unknown model", f"There is no model {slug!r}. Known models: {listed}.")
    return model


def being_built(job: Job, what: str) -> AppError:
    """A 503 for a page whose index job `job` has not stored what it shows yet: what it is doing, how far
    it is, and a link to its page."""
    if job.status == JobStatus.queued:
        doing = "queued, waiting for a worker"
    elif job.run is None:
        doing = "loading the model, reading the corpus and projecting the values"
    else:
        mined = jobs.progress(session=object_session(job), run=job.run).fraction
        doing = f"{percent(mined)} of the corpus mined; pages show its results from the first checkpoint"
    message = f"{what} ({doing}). Its progress: {urls.job_url(job.id)}"
    headers = {"Retry-After": str(BUILDING_RETRY)}
    return AppError(503, "Index being built", message, headers, link=(urls.job_url(job.id), f"job {job.id}"))


def run_or_404(session: Session, model: LanguageModel, run_id: int | None) -> Run:
    """The pinned run (`?run=`), or the model's newest finished one, or else the run being built
    (provisional results) once it has mined something."""
    if run_id is None:
        run = queries.latest_finished_run(session=session, model_id=model.id)
        if run is None:
            building = jobs.building(session=session, model_id=model.id)
            if building is not None and has_results(session, building.run):
                return building.run
            if building is not None:
                raise being_built(
                    building, f"Job {building.id} is building the first index of {model.slug!r}"
                )
            raise AppError(404, "No finished index", f"Model {model.slug!r} has no finished index run yet.")
        return run
    run = queries.get_run(session=session, run_id=run_id)
    if run is None or run.model_id != model.id:
        known = ", ".join(str(r.id) for r in model.runs) or "none"
        raise AppError(404, "Unknown run", f"Model {model.slug!r} has no run {run_id}. Its runs: {known}.")
    if run.status == "failed":
        raise AppError(404, "Run failed", f"Run {run_id} failed; its results are not stored.")
    if not has_results(session, run):
        raise AppError(404, "Run not started", f"Run {run_id} has mined nothing yet.")
    return run


def check_layer(model: LanguageModel, layer: int) -> None:
    if not 0 <= layer < model.n_layers:
        raise AppError(
            404,
            "Layer not found",
            f"{model.slug} has layers 0–{model.n_layers - 1}; there is no layer {layer}.",
        )


def check_key(model: LanguageModel, layer: int, key: int) -> None:
    check_layer(model, layer)
    if not 0 <= key < model.n_keys:
        raise AppError(
            404, "Key not found", f"Layer {layer} has keys 0–{model.n_keys - 1}; there is no key {key}."
        )


def key_run_or_404(
    session: Session, slug: str, layer: int, key: int, run_id: int | None
) -> tuple[LanguageModel, Run]:
    """A key's model and run (the pinned one or the newest, as run_or_404), each checked to exist."""
    model = model_or_404(session, slug)
    check_key(model, layer, key)
    return model, run_or_404(session, model, run_id)


def run_info(run: Run) -> RunInfo:
    building = None
    if run.status == "running":  # the job building it, and how far it has mined (beyond its checkpoints)
        session = object_session(run)
        building = session.scalars(jobs.builders(run.id).order_by(Job.id.desc()).limit(1)).first()
    return RunInfo(
        job=building,
        mined=jobs.progress(session=object_session(run), run=run).fraction if building else None,
        id=run.id,
        status=run.status,
        corpus=run.corpus.name,
        n_sentences=run.n_sentences,
        n_tokens=run.n_tokens,
        top_k=run.top_k,
        n_value_tokens=run.n_value_tokens,
        dtype=run.dtype,
        device=run.device,
        package_version=run.package_version,
        started_at=run.started_at,
        finished_at=run.finished_at,
        provenance=run.provenance,
        error=run.error,
    )


def label_view(label: Label) -> LabelView:
    return LabelView(
        id=label.id, pattern=label.pattern, tag=label.tag, author=label.author, created_at=label.created_at
    )


def model_info(model: LanguageModel) -> ModelInfo:
    return ModelInfo.model_validate(model, from_attributes=True)


def trigger_view(
    row: TriggerRow, sentence: Sentence, texts: dict[int, str], value_ids: list[int] | None = None
) -> Trigger:
    """A stored trigger with its prefix, trigger token and next token read off the sentence."""
    ids, offsets = sentence.token_ids, sentence.offsets
    start, end = offsets[row.position]
    following = ids[row.position + 1] if row.position + 1 < len(ids) else None
    return Trigger(
        rank=row.rank,
        coefficient=row.coefficient,
        prefix=sentence.text[:end],
        trigger_start=min(start, end),
        trigger_token=texts.get(ids[row.position], ""),
        trigger_token_id=ids[row.position],
        next_token=None if following is None else texts.get(following, ""),
        next_token_id=following,
        sentence=sentence.text,
        sentence_index=row.sentence_index,
        position=row.position,
        value_rank=value_ids.index(following) if value_ids and following in value_ids else None,
    )


def _sample_view(sample: key_examples.BandSample, sentence: Sentence, labels: list[str]) -> BandSample:
    """A band sample with its band's range (`labels`: bin_labels of the run's edges) and its sentence."""
    return BandSample(
        bin=sample.bin,
        band=labels[sample.bin],
        sign=1 if sample.coefficient > 0 else -1,
        coefficient=sample.coefficient,
        sentence_index=sample.sentence_index,
        position=sample.position,
        sentence=sentence.text,
    )


def _shading_scale(positive: list[TriggerRow], negative: list[TriggerRow]) -> float:
    """The |m| that shades fully on a key's pages: that of its strongest trigger of either sign."""
    return max((abs(t.coefficient) for t in positive[:1] + negative[:1]), default=0.0)


def _shading(sentence: Sentence, values, position: int, texts: dict[int, str], scale: float) -> ShadedText:
    """A stored sentence shaded by its stored coefficients (NaN: not mined, unshaded), trigger outlined."""
    alone = [texts.get(i, "") for i in sentence.token_ids]
    pieces = token_pieces(sentence.text, [tuple(o) for o in sentence.offsets], alone)
    coefficients = [None if math.isnan(v) else v for v in values.astype(np.float64).tolist()]
    return shade(pieces, coefficients, peak=position, prefix_end=position, scale=scale)


def positive_triggers(session: Session, run: Run, layer: int, key: int, limit: int) -> list[TriggerRow]:
    """A key's strongest positive triggers: stored, or merged so far while its run mines."""
    return results_for(session, run).triggers(layer, key, 1, limit)


def _trigger_token_ids(rows: list[TriggerRow], sentences: dict[int, Sentence]) -> set[int]:
    """The trigger and next token ids of these triggers (for one vocabulary lookup)."""
    found = set()
    for row in rows:
        ids = sentences[row.sentence_index].token_ids
        found.update(ids[row.position : row.position + 2])
    return found


# ---- pages --------------------------------------------------------------------------------------


EXAMPLE_PROMPT = "The capital of France is"


def home_page(session: Session, corpora: list[CorpusChoice] | None = None) -> HomeContext:
    """`corpora`: those the index form offers (ffmem/web/corpora.py)."""
    models = queries.list_models(session=session)
    entries = [ModelEntry(model=model_info(m), runs=[run_info(r) for r in reversed(m.runs)]) for m in models]
    recent = [JobInfo.model_validate(job, from_attributes=True) for job in jobs.recent_jobs(session=session)]
    return HomeContext(
        title="ffmem: feed-forward memories",
        models=entries,
        jobs=recent,
        start=start_here(session, models),
        corpora=corpora or [],
    )


def start_here(session: Session, models: list[LanguageModel]) -> StartHere | None:
    """The next steps for a newcomer, on the first model with a finished index run."""
    for model in models:
        if queries.latest_finished_run(session=session, model_id=model.id) is not None:
            slug = model.slug
            return StartHere(
                model=slug,
                prompt=EXAMPLE_PROMPT,
                live_view=urls.trace_url(slug, text=EXAMPLE_PROMPT),
                search=urls.search_url(slug),
                analysis=urls.analysis_url(slug),
                layers=urls.model_url(slug),
                top_layer=urls.layer_url(slug, model.n_layers - 1, sort="agreement", order="desc"),
            )
    return None


def jobs_page(session: Session, *, limit: int) -> JobsContext:
    found = jobs.recent_jobs(session=session, limit=limit)
    listed = [JobInfo.model_validate(job, from_attributes=True) for job in found]
    return JobsContext(title="ffmem: jobs", jobs=listed, limit=limit)


def job_page(session: Session, job_id: int, *, max_attempts: int | None = None) -> JobContext:
    job = session.get(Job, job_id)
    if job is None:
        raise AppError(404, "Unknown job", f"There is no job {job_id}.")
    run = job.run
    progress = None
    if run is not None and job.kind == JobKind.index:
        done = jobs.progress(session=session, run=run)
        since = done.mining_since
        elapsed = (jobs.now() - _aware(since)).total_seconds() if since else 0.0
        rate = done.sentences_done / elapsed if elapsed > 0 and done.sentences_done else None
        finished = run.status == "done"
        progress = Progress(
            sentences_done=run.n_sentences if finished else done.sentences_done,
            n_sentences=run.n_sentences,
            fraction=1.0 if finished else done.fraction,
            tokens_done=done.tokens_done,
            shards=done.shards,
            shards_done=done.shards_done,
            tokens_per_s=done.tokens_done / elapsed if rate and not finished else None,
            eta_seconds=(run.n_sentences - done.sentences_done) / rate if rate and not finished else None,
        )
    return JobContext(
        title=f"{job.kind} job {job.id}: {job.status}",
        job=JobInfo.model_validate(job, from_attributes=True),
        run=run_info(run) if run is not None else None,
        model=run.model.slug if run is not None else None,
        progress=progress,
        polling=job.status in jobs.ACTIVE,
        max_attempts=max_attempts,
    )


def _aware(moment):
    """SQLite gives back naive datetimes; they were stored as UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=jobs.now().tzinfo)


def model_page(session: Session, slug: str, run_id: int | None) -> ModelContext:
    model = model_or_404(session, slug)
    run = run_or_404(session, model, run_id)
    results = results_for(session, run)
    return ModelContext(
        title=f"{model.slug}: layers",
        model=model_info(model),
        run=run_info(run),
        layers=results.layer_figures(),
        provisional=results.coverage(),
    )


def layer_page(
    session: Session,
    slug: str,
    layer: int,
    *,
    run_id: int | None,
    sort: str,
    order: str,
    token: str | None,
    page: int,
    per_page: int,
) -> LayerContext:
    model = model_or_404(session, slug)
    check_layer(model, layer)
    run = run_or_404(session, model, run_id)
    token_ids = token_candidates(session, model, token) if token else None
    window = dict(sort=sort, descending=order == "desc", offset=(page - 1) * per_page, limit=per_page)
    results = results_for(session, run)
    total, stats, tops = results.layer_keys(layer, token_ids=token_ids, **window)
    pages = max(1, -(-total // per_page))
    if page > pages:
        query = dict(run=run_id, sort=sort, order=order, token=token, per_page=per_page, page=pages)
        last = urls.layer_url(model.slug, layer, **query)
        message = (
            f"There are {pages:,} pages of {per_page} keys here ({total:,} keys); "
            f"page {page:,} is past the last."
        )
        raise AppError(404, "No such page", message, link=(last, f"the last page, {pages:,}"))
    keys = [s.key for s in stats]
    values = queries.top_value_tokens(
        session=session, run_id=run.id, layer=layer, keys=keys, readout="raw", n=5
    )
    sentences = queries.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in tops.values()]
    )
    wanted = _trigger_token_ids(list(tops.values()), sentences)
    wanted.update(v.token_id for tokens in values.values() for v in tokens)
    texts = queries.token_texts(session=session, model_id=model.id, token_ids=wanted)
    labels = queries.current_labels(session=session, model_id=model.id, layer=layer, keys=keys)
    rows = [
        KeyRow(
            key=s.key,
            top_trigger=(
                trigger_view(tops[s.key], sentences[tops[s.key].sentence_index], texts)
                if s.key in tops
                else None
            ),
            value_top=[_score(v, texts) for v in values.get(s.key, [])],
            max_coefficient=s.max_coefficient,
            min_coefficient=s.min_coefficient,
            positive_share=s.positive_share,
            density=s.density,
            agreement=s.agreement,
            max_prob=s.max_prob,
            next_token_rank=s.next_token_rank,
            value_norm=s.value_norm,
            label=label_view(labels[s.key]) if s.key in labels else None,
        )
        for s in stats
    ]
    return LayerContext(
        title=f"{model.slug}: layer {layer}",
        model=model.slug,
        layer=layer,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        sort=sort,
        order=order,
        token=token,
        token_ids=token_ids or [],
        page_number=page,
        per_page=per_page,
        total=total,
        pages=pages,
        keys=rows,
        provisional=results.coverage(layer),
    )


def key_page(
    session: Session, slug: str, layer: int, key: int, *, run_id: int | None, limit: int
) -> KeyContext:
    model, run = key_run_or_404(session, slug, layer, key, run_id)
    where = dict(session=session, run_id=run.id, layer=layer, key=key)
    results = results_for(session, run)
    stored = key_examples.key_examples(**where) if run.status == "done" else None
    shaded = (stored.positive, stored.negative) if stored else (0, 0)
    every_positive = results.triggers(layer, key, 1)
    positive = every_positive[: max(limit, shaded[0])]
    negative = results.triggers(layer, key, -1, max(limit, shaded[1]))
    more = len(every_positive) - min(len(positive), limit)
    value_rows = results.value_readouts(layer, key)
    sentences = queries.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in positive + negative]
    )
    endings = [sentences[t.sentence_index].token_ids[: t.position + 1] for t in positive]
    history = queries.label_history(session=session, model_id=model.id, layer=layer, key=key)
    texts = queries.vocabulary(session=session, model_id=model.id)  # the whole (cached): ~1,500 lookups
    top_ids = [v.token_id for v in value_rows["raw", 1]]
    bottom_ids = [v.token_id for v in value_rows["raw", -1]]
    triggers = [trigger_view(t, sentences[t.sentence_index], texts, top_ids) for t in positive]
    negative_triggers = [trigger_view(t, sentences[t.sentence_index], texts, bottom_ids) for t in negative]
    if stored:
        views = [*triggers[: shaded[0]], *negative_triggers[: shaded[1]]]
        arrays = stored.trigger_shading([len(sentences[v.sentence_index].token_ids) for v in views])
        scale = _shading_scale(positive, negative)
        for view, values in zip(views, arrays, strict=True):
            view.shading = _shading(sentences[view.sentence_index], values, view.position, texts, scale)
    triggers, negative_triggers = triggers[:limit], negative_triggers[:limit]
    found = results.key_stats(layer, key)
    stats = None if found is None else KeyStatsView.model_validate(found, from_attributes=True)
    histogram = None
    if found is not None:
        edges = run.histogram_edges
        histogram = Histogram(edges=edges, labels=bin_labels(edges), counts=found.histogram)
    value = {
        readout: ValueReadout(
            top=[_score(v, texts) for v in value_rows[readout, 1]],
            bottom=[_score(v, texts) for v in value_rows[readout, -1]],
        )
        for readout in READOUTS
    }
    pinned = {"run": run.id}
    previous = (layer, key - 1) if key > 0 else (layer - 1, model.n_keys - 1) if layer > 0 else None
    following = (
        (layer, key + 1) if key + 1 < model.n_keys else (layer + 1, 0) if layer + 1 < model.n_layers else None
    )
    random_key = (random.randrange(model.n_layers), random.randrange(model.n_keys))
    return KeyContext(
        title=f"{model.slug}: layer {layer}, key {key}",
        model=model.slug,
        layer=layer,
        key=key,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        triggers=triggers,
        negative_triggers=negative_triggers,
        more_triggers=more,
        value=value,
        stats=stats,
        histogram=histogram,
        provisional=results.coverage(layer),
        patterns=patterns.pattern_hints(endings, texts),
        label=label_view(history[0]) if history else None,
        label_history=[label_view(label) for label in history[1:]],
        label_url=urls.label_url(slug, layer, key),
        explanation=key_explanation(session, run, layer, key),
        agreement=Agreement(
            positive=sum(t.value_rank is not None for t in triggers),
            positive_of=sum(t.next_token_id is not None for t in triggers),
            negative=sum(t.value_rank is not None for t in negative_triggers),
            negative_of=sum(t.next_token_id is not None for t in negative_triggers),
        ),
        links=Links(
            previous=urls.key_url(slug, *previous) if previous else None,
            next=urls.key_url(slug, *following) if following else None,
            random=urls.key_url(slug, *random_key),
            permalink=urls.key_url(slug, layer, key, **pinned),
            layer=urls.layer_url(slug, layer),
            samples=urls.samples_url(slug, layer, key, **pinned),
            related=urls.related_url(slug, layer, key, **pinned),
        ),
    )


def related_page(session: Session, slug: str, layer: int, key: int, *, run_id: int | None) -> RelatedContext:
    """The memories related to one: its neighbours by key and value direction, and its weight graph."""
    model, run = key_run_or_404(session, slug, layer, key, run_id)
    return RelatedContext(
        title=f"{model.slug}: layer {layer}, key {key}, related memories",
        model=model.slug,
        layer=layer,
        key=key,
        n_layers=model.n_layers,
        run=run_info(run),
        neighbours=memory_neighbours(session, model, run, layer, key),
        weight_graph=weight_graph_view(session, slug, run, layer, key),
    )


def samples_page(session: Session, slug: str, layer: int, key: int, *, run_id: int | None) -> SamplesContext:
    """A key's examples across the range: its band samples, each sentence shaded (once the run is stored)
    on the key page's scale."""
    model, run = key_run_or_404(session, slug, layer, key, run_id)
    results = results_for(session, run)
    where = dict(session=session, run_id=run.id, layer=layer, key=key)
    stored = key_examples.key_examples(**where) if run.status == "done" else None
    samples = stored.samples if stored else results.band_samples(layer, key)
    sentences = queries.get_sentences(
        session=session, corpus_id=run.corpus_id, indices=[s.sentence_index for s in samples]
    )
    labels = bin_labels(run.histogram_edges)
    views = [_sample_view(s, sentences[s.sentence_index], labels) for s in samples]
    if stored:
        wanted = {i for s in samples for i in sentences[s.sentence_index].token_ids}
        texts = queries.token_texts(session=session, model_id=model.id, token_ids=wanted)
        scale = _shading_scale(results.triggers(layer, key, 1, 1), results.triggers(layer, key, -1, 1))
        arrays = stored.sample_shading([len(sentences[s.sentence_index].token_ids) for s in samples])
        for view, values in zip(views, arrays, strict=True):
            view.shading = _shading(sentences[view.sentence_index], values, view.position, texts, scale)
    return SamplesContext(
        title=f"{model.slug}: layer {layer}, key {key}, examples across the range",
        model=model.slug,
        layer=layer,
        key=key,
        run=run_info(run),
        samples=sorted(views, key=lambda v: (-v.sign, -abs(v.coefficient), v.sentence_index)),
        provisional=results.coverage(layer),
    )


def search_page(
    session: Session,
    slug: str,
    *,
    q: str,
    run_id: int | None,
    readout: str,
    by: str,
    limit: int,
    arrays: token_search.ArrayCache,
    max_length: int,
    jump: bool = True,
) -> SearchContext | str:
    """The search results, or the URL of a key when `q` names one (`L12 K345`, `12/345`) and `jump` (else
    the results with that URL: as-you-type searches jump only when the form is sent)."""
    model = model_or_404(session, slug)
    named = named_key(model, q)
    key_url = urls.key_url(slug, *named, run=run_id) if named else None
    if key_url and jump:
        return key_url
    run = run_or_404(session, model, run_id)
    token_ids = token_candidates(session, model, q) if q else []
    promote: list[TokenMatch] = []
    suppress: list[TokenMatch] = []
    coverage, memories = "full", 0
    if token_ids:
        texts = queries.token_texts(session=session, model_id=model.id, token_ids=token_ids)
        ranked = token_search.rank_memories(
            session, arrays, run, token_ids, readout=readout, by=by, limit=limit
        )
        if ranked is not None:
            memories = ranked.memories
            for direction, hits, found in ((1, ranked.promote, promote), (-1, ranked.suppress, suppress)):
                found.extend(
                    TokenMatch(
                        layer=hit.layer,
                        key=hit.key,
                        direction=direction,
                        rank=ranked.ranks.get((hit.layer, hit.key, hit.token_id, direction)),
                        token=texts[hit.token_id],
                        token_id=hit.token_id,
                        logit=hit.logit,
                        prob=hit.prob,
                    )
                    for hit in hits
                )
        else:  # a run stored before full-vocabulary search: the stored top / bottom tokens only
            coverage = "stored"
            for direction, found in ((1, promote), (-1, suppress)):
                rows = queries.value_matches(
                    session=session,
                    run_id=run.id,
                    token_ids=token_ids,
                    readout=readout,
                    direction=direction,
                    by=by,
                    limit=limit,
                )
                found.extend(
                    TokenMatch(
                        layer=v.layer,
                        key=v.key,
                        direction=direction,
                        rank=v.rank,
                        token=texts[v.token_id],
                        token_id=v.token_id,
                        logit=v.logit,
                        prob=v.prob,
                    )
                    for v in rows
                )
    labels: list[LabelHit] = []
    sentences: list[SentenceMatch] = []
    if len(q.strip()) >= 2:
        sentences = sentence_matches(session, model, run, q, limit)
        labels = [
            LabelHit(
                layer=label.layer,
                key=label.key,
                url=urls.key_url(slug, label.layer, label.key),
                **label_view(label).model_dump(),
            )
            for label in queries.search_labels(
                session=session, model_id=model.id, text=q.strip(), limit=limit
            )
        ]
    return SearchContext(
        title=f"{model.slug}: search",
        model=model.slug,
        n_layers=model.n_layers,
        n_keys=model.n_keys,
        run=run_info(run),
        q=q,
        readout=readout,
        by=by,
        limit=limit,
        token_ids=token_ids,
        promote=promote,
        suppress=suppress,
        token_coverage=coverage,
        memories=memories,
        sentences=sentences,
        labels=labels,
        explanations=explanation_hits(session, slug, run, q, limit),
        max_length=max_length,
        key_url=key_url,
    )


def named_key(model: LanguageModel, q: str) -> tuple[int, int] | None:
    """The (layer, key) that `q` names (`L12 K345`, `12/345`), or None; a key the model lacks is a 404
    about `q` (shown next to the search box)."""
    jump = KEY_JUMP.match(q)
    if not jump:
        return None
    layer, key = (int(g) for g in jump.groups() if g is not None)
    try:
        check_key(model, layer, key)
    except AppError as error:
        error.field = "q"
        raise
    return layer, key


def token_candidates(session: Session, model: LanguageModel, text: str) -> list[int]:
    """Vocabulary ids a typed token means: the text as typed, and with a leading space when it has none.

    A leading ␣ (how the explorer shows a space) is read as a space; a text with ⟨…⟩ in it (a byte that is
    no character, ⟨0x80⟩, or an invisible one, ⟨U+200B⟩) is matched as the pages show tokens.
    """
    if "⟨" in text:
        forms = {text} if text.startswith(VISIBLE_SPACE) else {text, VISIBLE_SPACE + text}
        vocabulary = queries.vocabulary(session=session, model_id=model.id)
        return sorted(token_id for token_id, token in vocabulary.items() if visible(token) in forms)
    if text.startswith(VISIBLE_SPACE):
        text = " " + text[1:]
    forms = {text} if text.startswith(" ") or not text.strip() else {text, " " + text}
    return queries.find_tokens(session=session, model_id=model.id, texts=forms)


def sentence_matches(
    session: Session, model: LanguageModel, run: Run, text: str, limit: int
) -> list[SentenceMatch]:
    """Sentences that contain `text` (ignoring case), one row each (a text the corpus holds twice is one
    row), every occurrence marked, with the keys whose positive triggers they are up to a token at or past
    the first occurrence's end: the `limit` strongest such triggers over all sentences, grouped by
    sentence, the sentence of the strongest first."""
    needle = queries.stored_text(text).lower()
    found = queries.sentences_containing(session=session, corpus_id=run.corpus_id, text=text, limit=50)
    first_positions = {}
    for sentence in found:
        end = sentence.text.lower().find(needle) + len(needle)  # the first occurrence's end
        first_positions[sentence.index] = next(
            (p for p, (_, stop) in enumerate(sentence.offsets) if stop >= end), len(sentence.offsets)
        )
    rows = queries.triggers_from(session=session, run_id=run.id, first_positions=first_positions, limit=limit)
    by_index = {s.index: s for s in found}
    texts = queries.token_texts(
        session=session, model_id=model.id, token_ids=_trigger_token_ids(rows, by_index)
    )
    grouped: dict[str, tuple[list[int], list[SentenceKey]]] = {}  # a text the corpus repeats: one row
    for t in rows:  # the strongest first: so are the rows, and the keys within each
        sentence = by_index[t.sentence_index]
        indices, keys = grouped.setdefault(sentence.text, ([], []))
        if t.sentence_index not in indices:
            indices.append(t.sentence_index)
        if any((k.layer, k.key, k.position) == (t.layer, t.key, t.position) for k in keys):
            continue  # the same key on a copy of the sentence
        token_id = sentence.token_ids[t.position]
        keys.append(
            SentenceKey(
                layer=t.layer,
                key=t.key,
                coefficient=t.coefficient,
                position=t.position,
                trigger_token=texts.get(token_id, ""),
                trigger_token_id=token_id,
                url=urls.key_url(model.slug, t.layer, t.key, run=run.id),
            )
        )
    return [
        SentenceMatch(sentence_indices=sorted(indices), parts=marked_parts(sentence_text, text), keys=keys)
        for sentence_text, (indices, keys) in grouped.items()
    ]


def marked_parts(sentence: str, text: str) -> list[TextPart]:
    """`sentence` cut at every occurrence of `text` (any case; a ␣ typed means a space, as stored)."""
    needle = queries.stored_text(text)
    if needle.startswith(VISIBLE_SPACE):
        needle = " " + needle[1:]
    parts: list[TextPart] = []
    end = 0
    for match in re.finditer(re.escape(needle), sentence, flags=re.IGNORECASE) if needle else ():
        if match.start() > end:
            parts.append(TextPart(text=sentence[end : match.start()], marked=False))
        parts.append(TextPart(text=match.group(), marked=True))
        end = match.end()
    if end < len(sentence):
        parts.append(TextPart(text=sentence[end:], marked=False))
    return parts


def memory_neighbours(
    session: Session, model: LanguageModel, run: Run, layer: int, key: int
) -> MemoryNeighbours | None:
    """The memory's nearest memories by key and by value direction, each marked when below the random-pair
    baseline of its layer (none stored: nothing marked), or None when the run has none."""
    found = memory_search.get_neighbours(session=session, run_id=run.id, layer=layer, key=key)
    if not found:
        return None
    stored = memory_search.get_neighbour_baselines(session=session, run_id=run.id, layer=layer)
    baselines = {kind: NeighbourBaseline(pairs=b.pairs, mean=b.mean, p99=b.p99) for kind, b in stored.items()}

    def view(kind: str) -> list[Neighbour]:
        baseline = baselines.get(kind)
        return [
            Neighbour(
                layer=int(n_layer),
                key=int(n_key),
                cosine=cosine,
                url=urls.key_url(model.slug, int(n_layer), int(n_key), run=run.id),
                chance=None if baseline is None else cosine < baseline.p99,
            )
            for n_layer, n_key, cosine in found.get(kind, [])
        ]

    return MemoryNeighbours(
        gated=model.gated,
        by_key=view("key"),
        by_value=view("value"),
        key_baseline=baselines.get("key"),
        value_baseline=baselines.get("value"),
    )


def bin_labels(edges: list[float]) -> list[str]:
    """One label per histogram bin: negative bins, then exactly 0, then positive bins (see mining)."""
    negative, positive = edges[: len(edges) // 2 - 1], edges[len(edges) // 2 + 1 :]

    def power(x: float) -> str:
        return f"2^{round(math.log2(abs(x)))}"

    labels = [f"≤ −{power(negative[0])}"]
    labels += [f"(−{power(a)}, −{power(b)}]" for a, b in zip(negative, negative[1:], strict=False)]
    labels += [f"(−{power(negative[-1])}, −0]", "+0"]
    labels += [f"(0, {power(positive[0])})"]
    labels += [f"[{power(a)}, {power(b)})" for a, b in zip(positive, positive[1:], strict=False)]
    labels += [f"≥ {power(positive[-1])}"]
    return labels


def _score(row, texts: dict[int, str]) -> TokenScore:
    return TokenScore(
        rank=row.rank, token=texts[row.token_id], token_id=row.token_id, logit=row.logit, prob=row.prob
    )
