"""Keep freed memory in the process for reuse: a live trace allocates ~25 MB of logits, and glibc's
malloc would map them fresh from the OS and unmap them after each request (large blocks), so every
trace paid ~11K page faults (~18 ms on a 2-core CPU, a sixth of the trace). Long-running workers
call `keep_freed_memory()` once at start; it changes nothing where the C library is not glibc.

`large_empty`: a CPU tensor in huge pages, for arrays a pass reads in pieces all over (the value
projection's chunk buffers, read a block of tokens at a time down 512 rows): with 4 KiB pages each piece
misses the TLB, which costs most in a virtual machine (the token → memories pass took 2× as long).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap instead of giving it back


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MB from the heap and keep freed heap memory; True if glibc took it."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def large_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in numpy's memory, which asks the kernel for huge pages where it hands
    them out on request (transparent_hugepage = madvise; torch's memory does not ask)."""
    width = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(shape, dtype=f"u{width}")).view(dtype)
