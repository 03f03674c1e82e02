"""One typed context per page. The HTML template and the JSON twin render the same object.

Layers and keys are 0-based. Token texts are the tokenizer's decoded strings, unchanged (a leading
space is a real space); templates make them visible with the `visible` filter.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, computed_field
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from ffmem.store.models import JobKind, JobStatus
from ffmem.store.results import LayerFigures
from ffmem.web.composition_view import ExplanationHit, ExplanationView, WeightGraphView


def _utc(moment: datetime) -> datetime:
    """SQLite gives back naive datetimes (stored as UTC): mark them UTC, as Postgres gives them."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


# A moment with its offset, the same on both backends: RFC 3339 in JSON ("…T12:00:00Z").
Moment = Annotated[datetime, AfterValidator(_utc)]


class RunInfo(BaseModel):
    """An index run and its provenance."""

    id: int
    status: str
    corpus: str
    n_sentences: int
    n_tokens: int
    top_k: int
    n_value_tokens: int
    dtype: str
    device: str
    package_version: str
    started_at: Moment
    finished_at: Moment | None
    provenance: dict
    error: dict | None
    job: int | None = Field(None, description="While the run is built: the index job building it.")
    mined: float | None = Field(
        None, description="While the run is built: the share of its corpus mined so far (all shards)."
    )


class ModelInfo(BaseModel):
    slug: str
    source: str
    revision: str | None
    architecture: str
    family: str
    n_layers: int
    n_keys: int
    d_model: int
    vocab_size: int
    activation: str
    gated: bool


class ModelEntry(BaseModel):
    model: ModelInfo
    runs: list[RunInfo]


class Progress(BaseModel):
    """How far a run's mining has come, over all its shards."""

    sentences_done: int
    n_sentences: int
    fraction: float
    tokens_done: int
    shards: int
    shards_done: int
    tokens_per_s: float | None
    eta_seconds: float | None


class JobInfo(BaseModel):
    id: int
    kind: JobKind  # index | analysis
    status: JobStatus  # queued | running | done | failed
    options: dict  # what it computes: an index run's options; an analysis's examples, keys, triggers, seed
    after_job_id: int | None  # an analysis waiting for this index job to build its run
    progress: dict | None  # analyses: {stage, done, total} batches of the analysis running
    attempts: int  # times a worker took up its current step (Settings.max_attempts)
    worker: str | None
    error: dict | None  # {type, message, traceback}
    created_at: Moment
    started_at: Moment | None
    finished_at: Moment | None
    run_id: int | None


class JobContext(BaseModel):
    page: str = "job"
    title: str
    job: JobInfo
    run: RunInfo | None
    model: str | None  # the run's model slug, once known
    progress: Progress | None
    polling: bool  # the page refreshes its progress until the job ends
    max_attempts: int | None = None  # times a worker may take up one step (Settings.max_attempts)


class JobsContext(BaseModel):
    """Every job, the newest first."""

    page: str = "jobs"
    title: str
    jobs: list[JobInfo]
    limit: int  # at most this many are listed


class CorpusFileView(BaseModel):
    """A corpus file uploaded from the browser, with its lines counted as the CLI's reader counts them."""

    name: str  # the uploaded file's name
    corpus: str  # what an index run is started with: the file's path on this server
    size: int  # bytes
    sha256: str
    lines: int  # usable lines (JSONL: records with a "text")
    skipped: dict[str, int]  # lines skipped, by reason (ffmem/engine/text_files.py)
    uploaded_at: Moment


class CorpusUpload(BaseModel):
    """The JSON answer to an upload: the corpus kept, and whether the same file was there already."""

    corpus: CorpusFileView
    already: bool


class IndexedCorpus(BaseModel):
    """A corpus as an index run read and tokenized it (stored once per tokenizer)."""

    name: str
    source: str  # where it was read from
    tokenizer: str
    n_sentences: int
    n_tokens: int
    skipped: dict  # lines skipped, by reason
    created_at: Moment


class CorporaContext(BaseModel):
    """The corpora this server knows: the bundled one, the uploaded files, those the database holds."""

    page: str = "corpora"
    title: str
    bundled: str  # wiki-vital
    files: list[CorpusFileView]  # the newest first
    indexed: list[IndexedCorpus]  # the newest first
    uploaded: CorpusFileView | None = None  # the file just uploaded (`?uploaded=`), shown first
    max_upload_bytes: int
    skip_reasons: dict[str, str]  # what each skip reason means


