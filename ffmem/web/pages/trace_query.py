"""What a live-view URL asks for (`TraceQuery`): the prompt, the selected position, the edits and the
target, read from the URL's query or a posted form; the same trace with some of it changed as a URL; and the
checks a trace's input passes before the live worker is asked.
"""

from __future__ import annotations

from ffmem.engine.live.interventions import (
    Intervention,
    InterventionError,
    format_interventions,
    parse_interventions,
)
from ffmem.engine.live.protocol import (
    MEMORIES,
    TARGET_CHARS,
    CircuitOptions,
    CircuitRequest,
    TraceRequest,
    text_max_length,
)
from ffmem.store.models import LanguageModel
from ffmem.web import urls
from ffmem.web.errors import AppError, sentence

DEFAULTS = {"readout": "norm", "memories": MEMORIES, "generate": 0}  # left out of the URL
CIRCUIT_DEFAULTS = CircuitOptions().model_dump()


class TraceQuery:
    """What a trace URL holds; `url(**changes)` is the same trace with some of it changed."""

    def __init__(
        self, model: LanguageModel, text, position, readout, memories, generate, intervene, target=None
    ) -> None:
        self.model, self.text, self.position, self.target = model, text, position, target
        self.readout, self.memories, self.generate = readout, memories, generate
        self.typed, self.error = intervene or "", None
        try:
            self.interventions = parse_interventions(intervene, model.n_layers, model.n_keys)
        except InterventionError as error:  # raised by check(); the form shows what was typed
            self.interventions = []
            self.error = AppError(400, "Bad intervention", sentence(str(error)), field="intervene")

    def url(self, fmt: str | None = None, **changes) -> str:
        values = {
            "text": self.text,
            "position": self.position,
            "intervene": format_interventions(self.interventions) or None,
            "readout": self.readout,
            "memories": self.memories,
            "generate": self.generate,
            "target": self.target,
        } | changes
        kept = {k: v for k, v in values.items() if v is not None and DEFAULTS.get(k) != v}
        return urls.trace_url(self.model.slug, fmt, **kept)

    def circuit_url(self, fmt: str | None = None, **options) -> str:
        """This trace's memory circuit (its prompt, position, edits, readout and target) with `options`
        (nodes, top, threshold, hops; left out of the URL at their defaults)."""
        values = {
            "text": self.text,
            "position": self.position,
            "intervene": format_interventions(self.interventions) or None,
            "readout": self.readout,
            "target": self.target,
        } | options
        kept = {
            k: v for k, v in values.items() if v is not None and CIRCUIT_DEFAULTS.get(k, DEFAULTS.get(k)) != v
        }
        return urls.circuit_url(self.model.slug, fmt, **kept)

    def share_link(self, max_query_bytes: int) -> str | None:
        """The trace's URL, its share link; None when its query is longer than the server accepts."""
        url = self.url()
        return url if len(url.partition("?")[2]) <= max_query_bytes else None

    def with_edit(self, edit: Intervention) -> str:
        others = [i for i in self.interventions if (i.layer, i.key) != (edit.layer, edit.key)]
        return self.url(intervene=format_interventions([*others, edit]))

    def without(self, layer: int, key: int) -> str:
        kept = [i for i in self.interventions if (i.layer, i.key) != (layer, key)]
        return self.url(intervene=format_interventions(kept) or None)

    def trace_request(self) -> TraceRequest:
        """The live worker's request for this trace."""
        return TraceRequest(**self._prompt(), memories=self.memories, generate=self.generate)

    def circuit_request(self, options: CircuitOptions) -> CircuitRequest:
        """The live worker's request for this trace's memory circuit, with `options`."""
        return CircuitRequest(**self._prompt(), **options.model_dump())

    def _prompt(self) -> dict:
        """The fields every live-worker request of this trace sends: the model, prompt, position, readout,
        edits and target."""
        return {
            "model": self.model.source,
            "text": self.text,
            "position": self.position,
            "readout": self.readout,
            "interventions": format_interventions(self.interventions),
            "target": self.target,
        }

    def check(self, max_tokens: int) -> None:
        """Refuse, before the live worker is asked (400, naming the field): a bad edit, an empty prompt or one
        too long to be within `max_tokens`, an empty target or one longer than a token."""
        if self.error:
            raise self.error
        if not self.text.strip():
            raise AppError(400, "Empty prompt", "The prompt is empty: type some text.", field="text")
        if len(self.text) > text_max_length(max_tokens):
            raise AppError(
                400, "Prompt too long", f"Prompts are limited to {max_tokens} tokens.", field="text"
            )
        if self.target == "":
            raise AppError(
                400,
                "Empty target",
                "The target is empty: type a token, e.g. ' London', or leave it out.",
                field="target",
            )
        if self.target is not None and len(self.target) > TARGET_CHARS:
            raise AppError(
                400,
                "Target too long",
                f"A target is one token: at most {TARGET_CHARS} characters.",
                field="target",
            )
