"""What the live worker answers, as one contract: the worker (ffmem/worker/live_server.py) answers with
these models and the web process (ffmem/web/trace_view.py) parses the answer into them. Importing it
needs no torch (the web process imports it).

A trace's figures follow ffmem.engine.trace: `prediction`, `layers`, `active` and `ff_logit` are those
of the forward pass that was computed (with the interventions, if any), `unedited` the same figures of
the pass without them (None without interventions: there was one pass).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ffmem.engine.cases import CASES

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
    top_r: int = Field(description="Top token of the residual before the FF.")
    top_y: int = Field(description="Top token of the FF output.")
    top_o: int = Field(description="Top token of the layer output o = r + y.")
    final_prob: float = Field(description="Probability of the pass's final prediction under r.")
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
    """One intervention as the worker applied it (ffmem.engine.interventions.Intervention)."""

    layer: int
    key: int
    mode: Literal["off", "scale", "set"]
    value: float


class TraceAnswer(BaseModel):
    """POST /trace: one prompt traced (ffmem.engine.trace.Trace, and the continuations as text)."""

    token_ids: list[int]
    position: int
    readout: Literal["norm", "raw"]
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


class AblationAnswer(BaseModel):
    """POST /ablation: each prefix's target probabilities, the memory as it is and switched off."""

    before: list[list[float]] = Field(description="[prefix][target]")
    after: list[list[float]] = Field(description="[prefix][target]")
