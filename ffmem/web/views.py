"""The views several pages share: a run, a model, a job, a token, a label, a trigger prefix and a shaded
text, each with the function that builds it from the store's rows; and `ModelPage`, the header fields
every page of one model starts with. The pages' own contexts live beside their builders (ffmem/web/pages/).

Layers and keys are 0-based. Token texts are the tokenizer's decoded strings, unchanged (a leading space is
a real space); templates make them visible with the `visible` filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, computed_field, field_validator
from sqlalchemy.orm import object_session
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from ffmem.store.memory_lists import SentenceTrigger
from ffmem.store.memory_lists import Trigger as TriggerRow
from ffmem.store.models import JobKind, JobStatus, Label, LanguageModel, Run, Sentence
from ffmem.store.progress import mining_job


def _utc(moment: datetime) -> datetime:
    """SQLite gives back naive datetimes (stored as UTC): mark them UTC, as Postgres gives them."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


# A moment with its offset, the same on both backends: RFC 3339 in JSON ("…T12:00:00Z").
Moment = Annotated[datetime, AfterValidator(_utc)]


# The state of a page of a run still mining: the share of its corpus the page's results cover (None: the
# run is done, the results final). The page then shows the provisional banner (templates/_provisional.html).
Provisional = Annotated[
    float | None, Field(description="While the run mines: the share of the corpus these results cover.")
]


class ModelPage(BaseModel):
    """The header of every page of one model: which page, its title and the model."""

    page: str = Field(description="Which page this is (its template's name).")
    title: str = Field(description="The page's title.")
    model: str = Field(description="The model's slug, as in its URLs (/m/{model}).")


class RunInfo(BaseModel):
    """An index run and its provenance."""

    id: int
    status: str = Field(description="running (mining: its results are provisional), done or failed.")
    corpus: str = Field(description="The corpus it mined, by name.")
    n_sentences: int = Field(description="Sentences of the corpus it mines.")
    n_tokens: int = Field(description="Their tokens.")
    top_k: int = Field(description="Top-T: trigger sentences kept per key and sign.")
    n_value_tokens: int = Field(description="Top and bottom value tokens stored per memory and readout.")
    dtype: str = Field(description="The dtype the model ran in.")
    device: str = Field(description="Where it ran: cpu, cuda, mps.")
    package_version: str = Field(description="The ffmem version that built it.")
    started_at: Moment
    finished_at: Moment | None
    provenance: dict = Field(description="What it was built from: options, weights' checksum, versions.")
    provenance_text: str = Field(
        description="The provenance as a person reads it: the model, the corpus and what was held out, how "
        "it was mined, and the versions that built it."
    )
    error: dict | None = Field(description="Why it failed: {type, message, traceback}.")
    job: int | None = Field(None, description="While the run is built: the index job building it.")
    mined: float | None = Field(
        None, description="While the run is built: the share of its corpus mined so far (all shards)."
    )


def run_info(run: Run) -> RunInfo:
    building = mining_job(object_session(run), run)
    return RunInfo(
        job=building[0] if building else None,
        mined=building[1] if building else None,
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
        provenance_text=provenance_text(run.provenance or {}, run.package_version),
        error=run.error,
    )


def provenance_text(provenance: dict, package_version: str) -> str:
    """A run's provenance (ffmem.worker.provenance) in sentences; what an older run did not record is left
    out."""
    get = provenance.get
    sentences = []
    if get("model_source"):
        revision = f" at revision {get('model_revision')}" if get("model_revision") else ""
        weights = f", weights SHA-256 {get('weights_sha256')[:12]}…" if get("weights_sha256") else ""
        kind = f" ({get('architecture')}{weights})" if get("architecture") else ""
        sentences.append(f"Model {get('model_source')}{revision}{kind}.")
    if get("corpus"):
        counted = f"{get('sentences'):,} sentences" if get("sentences") is not None else ""
        checksum = f"SHA-256 {get('corpus_sha256')[:12]}…" if get("corpus_sha256") else ""
        about = ", ".join(part for part in (counted, checksum) if part)
        sentences.append(
            f"Corpus {get('corpus')}{f' ({about})' if about else ''}{held_out_words(provenance)}."
        )
    mining = []
    if get("max_sentence_tokens"):
        mining.append(f"sentences cut at {get('max_sentence_tokens'):,} tokens")
    if get("batch_tokens"):
        mining.append(f"batches of {get('batch_tokens'):,} tokens")
    if get("shard_sentences"):
        mining.append(f"shards of {get('shard_sentences'):,} sentences")
    if mining:
        sentences.append(f"Mined in {', '.join(mining)}.")
    if get("mined_positions"):
        sentences.append(f"Positions mined {get('mined_positions')}.")
    versions = [f"{name} {get(key)}" for name, key in LIBRARIES if get(key)]
    sentences.append(f"Built by ffmem {package_version}{' with ' + ', '.join(versions) if versions else ''}.")
    return " ".join(sentences)


