"""TokenChange: what a memory's value does to the next token, measured by real forward passes (Gur-Arieh et
al. 2025), and how well its vocabulary projection (VocabProj, ffmem.engine.values.projection) predicts it.

For a memory (layer ℓ, key i) and a context — a sentence and a position p where its key fires — the model
reads the sentence through p once (its attention keys and values cached, and the residual stream entering
layer ℓ at p kept); then it runs position p again from that cache twice: with m_i at p multiplied by
`factor` (amplified) and with m_i = 0 there (switched off). Layer ℓ, every later layer, the final norm and
the unembedding run for real: this is not the value's direct logits. Only position p is edited (the earlier
positions never see it) and nothing below layer ℓ changes, so an edit costs one token through the layers
from ℓ up.

A memory's TokenChange is, per vocabulary token t, the mean over its contexts of
    log p_amplified(t) − log p_off(t)
> 0: t rises when the memory is amplified and falls when it is switched off (what it promotes); < 0: the
reverse (what it suppresses). Its output score compares it with the value's own logits (`output_score`):
the overlap of the two top-`top` token sets, and the rank correlation over the whole vocabulary.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from ffmem.engine.mining.corpus import Batch, length_bucketed_batches
from ffmem.engine.model.adapters.base import resolve
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.values.projection import value_logits

ROWS = 48  # edited rows run at once (each holds a copy of its sentence's cache)
GROUP_TOKENS = 2048  # sentence tokens whose caches one padded pass computes
MIN_FILL = 0.75  # a sentence joins a group when its cache is at least this share of the group's width
UNEMBEDDED = 128  # contexts whose rows go through the unembedding at once (its weight read once for them)


@dataclass(frozen=True)
class Context:
    """One place where a memory's key fires: the sentence (its index in the list passed) and the position
    whose next token is read."""

    sentence: int
    position: int


@dataclass
class TokenChange:
    """Memories' TokenChange over their contexts (rows in the order of the memories passed)."""

    change: torch.Tensor  # [memories, vocab] float32: mean log p_amplified − log p_off
    base: torch.Tensor | None  # [memories, vocab] float32: mean p unedited (None: not asked)
    amplified: (
        torch.Tensor | None
    )  # [memories, vocab] float32: mean p with m·factor at the context's position
    off: torch.Tensor | None  # [memories, vocab] float32: mean p with m = 0 there
    contexts: list[int]  # per memory, the contexts averaged
    coefficients: list[list[float]]  # per memory, m at each of its contexts (unedited), in their order