class LoginContext(BaseModel):
    """Whether this client may write, and why (ffmem/web/access.py)."""

    page: str = "login"
    title: str
    can_write: bool
    read_only: bool
    token_set: bool  # the server has an admin token: logging in can give write access
    name: str | None  # who logged in (the cookie's name), if anyone
    reason: str | None  # why this client may not write
    next: str  # where the form goes back to


class StartHere(BaseModel):
    """Where a newcomer goes next: pages of the first model whose index can be browsed."""

    model: str
    prompt: str  # an example prompt for the live view
    live_view: str  # that prompt traced
    search: str
    analysis: str
    layers: str  # the model page: statistics per layer
    top_layer: str  # the last layer's keys, those whose triggers' next tokens are their value's top first


class CorpusChoice(BaseModel):
    """A corpus the index form offers: its name, and what the form sends (wiki-vital or a path)."""

    name: str
    corpus: str


class HomeContext(BaseModel):
    page: str = "home"
    title: str
    models: list[ModelEntry]
    jobs: list[JobInfo]  # the newest first
    start: StartHere | None = None  # None until a model has an index to browse
    corpora: list[CorpusChoice] = []  # the bundled corpus and the uploaded ones, for the index form


LayerSummary = LayerFigures  # the model page's rows are the store's per-layer figures, as they are


class ModelContext(BaseModel):
    page: str = "model"
    title: str
    model: ModelInfo
    run: RunInfo
    layers: list[LayerSummary]
    provisional: float | None = None  # while the run mines: the share of the corpus these results cover


class TokenScore(BaseModel):
    """One of a value's top or bottom tokens."""

    rank: int
    token: str
    token_id: int
    logit: float
    prob: float


class ValueReadout(BaseModel):
    top: list[TokenScore]
    bottom: list[TokenScore]


class LabelView(BaseModel):
    """A person's annotation of a memory (see ffmem.store.models.Label)."""

    id: int
    pattern: str
    tag: str  # shallow | semantic | "" (untagged)
    author: str
    created_at: Moment


class LabelAnswer(BaseModel):
    """The JSON answer to a new label: the label, and how many earlier ones stay as its history."""

    label: LabelView
    history: int


class LabelDeleted(BaseModel):
    """The JSON answer to deleting a label: it, the memory's label now (the one before it, if any), and how
    many earlier ones stay."""

    deleted: LabelView
    label: LabelView | None
    history: int


class LabelHit(LabelView):
    """A search result: a memory whose label matches."""

    layer: int
    key: int
    url: str


class KeyRow(BaseModel):
    """One key in the layer table."""

    key: int
    top_trigger: Trigger | None
    value_top: list[TokenScore]  # raw readout
    max_coefficient: float | None
    min_coefficient: float | None
    positive_share: float
    density: float | None
    agreement: int | None
    max_prob: float | None
    next_token_rank: int | None
    value_norm: float | None
    label: LabelView | None = None


class Trigger(BaseModel):
    """A trigger prefix: sentence `sentence_index` up to and including token `position`.

    `prefix` is the sentence text up to the end of the trigger token; `trigger_start` is where that
    token's text begins in `prefix` (the highlighted part is prefix[trigger_start:]).
    """

    rank: int
    coefficient: float
    prefix: str
    trigger_start: int
    trigger_token: str
    trigger_token_id: int
    next_token: str | None
    next_token_id: int | None
    sentence: str
    sentence_index: int
    position: int
    value_rank: int | None = None  # rank of next_token among the value's top (or, for −, bottom) tokens
    shading: ShadedText | None = (
        None  # the key's m at every token of the sentence (a finished run's first few)
    )


class ShadedToken(TypedDict):
    """One token of a shaded text: its text as the tokenizer decodes it and this key's coefficient there (a
    dict, not a model: a key page's JSON holds ~1,500 of them)."""

    text: str
    coefficient: float | None  # None: not computed at this token (shown unshaded)


class BandSample(BaseModel):
    """An example from one band of a key's coefficient range: a sentence whose extreme coefficient (its
    maximum when > 0, minimum when < 0) lies in histogram bin `bin` (`band`, its range), at `position`."""

    bin: int
    band: str
    sign: int
    coefficient: float
    sentence_index: int
    position: int
    sentence: str
    shading: ShadedText | None = None  # None while the run mines, or for runs stored before 0011


