"""The paper's §5.2 cases of one layer, from three top tokens. Importing it needs no torch.

- agreement:   top(r) = top(y) = top(o)
- residual:    top(o) = top(r) (the FF did not change the residual's choice)
- ffn:         top(o) = top(y) (the FF's own choice won)
- composition: top(o) is neither (the sum chose a third token)
"""

from __future__ import annotations

CASES = ("agreement", "residual", "ffn", "composition")


def case_of(top_r: int, top_y: int, top_o: int) -> str:
    if top_r == top_y == top_o:
        return "agreement"
    if top_o == top_r:
        return "residual"
    if top_o == top_y:
        return "ffn"
    return "composition"
