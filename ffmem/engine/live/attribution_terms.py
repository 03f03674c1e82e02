"""The terms of target attribution ("who pushes this token, here") that the web shares with the worker.
Importing it needs no torch (the web process imports it); the numbers are ffmem.engine.live.attribution's.

- A **target** is typed as text (` London`: tokenized by the model's tokenizer, without special tokens;
  the first token is attributed when the text is several) or as `#<id>` (a token id, e.g. `#5188`).
  At most TARGET_CHARS characters; an empty target, an id past the vocabulary, or a text the tokenizer
  maps to no token or to its unknown token is refused.
- A listed memory is a **veto** case (the paper's §5.2: a memory's own prediction overruled by the
  layer's composition) when the layer's memories together push the target down — the sum of the
  contributions of all its memories S_ℓ = Σ_j c_j < 0 — while this memory pushes it up: its own top
  token (the top of sign(m_i)·v_i under the shown readout) is the target, or its contribution is
  strongly positive: c_i > 0 and c_i ≥ VETO_SHARE · max_j |c_j| over the layer.
"""

from __future__ import annotations

import re

from ffmem.engine.errors import FfmemError
from ffmem.engine.live.protocol import TARGET_CHARS

TARGET_ID = re.compile(r"#(\d{1,9})")  # `#5188`: a token id
VETO_SHARE = 0.25  # strongly positive: at least this share of the layer's largest |contribution|


class TargetError(FfmemError):
    field = "target"


def target_tokens(tokenizer, vocab_size: int, target: str | None) -> list[int]:
    """The tokens a target is (the first is attributed); [] for None, the prediction. An empty or too
    long target, an id past the vocabulary, or a text with no token or an unknown one: TargetError."""
    if target is None:
        return []
    if not target:
        raise TargetError("the target is empty: type a token, e.g. ' London', or leave it out")
    if len(target) > TARGET_CHARS:
        raise TargetError(f"the target is {len(target)} characters; the limit is {TARGET_CHARS}")
    if (token := target_id(target)) is not None:
        if token >= vocab_size:
            raise TargetError(f"no token #{token}: token ids run 0–{vocab_size - 1}")
        return [token]
    ids = tokenizer(target, add_special_tokens=False).input_ids
    unknown = tokenizer.unk_token_id
    if not ids or (unknown is not None and unknown in ids) or max(ids) >= vocab_size:
        raise TargetError(f"the tokenizer has no token for the target {target!r}")
    return ids


def target_id(text: str) -> int | None:
    """The token id a `#<id>` target names, or None for a target typed as text."""
    match = TARGET_ID.fullmatch(text)
    return int(match.group(1)) if match else None


def is_veto(contribution: float, layer_sum: float, layer_largest: float, top_is_target: bool) -> bool:
    """Whether a memory with this contribution c_i is a veto case in a layer whose memories sum to
    `layer_sum` (S_ℓ) and whose largest |c_j| is `layer_largest`; `top_is_target`: its own top token is
    the target (False when unknown)."""
    if layer_sum >= 0:
        return False
    strong = contribution > 0 and contribution >= VETO_SHARE * layer_largest
    return top_is_target or strong