class ShadedText(BaseModel):
    """A text with every token shaded by one key's coefficient (ffmem/web/shading.py builds it and renders
    it, `shaded` in templates): positive and negative in two hues, intensity |m| / scale.

    Held as two flat lists (a key page shades ~1,500 tokens: one model per token cost more than the rest
    of the page); the JSON twin shows them as `tokens`, one {text, coefficient} per token."""

    texts: list[str] = Field(exclude=True)  # each token's text as the tokenizer decodes it
    coefficients: list[float | None] = Field(exclude=True)  # None: not computed there (unshaded)
    scale: float  # |m| that shades fully (0: nothing is shaded)
    peak: int | None  # the outlined token's index (e.g. the trigger token, or the text's max)
    prefix_end: int | None  # the last token of the trigger prefix: those after it are dimmed

    @computed_field
    @property
    def tokens(self) -> list[ShadedToken]:
        return [
            ShadedToken(text=text, coefficient=coefficient)
            for text, coefficient in zip(self.texts, self.coefficients, strict=True)
        ]


class Agreement(BaseModel):
    """How many trigger next-tokens are among the value's top tokens (raw readout).

    Positive triggers are compared with the value's top tokens; negative triggers (m < 0 flips
    the value) with its bottom tokens.
    """

    readout: str = "raw"
    positive: int
    positive_of: int
    negative: int
    negative_of: int


class KeyStatsView(BaseModel):
    mean: float
    positive_share: float
    density: float | None
    max_coefficient: float | None
    min_coefficient: float | None
    max_prob: float | None
    agreement: int | None
    next_token_rank: int | None
    value_norm: float | None
    first_token_change: float | None = None  # Fig. 3, when `ffmem analyze` sampled this key
    last_token_change: float | None = None
    shallowness: float | None = None  # −last_token_change clipped to 0–1


class Histogram(BaseModel):
    edges: list[float]  # shared bin edges (see ffmem.engine.mining.histogram_edges)
    labels: list[str]  # one per bin
    counts: list[int]


class Links(BaseModel):
    previous: str | None
    next: str | None
    random: str
    permalink: str
    layer: str
    samples: str  # its examples across the range (the page loads them when scrolled to)
    related: str  # its neighbours and weight graph (the page loads them when scrolled to)


class TokenRef(BaseModel):
    token_id: int
    token: str


class PatternHints(BaseModel):
    """How a key's top triggers end: the commonest final token and the commonest shared final n-gram."""

    triggers: int  # the positive triggers looked at
    final_token: TokenRef
    final_token_share: float
    final_ngram: list[TokenRef] | None  # None when no two triggers end alike beyond one token
    final_ngram_share: float


class Neighbour(BaseModel):
    """A memory near another one: its place, the cosine and its page."""

    layer: int
    key: int
    cosine: float
    url: str
    chance: bool | None = None  # cosine below the random-pair p99 of the layer (None: no baseline stored)


class NeighbourBaseline(BaseModel):
    """What random pairs reach: a memory of this layer and any other memory (ffmem.engine.neighbours)."""

    pairs: int  # random pairs sampled (fixed, seeded)
    mean: float  # their mean |cosine|
    p99: float  # the 99th percentile of their |cosine|: a neighbour below it is no nearer than chance


class MemoryNeighbours(BaseModel):
    """A memory's nearest memories across all layers (ffmem.engine.neighbours), the highest cosine first."""

    gated: bool  # key cosine = cos(gate) · cos(up) (the cosine of g·uᵀ); else the cosine of the keys
    by_key: list[Neighbour]
    by_value: list[Neighbour]
    key_baseline: NeighbourBaseline | None = None  # None: a run stored before baselines
    value_baseline: NeighbourBaseline | None = None


class CoefficientAt(BaseModel):
    """One memory's coefficient at one token of a text."""

    position: int
    token: str
    coefficient: float


