"""The live worker's executor: the models a worker holds for live requests (GPU when there is one) and the one
thread that runs them, with the work itself — a request of ffmem.engine.live.protocol checked against the
loaded model and answered by the engine.

One request at a time per worker (one device), on a single thread; at most `queue` requests wait. Past
that, or while the requested model is still loading, it refuses with a `LiveError` 503 and Retry-After.
`ffmem worker` serves it beside its index work, on the same copy of the model (`shared_model`): a trace
holds the model's lock, so it waits for the batch being mined, and the other way round. Its HTTP face is
ffmem/worker/live_app.py.

A token search ranked by probability needs every value's log Z under its readout, a pass over the whole
vocabulary per value: the first such search of a model computes it (seconds on a GPU; on a CPU about as long
as the index's projection of that readout), and one under the norm readout each value's part of the final
norm; the executor keeps them, [memories] float32 each, while it holds the model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

from ffmem.config import Settings
from ffmem.engine.live.attribution_terms import target_tokens
from ffmem.engine.live.circuit import circuit
from ffmem.engine.live.interventions import Intervention, parse_interventions
from ffmem.engine.live.key_coefficients import key_coefficients
from ffmem.engine.live.protocol import (
    CHANGE_TOP,
    AblationAnswer,
    AblationRequest,
    CircuitAnswer,
    CircuitRequest,
    CoefficientsAnswer,
    CoefficientsRequest,
    OutputScoreAnswer,
    PromptRequest,
    TokenChangeReport,
    TokenChangeRequest,
    TokenMemoriesAnswer,
    TokenMemoriesRequest,
    TokenMemoryAnswer,
    TokenShiftAnswer,
    TraceAnswer,
    TraceRequest,
)
from ffmem.engine.live.token_search import token_search, value_log_z, value_scales
from ffmem.engine.live.trace import ablation, trace
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.loaded import LoadedModel, ModelLoadError
from ffmem.engine.model.loading import shared_model
from ffmem.engine.values.token_change import Context, scored, token_change

log = logging.getLogger("ffmem.worker")
Answer = TypeVar("Answer")
DEFAULTS = Settings.model_fields  # the user's settings, whose defaults a Live takes


class LiveError(Exception):
    """A request refused: `status`, the message, the seconds to wait (503) and `field`, the request field at
    fault (answered beside the message, so the page shows it there)."""

    def __init__(
        self, status: int, message: str, retry_after: int | None = None, *, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after, self.field = status, message, retry_after, field


class Live:
    """The models a worker holds for live requests and the one thread that runs them."""

    def __init__(
        self,
        *,
        device: str = DEFAULTS["device"].default,
        cache_dir: Path = DEFAULTS["cache_dir"].default,
        max_tokens: int = DEFAULTS["max_prompt_tokens"].default,
        queue: int = DEFAULTS["trace_queue"].default,
        models: int = DEFAULTS["live_models"].default,
    ) -> None:
        self.device, self.cache_dir, self.max_tokens = device, cache_dir, max_tokens
        self.queue, self.capacity = queue, models
        self.models: OrderedDict[str, LoadedModel] = OrderedDict()
        self.loading: str | None = None
        self.failed: dict[str, str] = {}
        self.kept: dict[tuple[str, str], object] = {}  # (source, name) → per-memory figures (token search)
        self.pending = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ffmem-live")
        self._lock = threading.Lock()

    def preload(self, source: str) -> None:
        """Start loading `source` on the worker thread; requests for it get 503 until it is ready."""
        self.loading = source
        self.executor.submit(self._load_logged, source)

    def _load_logged(self, source: str) -> None:
        try:
            self.model(source)
        except Exception as error:  # noqa: BLE001 - reported by /health and by the next request
            log.warning("could not load %s for live traces: %s", source, error)
        finally:
            self.loading = None

    def model(self, source: str) -> LoadedModel:
        """The loaded model for `source`: the process's one copy, shared with the worker's index work
        (loading it if no one has; the oldest past `capacity` is let go)."""
        with self._lock:
            if source in self.models:
                self.models.move_to_end(source)
                return self.models[source]
        try:
            loaded = shared_model(source, device=self.device, cache_dir=self.cache_dir)
        except ModelLoadError as error:
            self.failed[source] = str(error)
            raise
        with self._lock:
            self.failed.pop(source, None)
            self.models[source] = loaded
            while len(self.models) > self.capacity:
                gone, _ = self.models.popitem(last=False)
                self.kept = {k: kept for k, kept in self.kept.items() if k[0] != gone}
        return loaded

    async def run(self, source: str, work: Callable[[LoadedModel], Answer]) -> Answer:
        """Run `work` on the worker thread with `source`'s model, or refuse at once (503)."""
        if self.loading == source:
            raise LiveError(503, f"the live worker is still loading {source}; try again in a few seconds", 5)
        if self.pending >= self.queue:
            raise LiveError(
                503, f"the live worker is busy ({self.pending} traces waiting); try again shortly", 1
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, lambda: self._locked(source, work))
        finally:
            self.pending -= 1

    def _locked(self, source: str, work: Callable):
        """`work` on `source`'s model while holding it: the worker's index work shares it."""
        loaded = self.model(source)
        with loaded.lock:
            return work(loaded)

    def health(self) -> dict:
        status = "loading" if self.loading else ("ready" if self.models else "idle")
        return {
            "status": status,
            "loading": self.loading,
            "models": [
                {"source": s, "device": str(m.device), "dtype": str(m.dtype)} for s, m in self.models.items()
            ],
            "failed": self.failed,
            "pending": self.pending,
            "queue": self.queue,
            "max_tokens": self.max_tokens,
        }

    # -- the work, on the worker thread ------------------------------------------------------------
    def _check_prefixes(self, loaded: LoadedModel, prefixes: list[list[int]], targets=()) -> None:
        """Refuse (400) no prefix or an empty one, a token id outside the vocabulary (in the prefixes or
        `targets`), a prefix past max_prompt_tokens."""
        vocab = loaded.model.config.vocab_size
        if not prefixes or not all(prefixes):
            raise LiveError(400, "give at least one prefix, none of them empty")
        if not all(0 <= i < vocab for row in (*prefixes, *targets) for i in row):
            raise LiveError(400, f"token ids must lie in 0–{vocab - 1}")
        if max(len(p) for p in prefixes) > self.max_tokens:
            raise LiveError(400, f"a prefix is longer than {self.max_tokens} tokens (max_prompt_tokens)")

    def _checked(self, token_ids: list[int], text: str) -> None:
        """Refuse an empty prompt or one past max_prompt_tokens (400)."""
        if not text.strip() or not token_ids:
            raise LiveError(400, "the prompt is empty: type some text", field="text")
        if len(token_ids) > self.max_tokens:
            raise LiveError(
                400,
                f"the prompt has {len(token_ids)} tokens; the limit is {self.max_tokens} (max_prompt_tokens)",
                field="text",
            )

    def _prompt(
        self, loaded: LoadedModel, request: PromptRequest
    ) -> tuple[list[int], list[Intervention], list[int]]:
        """A trace's or circuit's prompt checked: (its token ids, the interventions, the target's tokens)."""
        token_ids = loaded.tokenizer(request.text).input_ids
        self._checked(token_ids, request.text)
        if request.position is not None and request.position >= len(token_ids):
            raise LiveError(
                400,
                f"position {request.position} is past the prompt's {len(token_ids)} tokens "
                f"(positions 0–{len(token_ids) - 1})",
            )
        interventions = parse_interventions(request.interventions, loaded.n_layers, loaded.n_keys)
        typed_tokens = target_tokens(loaded.tokenizer, loaded.model.config.vocab_size, request.target)
        return token_ids, interventions, typed_tokens

    def trace(self, loaded: LoadedModel, request: TraceRequest) -> TraceAnswer:
        token_ids, interventions, typed_tokens = self._prompt(loaded, request)
        result = trace(
            loaded,
            token_ids,
            request.position,
            memories=min(request.memories, loaded.n_keys),
            readout=request.readout,
            interventions=interventions,
            generate_tokens=request.generate,
            value_tokens=request.value_tokens,
            target=typed_tokens[0] if typed_tokens else None,
        )
        answer = asdict(result)
        if answer["attribution"] is not None:
            answer["attribution"] |= {"typed": request.target, "typed_tokens": typed_tokens}
        return TraceAnswer(
            **answer,
            generated_text=loaded.tokenizer.decode(result.generated),
            generated_edited_text=loaded.tokenizer.decode(result.generated_edited),
        )

    def circuit(self, loaded: LoadedModel, request: CircuitRequest) -> CircuitAnswer:
        token_ids, interventions, typed_tokens = self._prompt(loaded, request)
        result = circuit(
            loaded,
            token_ids,
            request.position,
            target=typed_tokens[0] if typed_tokens else None,
            readout=request.readout,
            interventions=interventions,
            nodes=request.nodes,
            top=request.top,
            threshold=request.threshold,
            hops=request.hops,
        )
        return CircuitAnswer(**asdict(result), typed=request.target, typed_tokens=typed_tokens)

    def coefficients(self, loaded: LoadedModel, request: CoefficientsRequest) -> CoefficientsAnswer:
        _check_memory(loaded, request.layer, request.key)
        encoded = loaded.tokenizer(request.text, return_offsets_mapping=True)
        token_ids = encoded.input_ids
        self._checked(token_ids, request.text)
        m = key_coefficients(loaded, token_ids, request.layer, request.key)  # [pos]
        bos = loaded.tokenizer.bos_token_id
        return CoefficientsAnswer(
            layer=request.layer,
            key=request.key,
            token_ids=token_ids,
            tokens=[loaded.tokenizer.decode([i]) for i in token_ids],
            offsets=[tuple(o) for o in encoded.offset_mapping],
            first_position=1 if bos is not None and len(token_ids) > 1 and token_ids[0] == bos else 0,
            coefficients=m.tolist(),
            max=float(m.max()),
            max_position=int(m.argmax()),
            min=float(m.min()),
            min_position=int(m.argmin()),
        )

    def ablation(self, loaded: LoadedModel, request: AblationRequest) -> AblationAnswer:
        _check_memory(loaded, request.layer, request.key)
        if len(request.targets) != len(request.prefixes) or len({len(t) for t in request.targets}) != 1:
            raise LiveError(400, "give one list of targets per prefix, all of the same length")
        self._check_prefixes(loaded, request.prefixes, request.targets)
        before, after = ablation(loaded, request.layer, request.key, request.prefixes, request.targets)
        return AblationAnswer(before=before, after=after)

    def token_change(self, loaded: LoadedModel, request: TokenChangeRequest) -> TokenChangeReport:
        """The memory amplified and switched off on the request's prefixes, or at its text's top positions."""
        _check_memory(loaded, request.layer, request.key)
        layer, key = request.layer, request.key
        if request.text is not None:
            token_ids = loaded.tokenizer(request.text).input_ids
            self._checked(token_ids, request.text)
            m = key_coefficients(loaded, token_ids, layer, key)  # [pos]
            first = 1 if loaded.bos_prepended and len(token_ids) > 1 else 0
            order = [p for p in m.argsort(descending=True).tolist() if p >= first and m[p] > 0]
            prefixes = [token_ids[: p + 1] for p in sorted(order[: request.contexts])]
            if not prefixes:
                raise LiveError(400, "the key never fires (m > 0) on this text: try another", field="text")
        else:
            prefixes = request.prefixes
            self._check_prefixes(loaded, prefixes)
        contexts = [Context(i, len(p) - 1) for i, p in enumerate(prefixes)]
        found = token_change(loaded, prefixes, [(layer, key)], [contexts], factor=request.factor)
        [score] = scored(loaded, found, [(layer, key)], CHANGE_TOP)
        change = found.change[0]  # [vocab]

        def shifts(largest: bool) -> list[TokenShiftAnswer]:
            ids = change.topk(CHANGE_TOP, largest=largest).indices.tolist()
            return [
                TokenShiftAnswer(
                    token_id=i,
                    change=float(change[i]),
                    base=float(found.base[0, i]),
                    amplified=float(found.amplified[0, i]),
                    off=float(found.off[0, i]),
                )
                for i in ids
            ]

        return TokenChangeReport(
            layer=layer,
            key=key,
            factor=request.factor,
            contexts=[list(p) for p in prefixes],
            coefficients=found.coefficients[0],
            promoted=shifts(True),
            suppressed=shifts(False),
            vocab_proj=score.vocab_proj,
            score=OutputScoreAnswer(key=key, **asdict(score.score)),
            control=OutputScoreAnswer(key=score.control_key, **asdict(score.control)),
        )

    def _kept(self, source: str, name: str, compute: Callable):
        """What `compute` gives for `source`'s model, computed once while the model is held."""
        if (source, name) not in self.kept:
            self.kept[source, name] = compute()
        return self.kept[source, name]

    def token_memories(self, loaded: LoadedModel, request: TokenMemoriesRequest) -> TokenMemoriesAnswer:
        vocab = resolve(loaded.model, loaded.adapter.unembedding).weight.shape[0]
        if max(request.token_ids) >= vocab:
            raise LiveError(400, f"token ids must lie in 0–{vocab - 1}", field="token_ids")
        source, readout = request.model, request.readout
        log_z = scales = None
        if request.by == "prob":
            log_z = self._kept(source, f"log_z {readout}", lambda: value_log_z(loaded, readout))  # [memories]
        if readout == "norm":
            scales = self._kept(source, "scales", lambda: value_scales(loaded))
        found = token_search(
            loaded, request.token_ids, readout=readout, by=request.by, limit=request.limit, log_z=log_z,
            scales=scales,
        )  # fmt: skip
        return TokenMemoriesAnswer(
            memories=loaded.n_layers * loaded.n_keys,
            **{
                name: [
                    TokenMemoryAnswer(
                        layer=m // loaded.n_keys, key=m % loaded.n_keys, token_id=t, score=score
                    )
                    for m, t, score in found[direction]
                ]
                for name, direction in (("promote", 1), ("suppress", -1))
            },
        )


def _check_memory(loaded: LoadedModel, layer: int, key: int) -> None:
    if layer >= loaded.n_layers or key >= loaded.n_keys:
        raise LiveError(400, f"no memory L{layer}K{key} in a {loaded.n_layers}×{loaded.n_keys} model")
