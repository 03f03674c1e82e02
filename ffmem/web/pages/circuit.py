"""The live view's memory circuit: for the selected position and target, the memories that push the target
most and the earlier memories that fed their coefficients on this prompt (ffmem.engine.live.circuit, asked of
the live worker), each named with its value's own top token from the index and linked to its key page."""

from __future__ import annotations

from pydantic import Field

from ffmem.engine.live.interventions import format_interventions
from ffmem.engine.live.protocol import CircuitEdgeAnswer, CircuitNodeAnswer, CircuitOptions
from ffmem.store import memory_reads, vocabularies
from ffmem.store.db import Session
from ffmem.web import urls
from ffmem.web.pages.trace import PromptToken, value_run
from ffmem.web.pages.trace_query import TraceQuery
from ffmem.web.views import ModelPage, TokenRef
from ffmem.web.worker_client import LiveWorker


class CircuitMemory(CircuitNodeAnswer):
    """A memory of the circuit at the selected position: the worker's node, named and linked."""

    top_token: TokenRef | None = Field(
        description="The top token of sign(m)·v under the readout (None: the index has none)."
    )
    url: str = Field(description="The key page.")


class CircuitContext(ModelPage):
    """A prompt's memory circuit for one position and target, asked of the live worker."""

    page: str = "circuit"
    text: str | None = Field(description="None: no prompt yet (the form only).")
    position: int | None
    readout: str
    target: str | None = Field(description="The target as the URL asks (`target=`; None: the prediction).")
    interventions: str = Field(description="The edits as the URL keeps them.")
    options: CircuitOptions
    max_tokens: int
    notice: str | None = Field(None, description="Why there is no circuit (worker down, loading or busy).")
    notice_field: str | None = Field(None, description="The form field the notice is about.")
    run: int | None = Field(None, description="The index run whose value tokens name the memories.")
    tokens: list[PromptToken] = Field([], description="The prompt; each token's URL selects its position.")
    attributed: TokenRef | None = Field(None, description="The token attributed.")
    logit: float | None = Field(None, description="Its logit after the position under the readout.")
    nodes: list[CircuitMemory] = []
    edges: list[CircuitEdgeAnswer] = Field(
        [], description="upstream → downstream: term = m_j·(v_j·ρ_i), coefficient = m_i; per hop, by |term|."
    )
    largest_terms: list[float] = Field([], description="Per hop, the largest |term| (the threshold's unit).")
    trace_url: str = Field(description="The live view of the same prompt, position and target.")
    link: str | None = Field(None, description="This circuit's URL, its share link.")


def circuit_form(q: TraceQuery, options: CircuitOptions, max_tokens: int, **shown) -> CircuitContext:
    """The circuit page without a circuit: its form (and `shown`: why there is none)."""
    query = dict(
        title=f"{q.model.slug}: memory circuit",
        model=q.model.slug,
        text=q.text,
        position=q.position,
        readout=q.readout,
        target=q.target,
        interventions=q.typed if q.error else format_interventions(q.interventions),
        options=options,
        max_tokens=max_tokens,
        trace_url=q.url(),
        link=q.circuit_url(**options.model_dump()),
    )
    return CircuitContext(**query | shown)


def circuit_page(
    session: Session, live: LiveWorker, q: TraceQuery, options: CircuitOptions, max_tokens: int
) -> CircuitContext:
    """The circuit `q` and `options` ask for (without a prompt: the form only)."""
    if q.text is None:
        return circuit_form(q, options, max_tokens)
    q.check(max_tokens)
    answer = live.circuit(q.circuit_request(options))
    run = value_run(session, q.model)
    signed = {(n.layer, n.key, 1 if n.coefficient >= 0 else -1) for n in answer.nodes}
    tops = {}
    if run is not None:
        tops = memory_reads.memory_value_tokens(
            session=session, run_id=run.id, readout=q.readout, memories=signed, n=1
        )
    wanted = set(answer.token_ids) | {answer.target} | {ids[0] for ids in tops.values() if ids}
    texts = vocabularies.token_texts(session=session, model_id=q.model.id, token_ids=wanted)

    def ref(token_id: int) -> TokenRef:
        return TokenRef(token_id=token_id, token=texts.get(token_id, ""))

    def top_token(layer: int, key: int, coefficient: float) -> TokenRef | None:
        ids = tops.get((layer, key, 1 if coefficient >= 0 else -1))
        return ref(ids[0]) if ids else None

    return circuit_form(
        q,
        options,
        max_tokens,
        position=answer.position,
        run=None if run is None else run.id,
        tokens=[
            PromptToken(
                position=i, url=q.circuit_url(position=i, **options.model_dump()), **ref(t).model_dump()
            )
            for i, t in enumerate(answer.token_ids)
        ],
        attributed=ref(answer.target),
        logit=answer.logit,
        nodes=[
            CircuitMemory(
                **n.model_dump(),
                top_token=top_token(n.layer, n.key, n.coefficient),
                url=urls.key_url(q.model.slug, n.layer, n.key),
            )
            for n in answer.nodes
        ],
        edges=answer.edges,
        largest_terms=answer.largest_terms,
    )