class TryText(BaseModel):
    """The key page's "try your own text" (`?text=`): this key's coefficient at every token of the text,
    from the live worker (ffmem/web/try_text.py), and how its max and min compare with the stored triggers."""

    text: str | None  # None: the box only
    max_length: int  # the longest text the box accepts, in characters
    notice: str | None = None  # why there is no answer: a bad text, or the worker down, busy or loading
    notice_field: str | None = None  # the form field the notice is about ("text"): shown next to it
    tokens: list[TokenRef] = []  # the text's tokens (texts as the tokenizer decodes each alone)
    shaded: ShadedText | None = None  # the text, every token shaded; scale: the key's largest stored |m|
    first_mined: int | None = None  # max, min and their ranks cover positions from here, as the run mines
    max: CoefficientAt | None = None  # the largest m there (None: no position the run would mine)
    min: CoefficientAt | None = None
    # Where max would rank among the run's stored positive triggers (each a sentence's max; 1: above them
    # all, positive_of + 1: below them all), and min among the negative ones; ties rank with the stored.
    max_rank: int | None = None
    min_rank: int | None = None
    positive_of: int = 0  # stored positive triggers compared with (at most top-T)
    negative_of: int = 0
    top_k: int = 0  # the run's top-T


class KeyContext(BaseModel):
    page: str = "key"
    title: str
    model: str
    layer: int
    key: int
    n_layers: int
    n_keys: int
    run: RunInfo
    triggers: list[Trigger]
    negative_triggers: list[Trigger]
    more_triggers: int  # how many more positive triggers the run holds beyond those shown
    value: dict[str, ValueReadout]  # readout ("raw", "norm") → top and bottom tokens
    stats: KeyStatsView | None
    histogram: Histogram | None
    agreement: Agreement
    links: Links
    provisional: float | None = None  # while the run mines: the share of the corpus these results cover
    patterns: PatternHints | None = None  # how the shown positive triggers end
    label: LabelView | None = None  # the memory's label (its newest)
    label_history: list[LabelView] = []  # its earlier labels, the newest first
    label_url: str = ""  # where the label form posts
    explanation: ExplanationView | None = None  # its automatic description (None: none for this run)
    try_text: TryText | None = None  # "try your own text": the box, and the answer for `?text=`


class SamplesContext(BaseModel):
    """A key's examples across the range (the key page loads them as a section)."""

    page: str = "samples"
    title: str
    model: str
    layer: int
    key: int
    run: RunInfo
    samples: list[BandSample]  # strongest band first, positive then negative
    provisional: float | None = None  # while the run mines: the share of the corpus these results cover


class RelatedContext(BaseModel):
    """The memories related to one: nearest by direction, and feeding or fed by it in the weight graph (the
    key page loads them as a section)."""

    page: str = "related"
    title: str
    model: str
    layer: int
    key: int
    n_layers: int
    run: RunInfo
    neighbours: MemoryNeighbours | None = None  # None: not computed for this run (yet)
    weight_graph: WeightGraphView | None = None  # who feeds it, whom it feeds (None: not computed)


class LayerContext(BaseModel):
    page: str = "layer"
    title: str
    model: str
    layer: int
    n_layers: int
    n_keys: int
    run: RunInfo
    sort: str
    order: str
    token: str | None
    token_ids: list[int]  # the vocabulary entries the token filter matched
    page_number: int
    per_page: int
    total: int  # keys that pass the filter
    pages: int
    keys: list[KeyRow]
    provisional: float | None = None  # while the run mines: the share of the corpus these results cover


class TokenMatch(BaseModel):
    """A memory whose value promotes (a high logit) or suppresses (a low one) a searched token."""

    layer: int
    key: int
    direction: int  # +1 promotes, −1 suppresses
    rank: int | None  # the token's rank in the value's readout, from the top (+1) or bottom (−1), 0 first;
    # None: not among the value's stored top / bottom n_value_tokens (the rank is known only there)
    token: str
    token_id: int
    logit: float
    prob: float


class TextPart(BaseModel):
    """A piece of a sentence: the searched text (`marked`) or what lies between its occurrences."""

    text: str
    marked: bool


class SentenceKey(BaseModel):
    """A key one of whose top positive triggers is this sentence, up to a token at or past the match."""

    layer: int
    key: int
    coefficient: float
    position: int
    trigger_token: str
    trigger_token_id: int
    url: str


class SentenceMatch(BaseModel):
    """A sentence that contains the searched text (each occurrence marked), with the keys it triggers."""

    sentence_indices: list[int]  # the corpus sentences with this text (a repeated sentence is one row)
    parts: list[TextPart]  # the sentence, cut at the occurrences of the text
    keys: list[SentenceKey]  # the strongest first


