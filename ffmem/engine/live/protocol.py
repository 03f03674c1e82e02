"""The live worker's protocol, in one place: what the web asks (the requests), what the worker answers (the
answers) and the limits both hold a request to. The worker (ffmem/worker/live_app.py) parses these requests
and answers with these models; the web (ffmem/web/worker_client.py) sends the same requests, serialized,
and parses the answers into the same models; the web's forms take their limits from here, so a request
past a limit is refused by both with the same message. Importing it needs no torch (the web process imports
it). The longest prompt, in tokens, is a setting (Settings.max_prompt_tokens), which both read.

A trace's figures follow ffmem.engine.live.trace: `prediction`, `layers`, `active` and `ff_logit` are those
of the forward pass that was computed (with the interventions, if any), `unedited` the same figures of
the pass without them (None without interventions: there was one pass).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field

from ffmem.engine.paper.cases import CASES

# -- the limits ---------------------------------------------------------------------------------------------
PROMPT_CHARS = 100_000  # the longest text a form field takes (then the prompt's tokens are counted)
CHARS_PER_TOKEN = 32  # a text longer than this many characters a token is refused before the worker
MEMORIES, MAX_MEMORIES = 10, 100  # memories listed per layer: by default, at most
MAX_GENERATE = 20  # greedy tokens generated, with and without the interventions
MAX_VALUE_TOKENS = 20  # top tokens of each listed memory's value
INTERVENTION_CHARS = 4000  # the longest text of interventions
MAX_INTERVENTIONS, MAX_MAGNITUDE = 64, 1e4  # interventions at once; the largest |factor| or |coefficient|
TARGET_CHARS = 100  # the longest target text accepted (ffmem.engine.live.attribution_terms)
TARGET_FIELD_CHARS = 10_000  # the longest a target field takes (past TARGET_CHARS, refused by name)
# A circuit's defaults and maxima (ffmem.engine.live.circuit): hop-0 memories, upstream memories kept per
# memory, the relative cut, hops.
CIRCUIT_NODES, CIRCUIT_TOP, CIRCUIT_THRESHOLD, CIRCUIT_HOPS = 10, 5, 0.1, 1
MAX_CIRCUIT_NODES, MAX_CIRCUIT_TOP, MAX_CIRCUIT_HOPS = 50, 20, 2
MAX_ABLATION_PREFIXES = 100  # prefixes a memory is switched off on
# TokenChange (ffmem.engine.values.token_change): contexts by default and at most, the amplification factor
# (m → factor·m) by default and at most, the tokens listed of each direction and VocabProj's top compared.
CHANGE_CONTEXTS, MAX_CHANGE_CONTEXTS = 16, 64
CHANGE_FACTOR, MAX_CHANGE_FACTOR = 2.0, 100.0
CHANGE_TOP = 10
# A token search (ffmem.engine.live.token_search): memories listed each way at most (the search page's
# `limit` too), vocabulary tokens ranked together at most.
MAX_SEARCH_MEMORIES, MAX_SEARCH_TOKENS = 200, 16


def text_max_length(max_tokens: int) -> int:
    """The longest text a box sends to the worker, in characters (the worker then counts its tokens)."""
    return CHARS_PER_TOKEN * max_tokens


# -- the fields the requests and the web's forms share ----------------------------------------------------
Readout = Literal["norm", "raw"]
RankedBy = Literal["logit", "prob"]
Memories = Annotated[int, Field(ge=1, le=MAX_MEMORIES, description="Memories listed per layer.")]
Generate = Annotated[
    int, Field(ge=0, le=MAX_GENERATE, description="Greedy tokens generated with and without the edits.")
]
# (a text field is `str | None` inside: a form leaves it out as None)
Interventions = Annotated[
    str | None, Field(max_length=INTERVENTION_CHARS, description="L12K345, L12K345*0.5, L12K345=3.2, …")
]
Target = Annotated[
    str | None,
    Field(
        max_length=TARGET_FIELD_CHARS,
        description="The token to attribute: text (its first token) or #id (None: the prediction).",
    ),
]


class CircuitOptions(BaseModel):
    """How much of a memory circuit is kept (ffmem.engine.live.circuit)."""

    nodes: int = Field(
        CIRCUIT_NODES,
        ge=1,
        le=MAX_CIRCUIT_NODES,
        description="Memories that push the target most (hop 0), by |contribution|.",
    )
    top: int = Field(
        CIRCUIT_TOP, ge=1, le=MAX_CIRCUIT_TOP, description="Upstream memories kept per memory, by |term|."
    )
    threshold: float = Field(
        CIRCUIT_THRESHOLD,
        ge=0,
        le=1,
        description="An edge stays when |term| ≥ this × the largest |term| of its hop.",
    )
    hops: int = Field(
        CIRCUIT_HOPS,
        ge=1,
        le=MAX_CIRCUIT_HOPS,
        description="1: who feeds the hop-0 memories; 2: and who feeds those.",
    )


# -- the requests -----------------------------------------------------------------------------------------
class PromptRequest(BaseModel):
    """A prompt as a trace and a circuit take it."""

    model: str = Field(description="The model's source as indexed (LanguageModel.source).")
    text: str = Field(description="The prompt.")
    position: int | None = Field(None, ge=0, description="Token position to break down (default: the last).")
    readout: Readout = "norm"
    interventions: Interventions = ""
    target: Target = None


class TraceRequest(PromptRequest):
    """POST /trace: one prompt traced (answered with a TraceAnswer)."""

    path: ClassVar[str] = "/trace"
    memories: Memories = MEMORIES
    generate: Generate = 0
    value_tokens: int = Field(
        0, ge=0, le=MAX_VALUE_TOKENS, description="Top tokens of each listed memory's value."
    )


class CircuitRequest(CircuitOptions, PromptRequest):
    """POST /circuit: a prompt's memory circuit (ffmem.engine.live.circuit; answered with a CircuitAnswer)."""

    path: ClassVar[str] = "/circuit"