LIBRARIES = (("torch", "torch"), ("transformers", "transformers"), ("Python", "python"))


def held_out_words(provenance: dict) -> str:
    """Which sentences the run held out of mining, as the end of the corpus's sentence."""
    every, total = provenance.get("held_out_every"), provenance.get("sentences")
    if every is None:
        return ""
    if not every:
        return "; every sentence mined, none held out"
    held = total // every if total is not None else None
    count = "" if held is None else f" ({held:,} sentence{'s' if held != 1 else ''})"
    return f"; every {ordinal(every)} sentence held out of mining{count}, for the analyses and explanations"


def ordinal(n: int) -> str:
    """10 → 10th, 2 → 2nd, 1 → 1st (the 1st sentence: every one)."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class ModelInfo(BaseModel):
    """A model as the explorer knows it."""

    slug: str = Field(description="Its name in URLs.")
    source: str = Field(description="Where it was loaded from: a Hugging Face id or a path.")
    revision: str | None = Field(description="The Hugging Face revision, if pinned.")
    architecture: str = Field(description="Its Hugging Face class name.")
    family: str = Field(description="The adapter family that reads its FF layers.")
    n_layers: int = Field(description="FF layers (0-based in URLs).")
    n_keys: int = Field(description="Memories (keys) per layer: the FF's inner width d_ff.")
    d_model: int = Field(description="The residual width.")
    vocab_size: int
    activation: str = Field(description="The FF's activation function.")
    gated: bool = Field(description="A gated FF (GLU): key = gate and up projections together.")


def model_info(model: LanguageModel) -> ModelInfo:
    return ModelInfo.model_validate(model, from_attributes=True)


class PastAttempt(BaseModel):
    """An attempt at a job that failed before the current one (the job was queued again)."""

    started_at: Moment | None = Field(description="When a worker took it up (null: none did).")
    finished_at: Moment = Field(description="When it failed.")
    error: dict | None = Field(description="Why it failed: {type, message, traceback}.")

    @computed_field(description="How long it ran, in seconds (null: no worker took it up).")
    @property
    def seconds(self) -> float | None:
        return None if self.started_at is None else (self.finished_at - self.started_at).total_seconds()


class JobInfo(BaseModel):
    """A job of the queue: an index run, analyses of one, or a comparison of two."""

    id: int
    kind: JobKind = Field(description="index | analysis | comparison.")
    status: JobStatus = Field(description="queued | running | done | failed.")
    options: dict = Field(
        description="What it computes: an index run's options; an analysis's examples, keys, triggers, seed."
    )
    after_job_id: int | None = Field(description="An analysis waiting for this index job to build its run.")
    progress: dict | None = Field(
        description="Analyses: {stage, done, total} batches of the analysis running."
    )
    attempt: int = Field(
        description="The current attempt at the job: 1, and one more each time it failed and was queued "
        "again."
    )
    past_attempts: list[PastAttempt] = Field(description="The attempts that failed before it, oldest first.")
    attempts: int = Field(
        description="Times a worker took up the current attempt's step: more than 1 when the worker before "
        "it died (its lease ran out); past Settings.max_attempts the job fails."
    )
    worker: str | None = Field(description="The worker that holds or held it.")
    error: dict | None = Field(description="Why the current attempt failed: {type, message, traceback}.")
    created_at: Moment
    started_at: Moment | None = Field(description="When a worker took up the current attempt.")
    finished_at: Moment | None = Field(description="When the current attempt ended.")

    @field_validator("past_attempts", mode="before")
    @classmethod
    def _none_is_no_attempt(cls, stored: list | None) -> list:
        return stored or []

    run_id: int | None = Field(description="The index run it builds or reads.")


class TokenRef(BaseModel):
    """A vocabulary entry: its id and its text as the tokenizer decodes it alone."""

    token_id: int
    token: str


class TokenScore(BaseModel):
    """One of a value's top or bottom tokens."""

    rank: int = Field(description="0 first: from the top (top tokens) or the bottom (bottom tokens).")
    token: str
    token_id: int
    logit: float = Field(description="The token's logit in the value's readout (raw: v·e_t).")
    prob: float = Field(description="Its probability: softmax of the value's logits over the vocabulary.")


