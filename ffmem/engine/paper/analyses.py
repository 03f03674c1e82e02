"""The paper's §5 analyses over held-out examples, per layer (Figs. 7–11): one prefix per example,
read at its last token, as `ffmem.engine.live.trace` reads one prompt.

- Fig. 7, active memories: how many memories have m > 0, and how many are non-negligible (|m| within
  3 octaves of the strongest at that position; signed activations have no zero);
- Fig. 8, composition: the share of examples whose FF output's top token is the value top token of
  none of the active memories (non-negligible ones; for ReLU-like activations, m > 0), each value
  read in the direction its coefficient's sign gives; and, among the others, the share where that
  token is a stop word;
- Figs. 9–10, residual refinement: the share whose residual top token already is the model's final
  prediction, and the mean probability of the final prediction under the residual;
- Fig. 11, cases: the share of agreement / residual / ffn / composition (ffmem.engine.paper.cases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby

import torch
from tqdm.auto import tqdm

from ffmem.engine.live.trace import ACTIVE_RATIO, read_layers, top_index
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel
from ffmem.engine.paper.cases import CASES
from ffmem.engine.values.projection import readout_input


@dataclass
class Census:
    """Per-layer figures over `examples` held-out prefixes (lists indexed by layer)."""

    examples: int
    positive: list[float]  # mean number of memories with m > 0 (Fig. 7)
    active: list[float]  # mean number of non-negligible memories (|m| ≥ 2⁻³ of the strongest)
    no_memory_agrees: list[float]  # share where top(y) is no active memory's value top token (Fig. 8)
    stop_words: list[float | None]  # of the examples where one is, the share where it is a stop word
    settled: list[float]  # share where top(r) already is the final prediction (Fig. 9)
    final_prob: list[float]  # mean probability of the final prediction under r (Fig. 10)
    cases: dict[str, list[float]]  # share of each §5.2 case (Fig. 11)


def census(
    loaded: LoadedModel,
    prefixes: Sequence[Sequence[int]],
    value_top: torch.Tensor,
    stop_ids: set[int],
    *,
    readout: str = "norm",
    batch: int = 8,
    progress: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
) -> Census:
    """Read every prefix at its last token. `value_top` [layers, 2, d_ff] holds each value's top token
    (index 0, for m > 0) and bottom token (index 1, for m < 0). `on_batch(done, total)` after each."""
    if not prefixes:
        raise ValueError("census needs at least one prefix")
    sums: dict[str, torch.Tensor] = {}  # per-layer sums over all prefixes, by figure
    value_top = value_top.to(loaded.device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=loaded.device)
    starts = range(0, len(prefixes), batch)
    for done, start in enumerate(tqdm(starts, desc="census", unit="batch", disable=not progress), 1):
        part = _batch(loaded, prefixes[start : start + batch], value_top, stops, readout)
        for name, values in part.items():
            sums[name] = sums.get(name, 0) + values.double().cpu()
        if on_batch is not None:
            on_batch(done, len(starts))
    n = len(prefixes)
    agree = sums["agree"]
    return Census(
        examples=n,
        positive=(sums["positive"] / n).tolist(),
        active=(sums["active"] / n).tolist(),
        no_memory_agrees=(sums["unmatched"] / n).tolist(),
        stop_words=[None if a == 0 else float(s / a) for s, a in zip(sums["stop"], agree, strict=True)],
        settled=(sums["settled"] / n).tolist(),
        final_prob=(sums["prob"] / n).tolist(),
        cases={case: (sums[case] / n).tolist() for case in CASES},
    )


def _batch(
    loaded: LoadedModel,
    prefixes: Sequence[Sequence[int]],
    value_top: torch.Tensor,
    stops: torch.Tensor,
    readout: str,
) -> dict[str, torch.Tensor]:
    """Per-layer sums over one batch of prefixes (right-padded, each read at its last token)."""
    lengths = torch.tensor([len(p) for p in prefixes], device=loaded.device)  # [B]
    width, b = int(lengths.max()), len(prefixes)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer is not None else None
    ids = torch.full((b, width), pad or 0, device=loaded.device)  # [B, width]
    for row, prefix in enumerate(prefixes):
        ids[row, : len(prefix)] = torch.tensor(list(prefix))
    mask = (torch.arange(width, device=loaded.device)[None, :] < lengths[:, None]).long()  # [B, width]
    rows, last = torch.arange(b, device=loaded.device), lengths - 1
    with loaded.lock, torch.inference_mode():  # hooks on a model live traces share: one pass at a time
        with capture(loaded.model, loaded.adapter) as captured:
            nothing = torch.empty(0, dtype=torch.long, device=loaded.device)
            loaded.model(ids, attention_mask=mask, logits_to_keep=nothing, use_cache=False)
        layers = sorted(captured.coefficients)

        def at_last(store) -> torch.Tensor:
            return torch.stack([store[layer][rows, last] for layer in layers], dim=1)  # [B, L, ·]

        r, y, o = at_last(captured.residual), at_last(captured.ff_output), at_last(captured.layer_output)
        m = at_last(captured.coefficients).float()  # [B, L, d_ff]
        finals = readout_input(loaded, o[:, -1], "norm")  # [B, d]
        logits, read_ry, read_o = read_layers(
            loaded, finals, r.flatten(0, 1), y.flatten(0, 1), o.flatten(0, 1), readout
        )
        target = top_index(logits)  # [B]: the model's predictions
        top_ry = top_index(read_ry.flatten(0, 1)).view(b, len(layers), 2)  # [B, L, 2]
        top_r, top_y = top_ry[..., 0], top_ry[..., 1]  # [B, L]
        top_o = top_index(read_o).view(b, len(layers))  # [B, L]
        read_r = read_ry[:, 0].view(b, len(layers), -1)  # [B, L, vocab]
        prob = (
            read_r.gather(2, target[:, None, None].expand(-1, len(layers), 1))[..., 0] - read_r.logsumexp(-1)
        ).exp()

        magnitude = m.abs()  # [B, L, d_ff]
        non_negligible = magnitude >= ACTIVE_RATIO * magnitude.amax(dim=-1, keepdim=True)  # [B, L, d_ff]
        active = non_negligible if bool((m < 0).any()) else non_negligible & (m > 0)
        tokens = torch.where(m >= 0, value_top[None, :, 0], value_top[None, :, 1])  # [B, L, d_ff]
        agree = ((tokens == top_y[..., None]) & active).any(dim=-1)  # [B, L]
        stop = torch.isin(top_y, stops) & agree  # [B, L]

        everything = (top_r == top_y) & (top_y == top_o)
        residual = (top_o == top_r) & ~everything
        ffn = (top_o == top_y) & ~everything & ~residual
        case = {
            "agreement": everything,
            "residual": residual,
            "ffn": ffn,
            "composition": ~(everything | residual | ffn),
        }
    return {
        "positive": (m > 0).sum(dim=-1).sum(dim=0),
        "active": non_negligible.sum(dim=-1).sum(dim=0),
        "unmatched": (~agree).sum(dim=0),
        "agree": agree.sum(dim=0),
        "stop": stop.sum(dim=0),
        "settled": (top_r == target[:, None]).sum(dim=0),
        "prob": prob.sum(dim=0),
        **{name: mask_.sum(dim=0) for name, mask_ in case.items()},
    }


def token_removal(
    loaded: LoadedModel,
    items: Sequence[tuple[int, int, Sequence[int]]],
    *,
    first_position: int = 0,
    batch: int = 32,
    progress: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[list[float | None], list[float | None]]:
    """Fig. 3, shallow versus semantic keys: for each (layer, key, trigger prefix) — the prefix ending at
    its trigger token — the relative change of the key's coefficient at the prefix's last token when
    its first token (the first after a BOS: `first_position` 1) is removed, and when its last token is
    removed (then read at the new last token): (m' − m) / |m|. None where the prefix is too short or
    m = 0. → (first-token changes, last-token changes), one per item.

    Two passes a prefix: the whole prefix, read at its last token and at the one before (by causality,
    the prefix without its last token), and the prefix without its first token. A batch holds one
    layer's prefixes and its forward pass stops after that layer. `on_batch(done, total)` after each.
    """
    runs = []  # (layer, item, "whole" | "first", token ids), one layer's runs together
    for index, (layer, _, prefix) in enumerate(items):
        prefix = list(prefix)
        if len(prefix) - first_position >= 2:
            runs.append((layer, index, "whole", prefix))
            runs.append((layer, index, "first", prefix[:first_position] + prefix[first_position + 1 :]))
    runs.sort(key=lambda run: run[0])  # stable
    chunks = []
    for _, group in groupby(runs, key=lambda run: run[0]):
        group = list(group)
        chunks += [group[start : start + batch] for start in range(0, len(group), batch)]
    whole: dict[int, tuple[float, float]] = {}  # item → (m at its last token, m at the one before)
    without_first: dict[int, float] = {}
    for done, chunk in enumerate(tqdm(chunks, desc="token removal", unit="batch", disable=not progress), 1):
        layer = chunk[0][0]
        lengths = [len(ids) for _, _, _, ids in chunk]
        m = _layer_coefficients(loaded, layer, [ids for _, _, _, ids in chunk])  # [B, width, d_ff]
        for row, (_, index, which, _) in enumerate(chunk):
            key, last = items[index][1], lengths[row] - 1
            if which == "whole":
                whole[index] = (float(m[row, last, key]), float(m[row, last - 1, key]))
            else:
                without_first[index] = float(m[row, last, key])
        if on_batch is not None:
            on_batch(done, len(chunks))

    def change(index: int, other: float | None) -> float | None:
        full = whole[index][0] if index in whole else 0.0
        return None if other is None or full == 0 else (other - full) / abs(full)

    return (
        [change(i, without_first.get(i)) for i in range(len(items))],
        [change(i, whole[i][1] if i in whole else None) for i in range(len(items))],
    )


class _LayerDone(Exception):
    """The layer a forward pass was run for has run: the rest of the model is not needed."""


def _layer_coefficients(loaded: LoadedModel, layer: int, prefixes: list[list[int]]) -> torch.Tensor:
    """Coefficients of one layer for right-padded prefixes, the forward pass stopped after the layer:
    [B, width, d_ff]."""
    lengths = torch.tensor([len(ids) for ids in prefixes], device=loaded.device)  # [B]
    ids = torch.zeros(len(prefixes), int(lengths.max()), dtype=torch.long, device=loaded.device)  # [B, width]
    for row, tokens in enumerate(prefixes):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    mask = (torch.arange(ids.shape[1], device=loaded.device)[None, :] < lengths[:, None]).long()

    def stop(module, args, output):
        raise _LayerDone

    block = loaded.adapter.blocks(loaded.model)[layer]
    with loaded.lock:  # hooks on a model live traces share: one pass at a time
        handle = loaded.adapter.value_projection(block).register_forward_hook(stop)
        try:
            with (
                torch.inference_mode(),
                capture(loaded.model, loaded.adapter, [layer], ("coefficients",)) as captured,
            ):
                nothing = torch.empty(0, dtype=torch.long, device=loaded.device)
                try:
                    loaded.model(ids, attention_mask=mask, logits_to_keep=nothing, use_cache=False)
                except _LayerDone:
                    pass
        finally:
            handle.remove()
    return captured.coefficients[layer]