class AblationRequest(BaseModel):
    """POST /ablation: one memory switched off after each prefix (answered with an AblationAnswer)."""

    path: ClassVar[str] = "/ablation"
    model: str
    layer: int = Field(ge=0)
    key: int = Field(ge=0)
    prefixes: Annotated[list[list[int]], Field(min_length=1, max_length=MAX_ABLATION_PREFIXES)]
    targets: Annotated[list[list[int]], Field(min_length=1, max_length=MAX_ABLATION_PREFIXES)]


class CoefficientsRequest(BaseModel):
    """POST /coefficients: one memory's coefficient over a text (answered with a CoefficientsAnswer)."""

    path: ClassVar[str] = "/coefficients"
    model: str = Field(description="The model's source as indexed (LanguageModel.source).")
    text: str = Field(description="The text whose tokens are read.")
    layer: int = Field(ge=0)
    key: int = Field(ge=0)


class TokenChangeRequest(BaseModel):
    """POST /token-change: one memory amplified and switched off where its key fires — on the given prefixes
    (its top triggers, each ending at the token where it fires) or, with `text`, at the text's positions where
    its coefficient is highest (m > 0) — answered with a TokenChangeReport."""

    path: ClassVar[str] = "/token-change"
    model: str = Field(description="The model's source as indexed (LanguageModel.source).")
    layer: int = Field(ge=0)
    key: int = Field(ge=0)
    prefixes: Annotated[list[list[int]], Field(max_length=MAX_CHANGE_CONTEXTS)] = []
    text: str | None = Field(None, description="A text whose top positions are the contexts instead.")
    contexts: int = Field(
        CHANGE_CONTEXTS, ge=1, le=MAX_CHANGE_CONTEXTS, description="The most contexts taken from `text`."
    )
    factor: float = Field(
        CHANGE_FACTOR, gt=1, le=MAX_CHANGE_FACTOR, description="Amplified: m → factor·m at the context."
    )


class TokenMemoriesRequest(BaseModel):
    """POST /token-memories: over every memory of every layer, the (memory, token) pairs whose value promotes
    and suppresses these tokens most (answered with a TokenMemoriesAnswer): what a token search shows past
    the depth its run's token → memories table stores."""

    path: ClassVar[str] = "/token-memories"
    model: str = Field(description="The model's source as indexed (LanguageModel.source).")
    token_ids: Annotated[
        list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_SEARCH_TOKENS)
    ] = Field(description="The vocabulary tokens ranked together.")
    readout: Readout = "raw"
    by: RankedBy = Field("prob", description="logit, or log-probability (logit − the value's log Z).")
    limit: int = Field(ge=1, le=MAX_SEARCH_MEMORIES, description="Pairs listed each way.")


# -- the answers --------------------------------------------------------------------------------------------
Case = Literal[CASES]  # the paper's §5.2 cases


class MemoryAnswer(BaseModel):
    """One memory at the selected position, ranked by |m_i|·‖v_i‖."""

    layer: int
    key: int
    coefficient: float = Field(description="m_i at the position, signed (edited, with interventions).")
    score: float = Field(description="|m_i|·‖v_i‖: the size of its contribution to the FF output.")
    tokens: list[int] = Field([], description="Top tokens of sign(m_i)·v_i, when asked for.")
    unedited_coefficient: float | None = Field(None, description="m_i without the interventions.")


