"""The histogram bins of coefficients, read off a float32's sign and exponent bits (two bins an octave, see
ffmem.engine.mining.mined_layer.histogram_edges), and the scratch tensors the fold reuses."""

from __future__ import annotations

import math

import torch

from ffmem.engine.mining import mined_layer as mined
from ffmem.engine.mining.mined_layer import ZERO_BIN

LOWEST_EXPONENT = 118  # float32 biased exponent of 2^-9
CODES = 512  # a float32's sign and biased exponent bits, as the number (bits >> 23) & 511
# A key's counters in the one bincount of all keys: one more than CODES, so that keys do not lie 4 KiB
# apart (keys next to each other in memory would then share cache sets: twice as slow on a CPU).
CODE_STRIDE = CODES + 1
# The torch fold takes consecutive layers of a batch together, as many as fit this many bytes of float32
# coefficients: one launch of each of its ~150 kernels for them all (a GPU's launches, not its arithmetic,
# bound SmolLM2's mining), in a copy the fold may overwrite.
FOLD_BYTES = 2**30


def code_values() -> torch.Tensor:
    """One float32 per code (sign and exponent, mantissa 0): its bin is every such float's bin."""
    return (torch.arange(CODES, dtype=torch.int32) << 23).view(torch.float32)  # [CODES]


def histogram_bins(coefficients: torch.Tensor, workspace: dict | None = None) -> torch.Tensor:
    """Bin index (see histogram_edges) of each float32 coefficient, same shape, int32.

    `workspace` keeps the scratch tensors between calls: fresh multi-megabyte allocations cost
    more in page faults than the arithmetic itself.
    """
    bits = coefficients.float().contiguous().view(torch.int32)
    code, sign, positive = (
        scratch(workspace, name, bits.shape, dtype, bits.device)
        for name, dtype in (("code", torch.int32), ("sign", torch.int32), ("positive", torch.bool))
    )
    torch.bitwise_right_shift(bits, 23, out=code)  # sign and biased exponent bits
    torch.bitwise_right_shift(code, 8, out=sign)  # −1 where the sign bit is set, else 0
    torch.gt(code, 0, out=positive)  # sign bit clear and a nonzero exponent
    octave = (
        code.bitwise_and_(255).sub_(LOWEST_EXPONENT - 1).clamp_(0, mined.OCTAVES - 1)
    )  # 0 … 20 by magnitude
    # 21 + octave (+1 when positive), or 20 − octave where negative; +0.0 lands on ZERO_BIN.
    return octave.bitwise_xor_(sign).add_(positive).add_(ZERO_BIN)


def scratch(workspace: dict | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A reusable tensor of `shape` (grown as needed) from `workspace`, or a new one without it."""
    numel = math.prod(shape)
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = workspace.get(name)
    if buffer is None or buffer.numel() < numel or buffer.device != device:
        buffer = workspace[name] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)