def token_change(
    loaded: LoadedModel,
    sentences: Sequence[Sequence[int]],
    memories: Sequence[tuple[int, int]],
    contexts: Sequence[Sequence[Context]],
    *,
    factor: float,
    probabilities: bool = True,
) -> TokenChange:
    """Each memory's TokenChange over its own contexts (`contexts[j]` for `memories[j]`, positions into
    `sentences`), with the mean probabilities unedited (from the sentence's own pass), amplified and off
    where `probabilities`. A memory without contexts keeps zeros. Each sentence is read once for all the
    memories passed, so pass them together; memory grows with memories × vocabulary (a caller with tens of
    thousands passes them in chunks)."""
    vocab = resolve(loaded.model, loaded.adapter.unembedding).weight.shape[0]  # the logits' width
    n = len(memories)
    scales = (factor, 0.0)  # the rows of a context (its unedited logits come from the sentence's pass)
    names = ("change", *(("base", "amplified", "off") if probabilities else ()))
    sums = {name: torch.zeros(n, vocab) for name in names}  # [n, vocab] each
    at: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # sentence → [(row, position, index)]
    for row, found in enumerate(contexts):
        for index, context in enumerate(found):
            at[context.sentence].append((row, context.position, index))
    coefficients = [[0.0] * len(found) for found in contexts]
    ends = {sentence: 1 + max(p for _, p, _ in wanted) for sentence, wanted in at.items()}  # tokens read
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (memory rows, last hidden states) to unembed
    with torch.inference_mode():
        for group in _groups(sorted(at, key=lambda s: -ends[s]), ends):
            texts = [sentences[s] for s in group]
            wanted = sorted(
                ((slot, *context) for slot, s in enumerate(group) for context in at[s]),
                key=lambda w: memories[w[1]][0],
            )  # by the memory's layer: a chunk's rows start at its lowest
            per = ROWS // len(scales)
            chunks = [wanted[start : start + per] for start in range(0, len(wanted), per)]
            firsts = [memories[chunk[0][1]][0] for chunk in chunks]
            cached = _group_cache(loaded, texts, [ends[s] for s in group], chunks, firsts)
            for number, (chunk, first) in enumerate(zip(chunks, firsts, strict=True)):
                edited = _Edited(first, cached.entering[number], cached.final[number], cached.tuples)
                read, states = _fold(loaded, texts, cached.cache, memories, chunk, scales, edited)
                rows = torch.tensor([row for _, row, _, _ in chunk])  # [contexts]
                pending.append((rows, states if probabilities else states[:, 1:]))
                for (_, row, _, index), m in zip(chunk, read, strict=True):
                    coefficients[row][index] = m
                if sum(len(found) for found, _ in pending) >= UNEMBEDDED:
                    _unembed(loaded, pending, sums)
        if pending:
            _unembed(loaded, pending, sums)
    counts = torch.tensor([len(found) for found in contexts], dtype=torch.float32).clamp(min=1)[:, None]
    means = {name: total.div_(counts) for name, total in sums.items()}  # [n, vocab] each, in place
    means = {"base": None, "amplified": None, "off": None} | means
    return TokenChange(**means, contexts=[len(found) for found in contexts], coefficients=coefficients)


def _groups(order: list[int], ends: dict[int, int]) -> list[list[int]]:
    """Sentences (the longest read first) in groups of at most GROUP_TOKENS padded tokens, each at least
    MIN_FILL of its group's width (padding is work too)."""
    groups: list[list[int]] = []
    for sentence in order:
        width = ends[groups[-1][0]] if groups else 0
        if groups and (len(groups[-1]) + 1) * width <= GROUP_TOKENS and ends[sentence] >= MIN_FILL * width:
            groups[-1].append(sentence)
        else:
            groups.append([sentence])
    return groups


@dataclass
class _Cached:
    """A group's one pass: its cache and, per chunk of contexts, the residual stream entering the chunk's
    first layer at each context's position."""

    cache: DynamicCache
    entering: list[torch.Tensor]  # per chunk [contexts, d]
    final: list[torch.Tensor]  # per chunk [contexts, d]: the last hidden state (final norm and all) there
    tuples: bool  # whether the model's blocks return tuples (their hidden state first)


@dataclass(frozen=True)
class _Edited:
    """Where a chunk's rows start: its first (lowest) layer, the residual stream entering it, the unedited
    last hidden state, the blocks' output shape."""

    first: int
    entering: torch.Tensor  # [contexts, d]
    final: torch.Tensor  # [contexts, d]
    tuples: bool