class SearchContext(BaseModel):
    page: str = "search"
    title: str
    model: str
    n_layers: int
    n_keys: int
    run: RunInfo
    q: str
    readout: str
    by: str
    limit: int
    token_ids: list[int]
    promote: list[TokenMatch]
    suppress: list[TokenMatch]
    # "full": every memory of every layer ranked by the token's logit in its value's whole readout;
    # "stored": only values with the token among their stored top / bottom tokens (runs stored before 0008)
    token_coverage: str = "full"
    memories: int = 0  # memories ranked ("full")
    sentences: list[SentenceMatch] = []  # sentences that contain q, one row each, with the keys they trigger
    labels: list[LabelHit] = []  # memories whose label matches q
    explanations: list[ExplanationHit] = []  # memories whose automatic explanation contains q
    max_length: int = 200  # the longest q the server accepts
    key_url: str | None = None  # the key page `q` names (`L12 K345`), opened when the form is sent


KeyRow.model_rebuild()


class PromptToken(TokenRef):
    position: int
    url: str  # this trace with the position selected


class TraceMemory(BaseModel):
    """One memory at the selected position, ranked by |m_i|·‖v_i‖ (with the edits, if any)."""

    layer: int
    key: int
    coefficient: float  # signed: m < 0 flips the value's effect (edited, with edits)
    unedited_coefficient: float | None  # m without the edits (None without edits)
    score: float
    tokens: list[TokenRef]  # top tokens of sign(m)·v under the trace's readout (from the index)
    agrees: bool | None  # top(y) is among them (None: the index has no value tokens)
    url: str  # the key page
    edit: str | None  # this memory's intervention in the trace, if any
    off_url: str  # this trace with the memory switched off
    scale_url: str  # … scaled ×2
    flip_url: str  # … scaled ×−1


class LayerFiguresView(BaseModel):
    """A layer at the selected position in one forward pass."""

    top_r: TokenRef  # the residual before the FF
    top_y: TokenRef  # the FF output
    top_o: TokenRef  # the layer output
    final_prob: float  # probability of that pass's final prediction under the residual
    final_rank: int
    case: str  # agreement | residual | ffn | composition
    settled: bool  # top(r) is already the final prediction


class TraceLayer(LayerFiguresView):
    """A layer of the forward pass that was computed (with the edits, if any)."""

    layer: int
    agrees: bool | None  # one of the listed memories' top tokens is top(y)
    memories: list[TraceMemory]
    unedited: LayerFiguresView | None  # the same figures without the edits (None without edits)


class TokenChangeView(TokenRef):
    before: float
    after: float
    change: float
    target_url: str  # this trace with this token as the attribution's target


class AttributedMemory(BaseModel):
    """One memory's direct contribution to the target's logit (ffmem.engine.attribution)."""

    layer: int
    key: int
    coefficient: float  # m_i (edited, with edits)
    value_logit: float  # the target's logit in the value: v·e_t (raw), v·g_t (norm, the final norm folded)
    contribution: float  # m_i · value_logit: > 0 promotes the target, < 0 suppresses it
    top_token: TokenRef | None  # the top token of sign(m)·v under the readout (None: the index has none)
    veto: bool  # a veto case (ffmem.engine.attribution_terms): it pushes the target, its layer pushes it down
    url: str  # the key page


class AttributionLayer(BaseModel):
    """One layer: its memories' contributions beside the FF's actual change to the target's logit."""

    layer: int
    memories: list[AttributedMemory]  # the largest |contribution|, largest first
    memories_sum: float  # Σ over all the layer's memories (S_ℓ)
    bias: float  # the FF's output bias read the same way (0 without one)
    direct: float  # y·e_t (raw) or y·g_t (norm): = memories_sum + bias up to float error
    change: float  # the FF's change to the target's logit lens: lens(o) − lens(r) (raw: y·e_t)
    residual: float  # change − (memories_sum + bias): float error (raw), the norm's non-linearity (norm)