class LayerFigures(BaseModel):
    """One layer at the selected position in one forward pass (token ids under the trace's readout)."""

    layer: int
    top_r: int = Field(description="Top token of the residual entering the layer's FF.")
    top_y: int = Field(description="Top token of the FF output.")
    top_o: int = Field(description="Top token of the layer output o = r + y.")
    final_prob: float = Field(
        description="Probability of the pass's final prediction under r, the residual entering the layer's FF"
    )
    final_rank: int = Field(description="Its 0-based rank under r.")
    case: Case
    settled: bool = Field(description="top(r) is already the final prediction.")


class LayerAnswer(LayerFigures):
    memories: list[MemoryAnswer]


class ForwardFigures(BaseModel):
    """The figures of the forward pass without the interventions."""

    prediction: int
    layers: list[LayerFigures]
    active: list[list[int]] = Field(description="[layers][positions] active memories.")
    ff_logit: list[list[float]] = Field(description="[layers][positions] the FF's change to the final logit.")


class TokenChangeAnswer(BaseModel):
    token_id: int
    before: float = Field(description="Probability without the interventions.")
    after: float = Field(description="With them (= before without any).")


class EditAnswer(BaseModel):
    """One intervention as the worker applied it (ffmem.engine.live.interventions.Intervention)."""

    layer: int
    key: int
    mode: Literal["off", "scale", "set"]
    value: float


class ContributionAnswer(BaseModel):
    """One memory's direct contribution to the target's logit (ffmem.engine.live.attribution)."""

    layer: int
    key: int
    coefficient: float = Field(description="m_i at the position (edited, with interventions).")
    value_logit: float = Field(description="The target's logit in the value: v_i·e_t (raw), v_i·g_t (norm).")
    contribution: float = Field(description="m_i · value_logit: > 0 promotes the target, < 0 suppresses it.")


class LayerAttributionAnswer(BaseModel):
    """One layer's memories and the target's logit."""

    layer: int
    memories: list[ContributionAnswer] = Field(description="The largest |contribution|, largest first.")
    memories_sum: float = Field(description="Σ over all the layer's memories.")
    bias: float = Field(description="The FF's output bias read the same way (0 without one).")
    direct: float = Field(description="y·e_t (raw) or y·g_t (norm): = memories_sum + bias.")
    change: float = Field(description="The FF's change to the target's logit lens, lens(o) − lens(r).")
    residual: float = Field(description="change − (memories_sum + bias).")


class AttributionAnswer(BaseModel):
    """Who pushes the target token at the position, in the pass shown (ffmem.engine.live.attribution)."""

    target: int = Field(description="The token attributed.")
    typed: str | None = Field(None, description="The target as asked (None: the prediction).")
    typed_tokens: list[int] = Field([], description="The tokens it is (the first is attributed).")
    readout: Readout
    logit: float = Field(description="The target's logit after the position under the readout.")
    scale: float | None = Field(description="norm: the final norm's scale at the final residual.")
    total: float = Field(description="Σ of every memory's contribution over all layers.")
    layers: list[LayerAttributionAnswer]
    promoters: list[ContributionAnswer] = Field(description="The largest positive contributions overall.")
    suppressors: list[ContributionAnswer] = Field(description="The most negative overall.")


class TraceAnswer(BaseModel):
    """POST /trace: one prompt traced (ffmem.engine.live.trace.Trace, and the continuations as text)."""

    token_ids: list[int]
    position: int
    readout: Readout
    prediction: int = Field(description="The top token after `position` (with the interventions).")
    top_tokens: list[TokenChangeAnswer]
    layers: list[LayerAnswer]
    active: list[list[int]] = Field(description="[layers][positions] active memories.")
    ff_logit: list[list[float]] = Field(description="[layers][positions] the FF's change to the final logit.")
    unedited: ForwardFigures | None = Field(None, description="The figures without the interventions.")
    interventions: list[EditAnswer] = []
    edited_coefficients: list[float] = Field([], description="Each edited m_i at the position, unedited.")
    generated: list[int] = Field([], description="Greedy continuation without the interventions.")
    generated_edited: list[int] = Field([], description="And with them.")
    generated_text: str = ""
    generated_edited_text: str = ""
    attribution: AttributionAnswer | None = Field(None, description="Who pushes the target token, here.")


class AblationAnswer(BaseModel):
    """POST /ablation: each prefix's target probabilities, the memory as it is and switched off."""

    before: list[list[float]] = Field(description="[prefix][target]")
    after: list[list[float]] = Field(description="[prefix][target]")


