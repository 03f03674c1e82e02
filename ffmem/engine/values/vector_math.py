"""Compiled elementwise math that the value passes share, written so that LLVM vectorizes it (numba
here has no vector math library: its `math.exp` is a scalar call per element, five to ten times slower).

- `as_float32`: an int32's bits read as a float32 (how a bfloat16 widens: its 16 bits are a float32's
  high half, exactly);
- `exp`: e^x for float32 x ≤ 0 (Cody–Waite reduction x = k·ln 2 + r, |r| ≤ ln 2 / 2, and Cephes' expf
  polynomial: within 2 ulp of e^x; measured 1.3), held at e^-87 below −87 (terms of a sum whose largest is 1:
  they cannot count);
- `exp_sum`: Σ_t e^(x_t − m) over a row, in float64 lanes.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # ln 2 split so that k·LN2_HI is exact for the k that occur
LN2_LO = np.float32(-2.12194440e-4)
EXP_FLOOR = np.float32(-87.0)  # e^-87 ≈ 1.6e-38, the smallest power of two a float32 holds normally
EXP_POLYNOMIAL = tuple(  # Cephes expf: e^r ≈ 1 + r + r²·P(r)
    np.float32(c)
    for c in (
        1.9875691500e-4,
        1.3981999507e-3,
        8.3334519073e-3,
        4.1665795894e-2,
        1.6666665459e-1,
        0.50000001201,
    )
)


@intrinsic
def as_float32(typingctx, bits):
    """The float32 whose bits are the int32 `bits`."""
    signature = types.float32(types.int32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return signature, codegen


P0, P1, P2, P3, P4, P5 = EXP_POLYNOMIAL


@numba.njit(nogil=True, inline="always", fastmath={"nnan", "nsz"})
def exp(x):
    """e^x for a float32 x ≤ 0 (module docstring)."""
    x = max(x, EXP_FLOOR)
    k = np.float32(np.int32(x * LOG2E - np.float32(0.5)))  # round to nearest (x ≤ 0: truncation rounds up)
    r = x - k * LN2_HI - k * LN2_LO
    square = r * r
    poly = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
    return (poly * square + r + np.float32(1.0)) * as_float32((np.int32(k) + np.int32(127)) << np.int32(23))


@numba.njit(nogil=True, fastmath={"nnan", "nsz", "reassoc", "contract"})
def exp_sum(row, shift):
    """Σ_t e^(row[t] − shift) for a float32 row whose entries are ≤ shift, summed in float64."""
    total = 0.0
    for t in range(row.shape[0]):
        total += np.float64(exp(row[t] - shift))
    return total