def _group_cache(
    loaded: LoadedModel,
    texts: list[Sequence[int]],
    ends: list[int],
    chunks: list[list[tuple[int, int, int, int]]],
    firsts: list[int],
) -> _Cached:
    """One padded pass (no logits) through each sentence's first `ends` tokens: the cache [group, …, width,
    …] and, read off as it runs, each chunk's residual stream entering its first layer at its contexts."""
    width = max(ends)
    ids = torch.zeros((len(texts), width), dtype=torch.long)  # [group, width] right-padded
    mask = torch.zeros((len(texts), width), dtype=torch.long)  # [group, width]
    for slot, (text, n) in enumerate(zip(texts, ends, strict=True)):
        ids[slot, :n] = torch.tensor(list(text[:n]))
        mask[slot, :n] = 1
    blocks = loaded.adapter.blocks(loaded.model)
    entering: list[torch.Tensor | None] = [None] * len(chunks)
    tuples: list[bool] = []

    def read(layer: int):
        wanted = [(index, chunk) for index, chunk in enumerate(chunks) if firsts[index] == layer]

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]  # [group, width, d]
            for index, chunk in wanted:
                entering[index] = hidden[_slots(chunk, hidden.device), _positions(chunk, hidden.device)]

        return hook

    handles = [
        blocks[layer].register_forward_pre_hook(read(layer), with_kwargs=True) for layer in set(firsts)
    ]
    handles.append(
        blocks[0].register_forward_hook(lambda m, i, output: tuples.append(isinstance(output, tuple)))
    )
    cache = DynamicCache()  # every layer whole: a sliding layer's would keep only the batch's last positions
    try:
        last = loaded.model.base_model(
            input_ids=ids.to(loaded.device),
            attention_mask=mask.to(loaded.device),
            cache=cache,
            use_cache=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    final = [
        last.last_hidden_state[_slots(chunk, ids.device), _positions(chunk, ids.device)] for chunk in chunks
    ]
    return _Cached(cache, entering, final, tuples[0])  # final: [contexts, d] each


def _slots(chunk: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([slot for slot, _, _, _ in chunk], device=device)  # [contexts]


def _positions(chunk: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([p for _, _, p, _ in chunk], device=device)  # [contexts]


def _fold(
    loaded: LoadedModel,
    texts: list[Sequence[int]],
    cache: DynamicCache,
    memories: Sequence[tuple[int, int]],
    chunk: list[tuple[int, int, int, int]],
    scales: tuple[float, ...],
    edited: _Edited,
) -> tuple[list[float], torch.Tensor]:
    """Run the chunk's contexts (slot of its sentence in the group, memory row, position, index): per context
    a row per scale of m — amplified and switched off — each position p from its sentence's cache
    of the positions before it and from the chunk's first layer on (the layers below it are the unedited
    pass's: its residual stream is put in there). Each context's unedited m, and its last hidden states
    [contexts, 3, d]: unedited (the sentence's pass's), amplified, off."""
    k = len(scales)
    slots = torch.tensor([slot for slot, _, _, _ in chunk for _ in range(k)], device=loaded.device)  # [rows]
    positions = torch.tensor([p for _, _, p, _ in chunk for _ in range(k)], device=loaded.device)  # [rows]
    rows = len(positions)
    ids = torch.tensor(
        [[texts[slot][p]] for slot, _, p, _ in chunk for _ in range(k)], device=loaded.device
    )  # [rows, 1]
    width = cache.get_seq_length()
    # Row r sees its p cached positions (right-aligned by `_selected`) and itself: [rows, width + 1].
    mask = torch.arange(width + 1, device=loaded.device)[None, :] >= (width - positions)[:, None]
    factors = torch.tensor([s for _ in chunk for s in scales], device=loaded.device)  # [rows]
    edits: dict[int, list[tuple[int, int]]] = defaultdict(list)  # layer → [(row, key)]
    for index, (_, row, _, _) in enumerate(chunk):
        layer, key = memories[row]
        edits[layer] += [(k * index + offset, key) for offset in range(k)]
    blocks = loaded.adapter.blocks(loaded.model)
    read: dict[int, float] = {}  # row → its m before the edit
    entering = edited.entering.repeat_interleave(k, dim=0)[:, None, :]  # [rows, 1, d]
    with ExitStack() as stack:
        for layer, found in edits.items():
            projection = loaded.adapter.value_projection(blocks[layer])
            stack.enter_context(projection.register_forward_pre_hook(_scale(found, factors, rows, read)))
        for block in blocks[: edited.first]:
            stack.enter_context(_skipped(block, edited.tuples))
        stack.enter_context(
            blocks[edited.first].register_forward_pre_hook(_entering(entering), with_kwargs=True)
        )
        hidden = loaded.model.base_model(
            input_ids=ids,
            attention_mask=mask.long(),
            position_ids=positions[:, None],
            cache=_selected(cache, slots, positions, edited.first),
            use_cache=True,
        ).last_hidden_state[:, -1]  # [rows, d]
    states = torch.cat([edited.final[:, None], hidden.reshape(len(chunk), k, -1)], dim=1)  # [contexts, 3, d]
    return [read[k * index] for index in range(len(chunk))], states  # m before its row's edit


def _unembed(
    loaded: LoadedModel, pending: list[tuple[torch.Tensor, torch.Tensor]], sums: dict[str, torch.Tensor]
) -> None:
    """The pending contexts' last hidden states through the unembedding in one product: their
    log-probability changes amplified − off (and, with the unedited state first, their probabilities)
    added to their memories' `sums`; `pending` emptied."""
    rows = torch.cat([found for found, _ in pending])  # [contexts]
    states = torch.cat([state for _, state in pending])  # [contexts, 3 or 2, d]
    pending.clear()
    unembedding = resolve(loaded.model, loaded.adapter.unembedding)
    log_p = unembedding(states).float().log_softmax(dim=-1).cpu()  # [contexts, 3 or 2, vocab]
    sums["change"].index_add_(0, rows, log_p[:, -2] - log_p[:, -1])  # amplified − off
    if "base" in sums:
        p = log_p.exp()  # [contexts, 3, vocab]
        for index, name in enumerate(("base", "amplified", "off")):
            sums[name].index_add_(0, rows, p[:, index])


@contextmanager
def _skipped(block: nn.Module, tuples: bool) -> Iterator[None]:
    """A block below the edited layers passes its input through unchanged, in its output's shape (its
    output is replaced at the first edited layer's input anyway)."""

    def forward(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return (hidden, None) if tuples else hidden

    block.forward = forward
    try:
        yield
    finally:
        del block.forward


def _entering(entering: torch.Tensor):
    """A pre-hook on the first edited layer's block: its input is the unedited pass's residual stream."""

    def hook(module, args, kwargs):
        if args:
            return (entering.to(args[0].dtype), *args[1:]), kwargs
        return args, kwargs | {"hidden_states": entering.to(kwargs["hidden_states"].dtype)}

    return hook


def _scale(found: list[tuple[int, int]], scales: torch.Tensor, rows: int, read: dict[int, float]):
    """A hook on a layer's value projection: each (row, key)'s coefficient at the row's one position
    multiplied by the row's scale (what it was goes into `read`)."""
    row_ids = torch.tensor([row for row, _ in found])  # [edits]
    key_ids = torch.tensor([key for _, key in found])  # [edits]

    def hook(module, inputs):
        coefficients = inputs[0].clone()  # [rows, 1, d_ff] ([rows, d_ff] for OPT)
        flat = coefficients.view(rows, -1)  # [rows, d_ff]: one position a row
        before = flat[row_ids, key_ids]  # [edits]
        read.update(zip(row_ids.tolist(), before.float().tolist(), strict=True))
        flat[row_ids, key_ids] = before * scales[row_ids].to(flat.dtype)
        return (coefficients, *inputs[1:])

    return hook


def _selected(cache: DynamicCache, slots: torch.Tensor, positions: torch.Tensor, first: int) -> DynamicCache:
    """A fresh cache holding, for each row, its sentence's keys and values before its position p,
    right-aligned (left-padded: the row's query sits right after them, so a sliding window counts back from
    it), every layer whole (no sliding layer drops what a row needs); the layers below `first`, which the
    rows skip, hold one sentence's (only their width is read). The rows' pass appends to it."""
    width = cache.get_seq_length()
    shift = width - positions  # [rows]: position j of a row is at slot j + shift
    at = torch.arange(width, device=positions.device)[None, :] - shift[:, None]  # [rows, width]
    at = at.clamp(min=0)  # the left padding reads position 0 (masked)
    selected = DynamicCache()
    for index, layer in enumerate(cache.layers):
        if index < first:
            keys = values = layer.keys[:1]  # [1, heads, width, head_dim]: never read, only its width
        else:
            heads = torch.arange(layer.keys.shape[1], device=positions.device)[None, :, None]  # [1, heads, 1]
            keys = layer.keys[slots[:, None, None], heads, at[:, None, :]]  # [rows, heads, width, head_dim]
            values = layer.values[
                slots[:, None, None], heads, at[:, None, :]
            ]  # [rows, heads, width, head_dim]
        selected.update(keys, values, index)
    return selected


@dataclass(frozen=True)
class OutputScore:
    """How well a value's logits (VocabProj) predict a TokenChange."""

    overlap: float  # |top-k of TokenChange ∩ top-k of the value's logits| / k
    spearman: float  # rank correlation of the two over the whole vocabulary


def output_score(change: torch.Tensor, value_logits: torch.Tensor, top: int) -> OutputScore:
    """The agreement of one TokenChange [vocab] with one value's logits [vocab]."""
    return output_scores(change[None], _ranks(change[None]), value_logits[None], top)[0]


def output_scores(
    change: torch.Tensor, change_ranks: torch.Tensor, value_logits: torch.Tensor, top: int
) -> list[OutputScore]:
    """The agreement of each TokenChange (`change` [rows, vocab] and its `_ranks`) with the value logits of
    its row ([rows, vocab]): the overlap of the two top-`top` sets and Spearman's rank correlation, which for
    ranks without ties (ties broken by order: logits of floats rarely tie) is 1 − 6·Σd² / (n(n² − 1))."""
    n = change.shape[-1]
    promoted = change.topk(top, dim=-1).indices  # [rows, top]
    read = value_logits.topk(top, dim=-1).indices  # [rows, top]
    common = (promoted[:, :, None] == read[:, None, :]).any(dim=-1).sum(dim=-1)  # [rows]
    apart = (change_ranks - _ranks(value_logits)).pow_(2).sum(dim=-1)  # [rows]: Σd²
    spearman = 1 - 6 * apart / (n * (n * n - 1)) if n > 1 else torch.zeros_like(apart)  # [rows]
    return [
        OutputScore(overlap=int(c) / top, spearman=float(r))
        for c, r in zip(common.tolist(), spearman.tolist(), strict=True)
    ]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Each entry's 0-based rank in its row, ties broken by order: [rows, n] → [rows, n] float64 (one sort
    and a scatter, not two sorts)."""
    order = x.argsort(dim=-1, stable=True)  # [rows, n]
    steps = torch.arange(x.shape[-1], dtype=torch.float64).expand(order.shape)  # [rows, n]
    return torch.empty(order.shape, dtype=torch.float64).scatter_(-1, order, steps)


def control_key(key: int, n_keys: int) -> int:
    """The control memory of `key` in its layer: a fixed shuffle (the key half a layer away), never itself
    when the layer has two keys or more."""
    return (key + n_keys // 2) % n_keys


@dataclass(frozen=True)
class Scored:
    """A memory's output score and its control's: the control memory's value against the same TokenChange."""

    score: OutputScore
    control_key: int
    control: OutputScore
    vocab_proj: list[int]  # the value's top tokens by its raw logits, the `top` compared


def scored(
    loaded: LoadedModel, found: TokenChange, memories: Sequence[tuple[int, int]], top: int, rows: int = 64
) -> list[Scored]:
    """Each memory's VocabProj (its value's raw logits, v·E) and its control's against its TokenChange, `rows`
    memories at a time (their TokenChange ranked once for both)."""
    blocks = loaded.adapter.blocks(loaded.model)
    out = []
    with torch.inference_mode():
        for start in range(0, len(memories), rows):
            part = memories[start : start + rows]
            others = [control_key(key, loaded.n_keys) for _, key in part]
            read = [*part, *((layer, other) for (layer, _), other in zip(part, others, strict=True))]
            values = torch.stack(
                [loaded.adapter.value_matrix(blocks[layer])[key] for layer, key in read]
            )  # [2·part, d]: the memories', then their controls'
            logits = value_logits(loaded, values, "raw").float().cpu()  # [2·part, vocab]
            change = found.change[start : start + len(part)]  # [part, vocab]
            change_ranks = _ranks(change)  # [part, vocab]
            own, control = (
                output_scores(change, change_ranks, half, top) for half in logits.split(len(part))
            )
            vocab_proj = logits[: len(part)].topk(top, dim=-1).indices.tolist()  # [part, top]
            out += [Scored(*fields) for fields in zip(own, others, control, vocab_proj, strict=True)]
    return out


def firing_contexts(
    loaded: LoadedModel,
    sentences: Sequence[Sequence[int]],
    first_positions: Sequence[int],
    memories: Sequence[tuple[int, int]],
    *,
    per_memory: int,
    batch_tokens: int,
    pad_id: int,
) -> list[list[Context]]:
    """Each memory's `per_memory` contexts where its key fires most (m > 0), over `sentences` from each one's
    first position on: one batched pass, its coefficients read off as it runs (ffmem.engine.model.hooks)."""
    by_layer: dict[int, list[int]] = defaultdict(list)  # layer → rows of `memories`
    for row, (layer, _) in enumerate(memories):
        by_layer[layer].append(row)
    keys = {layer: torch.tensor([memories[r][1] for r in rows]) for layer, rows in by_layer.items()}
    best = {layer: torch.full((len(rows), per_memory), -torch.inf) for layer, rows in by_layer.items()}
    where = {
        layer: torch.zeros((len(rows), per_memory, 2), dtype=torch.long) for layer, rows in by_layer.items()
    }
    current: list[Batch] = []

    def fold(layer: int, coefficients: torch.Tensor) -> None:
        if layer not in keys:
            return
        batch = current[0]
        m = coefficients[..., keys[layer].to(coefficients.device)].float()  # [batch, pos, k]
        m = m.masked_fill(~batch.mined[..., None], -torch.inf).cpu()  # [batch, pos, k]
        width = m.shape[1]
        flat = m.reshape(-1, m.shape[-1]).T  # [k, batch·pos]
        found = flat.topk(min(per_memory, flat.shape[1]), dim=1)  # [k, n] each
        rows, positions = found.indices // width, found.indices % width  # [k, n] each
        sentence = batch.sentence_index.cpu()[rows]  # [k, n]
        values = torch.cat([best[layer], found.values], dim=1)  # [k, per + n]
        places = torch.cat(
            [where[layer], torch.stack([sentence, positions], dim=-1)], dim=1
        )  # [k, per + n, 2]
        kept = values.topk(per_memory, dim=1)  # [k, per]
        best[layer] = kept.values
        where[layer] = places.gather(1, kept.indices[..., None].expand(-1, -1, 2))

    batches = length_bucketed_batches(
        [list(s) for s in sentences],
        list(first_positions),
        indices=range(len(sentences)),
        batch_tokens=batch_tokens,
        pad_id=pad_id,
    )
    with (
        torch.inference_mode(),
        capture(loaded.model, loaded.adapter, list(by_layer), fields=("coefficients",), on_coefficients=fold),
    ):
        for batch in batches:
            current[:] = [batch.to(loaded.device)]
            loaded.model.base_model(
                input_ids=current[0].input_ids, attention_mask=current[0].attention_mask, use_cache=False
            )
    contexts: list[list[Context]] = [[] for _ in memories]
    for layer, rows in by_layer.items():
        for index, row in enumerate(rows):
            fires = best[layer][index] > 0  # [per]
            contexts[row] = [Context(int(s), int(p)) for s, p in where[layer][index][fires].tolist()]
    return contexts