def token_score(row, texts: dict[int, str]) -> TokenScore:
    """A stored value token (memory_lists.ValueToken) with its text."""
    return TokenScore(
        rank=row.rank, token=texts[row.token_id], token_id=row.token_id, logit=row.logit, prob=row.prob
    )


class LabelView(BaseModel):
    """A person's annotation of a memory (see ffmem.store.models.Label)."""

    id: int
    pattern: str = Field(description="What the memory's trigger prefixes share, in the labeller's words.")
    tag: str = Field(description='shallow | semantic | "" (untagged).')
    author: str
    created_at: Moment


def label_view(label: Label) -> LabelView:
    return LabelView(
        id=label.id, pattern=label.pattern, tag=label.tag, author=label.author, created_at=label.created_at
    )


class LabelHit(LabelView):
    """A labelled memory: its place, its page and its label."""

    layer: int
    key: int
    url: str = Field(description="The memory's key page.")


class ShadedToken(TypedDict):
    """One token of a shaded text: its text as the tokenizer decodes it and this key's coefficient there (a
    dict, not a model: a key page's JSON holds ~1,500 of them)."""

    text: str
    coefficient: float | None  # None: not computed at this token (shown unshaded)


class ShadedText(BaseModel):
    """A text with every token shaded by one key's coefficient (ffmem/web/shading.py builds it and renders
    it, `shaded` in templates): positive and negative in two hues, intensity |m| / scale.

    Held as two flat lists (a key page shades ~1,500 tokens: one model per token cost more than the rest
    of the page); the JSON twin shows them as `tokens`, one {text, coefficient} per token."""

    texts: list[str] = Field(exclude=True)  # each token's text as the tokenizer decodes it
    coefficients: list[float | None] = Field(exclude=True)  # None: not computed there (unshaded)
    scale: float = Field(description="The |m| that shades fully (0: nothing is shaded).")
    peak: int | None = Field(description="The outlined token's index (the trigger token, or the text's max).")
    prefix_end: int | None = Field(description="The trigger prefix's last token: those after it are dimmed.")

    @computed_field(description="Each token's text and the key's coefficient m there (null: not computed).")
    @property
    def tokens(self) -> list[ShadedToken]:
        return [
            ShadedToken(text=text, coefficient=coefficient)
            for text, coefficient in zip(self.texts, self.coefficients, strict=True)
        ]


class Trigger(BaseModel):
    """A trigger prefix: sentence `sentence_index` up to and including token `position`.

    `prefix` is the sentence text up to the end of the trigger token; `trigger_start` is where that
    token's text begins in `prefix` (the highlighted part is prefix[trigger_start:]).
    """

    rank: int = Field(
        description="0 first: the strongest (highest m for positive triggers, lowest for negative)."
    )
    coefficient: float = Field(description="The key's coefficient m at the trigger token (signed).")
    prefix: str = Field(description="The sentence up to the end of the trigger token.")
    trigger_start: int = Field(description="Where the trigger token's text begins in `prefix`.")
    trigger_token: str
    trigger_token_id: int
    next_token: str | None = Field(description="The token after the prefix in the sentence (null: its last).")
    next_token_id: int | None
    sentence: str = Field(description="The whole sentence.")
    sentence_index: int = Field(description="The sentence's index in the run's corpus.")
    position: int = Field(description="The trigger token's position in the sentence, 0-based.")
    value_rank: int | None = Field(
        None,
        description="The next token's rank among the value's top (−: bottom) tokens, 0 first; null: "
        "not among them.",
    )
    shading: ShadedText | None = Field(
        None, description="The key's m at every token of the sentence (a finished run's first few triggers)."
    )


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


def trigger_token_ids(
    rows: Sequence[TriggerRow | SentenceTrigger], sentences: dict[int, Sentence]
) -> set[int]:
    """The trigger and next token ids of these triggers (for one vocabulary lookup)."""
    found = set()
    for row in rows:
        ids = sentences[row.sentence_index].token_ids
        found.update(ids[row.position : row.position + 2])
    return found