class AttributionView(BaseModel):
    """Who pushes the target token at the selected position, in the pass the page shows."""

    target: TokenRef
    typed: str | None  # the target as the URL asked for it (None: the prediction)
    note: str | None  # a typed text: which token is attributed (its text made visible, its id)
    other: TokenRef | None = None  # the typed text's other spelling (± a leading space), a token too
    other_url: str | None = None  # the same trace with that token as the target
    readout: str
    logit: float  # the target's logit after the position under the readout
    scale: float | None  # norm: the final norm's scale at the actual final residual, folded in
    total: float  # Σ of every memory's contribution over all layers
    largest_residual: float  # the largest |residual| over the layers
    vetoes: int  # memories marked as veto cases
    layers: list[AttributionLayer]
    promoters: list[AttributedMemory]  # the largest contributions overall
    suppressors: list[AttributedMemory]  # the most negative overall


class EditView(BaseModel):
    text: str  # L12K345*0.5
    layer: int
    key: int
    mode: str  # off | scale | set
    value: float
    coefficient: float | None  # m at the selected position before the edit
    url: str  # the key page
    remove_url: str  # this trace without it


class UneditedTrace(BaseModel):
    """The trace's figures without the edits, beside those with them."""

    prediction: TokenRef
    heatmap: dict  # {"active": [layers][positions], "ff_logit": [layers][positions]}
    cases: dict[str, int]  # layers per case


class Generation(BaseModel):
    tokens: int
    clean: str
    edited: str | None  # with the interventions (None without any)


class TraceContext(BaseModel):
    page: str = "trace"
    title: str
    model: str
    n_layers: int
    n_keys: int
    text: str | None  # None: no prompt yet (the form only)
    position: int | None
    readout: str
    memories: int
    generate: int
    interventions: str  # the set as the URL keeps it
    max_tokens: int
    worker: dict  # the live worker's state (status: ready | loading | idle | down)
    notice: str | None = None  # why there is no trace (worker down, loading or busy)
    run: int | None = None  # the index run whose value tokens name the memories' tokens
    tokens: list[PromptToken] = []
    # prediction, layers, heatmap and cases: the forward pass that was computed, with the edits if any
    prediction: TokenRef | None = None
    top_tokens: list[TokenChangeView] = []
    layers: list[TraceLayer] = []
    heatmap: dict = {}  # {"active": [layers][positions], "ff_logit": [layers][positions]}
    edits: list[EditView] = []
    generation: Generation | None = None
    cases: dict[str, int] = {}  # layers per case
    unedited: UneditedTrace | None = None  # the same without the edits (None without edits)
    heatmap_mode: str = "ff_logit"  # the heatmap shown first (`heatmap=`; charts.HEATMAP_MODES)
    notice_field: str | None = None  # the form field the notice is about: shown next to it
    target: str | None = None  # the attribution's target as the URL asks (`target=`; None: the prediction)
    attribution: AttributionView | None = None  # who pushes the target token, here
    link: str | None = None  # this trace's URL, its share link; None: too long for a URL (sent by POST)


class AblationRow(BaseModel):
    prefix: str  # the trigger prefix, ending at the trigger token
    coefficient: float
    next_token: TokenRef | None
    value_before: float  # probability of the value's top token, memory on
    value_after: float  # … and switched off
    next_before: float | None
    next_after: float | None


class AblationContext(BaseModel):
    page: str = "ablation"
    title: str
    model: str
    layer: int
    key: int
    run: int
    value_token: TokenRef  # the value's top token (raw readout)
    rows: list[AblationRow]
    mean_value_change: float
    mean_next_change: float | None
    trace_url: str  # the top trigger's prefix in the live view, with this memory off


class AnalysisFigure(BaseModel):
    """One of the paper's figures on this run: our per-layer series beside the paper's reference values."""

    name: str  # fig3, fig4, …
    title: str
    text: str  # what the chart shows, in one paragraph
    unit: str  # share | count | probability | relative change | rank
    layers: list[int]
    depth: list[float]  # layer / (layers − 1): the paper's 16 layers and ours on one axis
    series: dict[str, list[float | None]]  # ours, by name
    paper: dict[str, list[list[float]]]  # the paper's values as [relative depth, value] points (approximate)


class AnalysisContext(BaseModel):
    page: str = "analysis"
    title: str
    model: str
    run: RunInfo
    computed: dict[str, dict]  # analysis → {options, seconds, created_at}
    missing: list[str]  # analyses not computed on this run yet
    figures: list[AnalysisFigure]
    jobs: list[JobInfo]  # the run's analysis jobs, newest first
    defaults: dict  # the options a new analysis job gets unless the form says otherwise
