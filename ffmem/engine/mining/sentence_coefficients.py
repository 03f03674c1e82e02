"""A key's coefficient at every token of a sentence, for many (key, sentence) pairs in one pass: what the
key page shades its top triggers and band samples with.

Mining keeps, per key, only each sentence's extreme and where it is; the pages want the whole sentence
shaded. After mining, one forward pass over the union of the wanted sentences (length-bucketed like
mining) reads, for each wanted pair of each layer, the key's coefficient at every position: float32,
NaN where the run does not mine (a BOS; the first position when it is left out), so that the shading
shows exactly the numbers the triggers were ranked by.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ffmem.engine.mining.corpus import length_bucketed_batches
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loaded import LoadedModel


def sentence_coefficients(
    loaded: LoadedModel,
    token_ids: list[list[int]],
    first_positions: list[int],
    wanted: dict[int, np.ndarray],
    *,
    batch_tokens: int,
    pad_id: int,
    report: Callable[[int, int], None] | None = None,
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For each layer's wanted pairs ([n, 2]: key, sentence), the key's coefficient at every token of the
    sentence, NaN before the sentence's first mined position: (values [tokens] float32, offsets [n + 1]
    int64), pair i's coefficients being values[offsets[i]:offsets[i + 1]]. One flat array a layer, not an
    array a pair: at 131,072 memories a run shades millions of sentences.

    `token_ids` and `first_positions` are the whole corpus's (indexed by sentence); `report(done, total)`
    is called after each batch with sentences done.
    """
    lengths = np.array([len(ids) for ids in token_ids] or [0], dtype=np.int64)  # [sentences]
    found = {}
    for layer, pairs in wanted.items():
        offsets = np.concatenate([[0], np.cumsum(lengths[pairs[:, 1]])]).astype(np.int64)  # [n + 1]
        found[layer] = (np.full(offsets[-1], np.nan, np.float32), offsets)  # [tokens], [n + 1]
    union = np.unique(np.concatenate([pairs[:, 1] for pairs in wanted.values()] or [np.zeros(0, np.int64)]))
    if not len(union):
        return found
    by_sentence = {layer: np.argsort(pairs[:, 1], kind="stable") for layer, pairs in wanted.items()}
    batches = length_bucketed_batches(
        [token_ids[s] for s in union],
        [first_positions[s] for s in union],
        indices=union,
        batch_tokens=batch_tokens,
        pad_id=pad_id,
    )
    current: dict[str, object] = {}

    def read(layer: int, coefficients: torch.Tensor) -> None:  # coefficients: [batch, pos, keys]
        if layer not in wanted:
            return
        pairs, order = wanted[layer], by_sentence[layer]
        sentences = current["sentences"]  # [batch] corpus indices, sorted
        ordered = pairs[order, 1]  # [n] sorted
        lo, hi = np.searchsorted(ordered, sentences[0]), np.searchsorted(ordered, sentences[-1], "right")
        chosen = order[lo:hi][np.isin(ordered[lo:hi], sentences)]  # [p] pair indices in this batch
        if not len(chosen):
            return
        rows = current["rows"][np.searchsorted(sentences, pairs[chosen, 1])]  # [p] batch rows
        keys = torch.from_numpy(pairs[chosen, 0]).to(coefficients.device)  # [p]
        rows_t = torch.from_numpy(rows).to(coefficients.device)  # [p]
        gathered = coefficients[rows_t, :, keys].float()  # [p, pos]
        gathered = gathered.masked_fill(~current["mined"][rows_t], float("nan")).cpu().numpy()
        values, offsets = found[layer]
        spans = offsets[chosen + 1] - offsets[chosen]  # [p] each pair's sentence length
        inside = np.arange(gathered.shape[1]) < spans[:, None]  # [p, pos]
        starts = np.repeat(offsets[chosen] - np.cumsum(spans) + spans, spans)  # [Σ spans]
        values[starts + np.arange(spans.sum())] = gathered[inside]  # row by row, in order

    done = 0
    for batch in batches:
        batch = batch.to(loaded.device)
        corpus_index = batch.sentence_index.cpu().numpy()  # [batch]
        order = np.argsort(corpus_index)
        current.update(
            sentences=corpus_index[order],
            rows=order,  # batch row of each sorted sentence
            mined=batch.mined,
        )
        # Hooks on the shared model for one batch at a time, under its lock: live traces go in between.
        with (
            loaded.lock,
            torch.inference_mode(),
            capture(loaded.model, loaded.adapter, fields=("coefficients",), on_coefficients=read),
        ):
            loaded.model.base_model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
            )
        done += len(corpus_index)
        if report is not None:
            report(done, len(union))
    return found