class CoefficientsAnswer(BaseModel):
    """POST /coefficients: one memory's coefficient at every token of a text
    (ffmem.engine.live.key_coefficients)."""

    layer: int
    key: int
    token_ids: list[int]
    tokens: list[str] = Field(description="Each token's text, as the tokenizer decodes it alone.")
    offsets: list[tuple[int, int]] = Field(description="Each token's [start, end) characters in the text.")
    first_position: int = Field(description="1 when the tokenizer put a BOS first (never mined), else 0.")
    coefficients: list[float] = Field(description="m at every token, in order.")
    max: float = Field(description="The largest m over all tokens…")
    max_position: int = Field(description="… and where (the first such token).")
    min: float = Field(description="The smallest m over all tokens…")
    min_position: int = Field(description="… and where (the first such token).")


class TokenMemoryAnswer(BaseModel):
    """One (memory, token) pair of a token search."""

    layer: int
    key: int
    token_id: int
    score: float = Field(description="The token's logit in the value's readout, or its log-probability (by).")


class TokenMemoriesAnswer(BaseModel):
    """POST /token-memories: the strongest pairs each way, equal scores by memory (layer-major), then token
    (ffmem.engine.live.token_search)."""

    memories: int = Field(description="Memories ranked: every memory of every layer.")
    promote: list[TokenMemoryAnswer] = Field(description="The highest scores first.")
    suppress: list[TokenMemoryAnswer] = Field(description="The lowest scores first.")


class MemoryRefAnswer(BaseModel):
    layer: int
    key: int


class CircuitNodeAnswer(BaseModel):
    """One memory of a prompt's circuit (ffmem.engine.live.circuit)."""

    layer: int
    key: int
    coefficient: float = Field(description="m at the position (edited, with interventions).")
    contribution: float = Field(description="Its direct push on the target's logit, m·(v·e_t) or m·(v·g_t).")
    hop: int = Field(description="0: pushes the target most; 1: feeds a hop-0 memory; 2: feeds a hop-1 one.")
    upstream_sum: float | None = Field(
        description="Σ of every earlier memory's term into it (None: its inputs were not expanded)."
    )


class CircuitEdgeAnswer(BaseModel):
    """An earlier memory j feeding memory i's coefficient on this prompt."""

    upstream: MemoryRefAnswer = Field(description="j, the earlier memory.")
    downstream: MemoryRefAnswer = Field(description="i.")
    term: float = Field(description="m_j·(v_j·ρ_i): the first-order change of m_i that j's write causes.")
    coefficient: float = Field(description="m_i, the downstream coefficient.")


class CircuitAnswer(BaseModel):
    """POST /circuit: a prompt's memory circuit for one position and target (ffmem.engine.live.circuit)."""

    token_ids: list[int]
    position: int
    readout: Readout
    target: int = Field(description="The token attributed.")
    typed: str | None = Field(None, description="The target as asked (None: the prediction).")
    typed_tokens: list[int] = Field([], description="The tokens it is (the first is attributed).")
    logit: float = Field(description="The target's logit after the position under the readout.")
    nodes: list[CircuitNodeAnswer]
    edges: list[CircuitEdgeAnswer]
    largest_terms: list[float] = Field(description="Per hop, the largest |term| (the threshold's unit).")
    threshold: float
    top: int
    hops: int
    interventions: list[EditAnswer] = []


class TokenShiftAnswer(BaseModel):
    """One token's TokenChange: its mean log-probability change and its mean probabilities."""

    token_id: int
    change: float = Field(description="Mean over the contexts of log p(amplified) − log p(switched off).")
    base: float = Field(description="Mean probability, the memory as it is.")
    amplified: float = Field(description="… with m·factor at the context's last token.")
    off: float = Field(description="… with m = 0 there.")


class OutputScoreAnswer(BaseModel):
    """How well a value's logits (VocabProj, raw readout) predict the TokenChange
    (ffmem.engine.values.token_change.output_score)."""

    key: int = Field(description="The memory whose value is compared (the memory itself, or its control).")
    overlap: float = Field(description="Shared tokens of the two top-10 lists, / 10.")
    spearman: float = Field(description="Rank correlation over the whole vocabulary.")


class TokenChangeReport(BaseModel):
    """POST /token-change: what one memory does to the next token where its key fires
    (ffmem.engine.values.token_change)."""

    layer: int
    key: int
    factor: float
    contexts: list[list[int]] = Field(description="Each context's token ids, ending at the edited token.")
    coefficients: list[float] = Field(description="m at each context's last token (unedited).")
    promoted: list[TokenShiftAnswer] = Field(description="The largest changes: rise amplified, fall off.")
    suppressed: list[TokenShiftAnswer] = Field(description="The most negative: the reverse.")
    vocab_proj: list[int] = Field(description="The value's top tokens by its raw logits (v·E).")
    score: OutputScoreAnswer = Field(description="VocabProj against TokenChange.")
    control: OutputScoreAnswer = Field(
        description="A control memory's VocabProj against the same TokenChange."
    )
