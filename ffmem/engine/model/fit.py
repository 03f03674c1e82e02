"""Will it fit: a model whose weights do not fit the device's free memory is refused, with the numbers,
before any weight is read."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ffmem.engine.model.loaded import ModelLoadError


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device`: a GPU's free memory (`torch.cuda.mem_get_info`), on a CPU
    the RAM the kernel says is available (/proc/meminfo MemAvailable); None where that is unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the kernel counts in KiB
        except (OSError, ValueError, IndexError):
            return None
    return None


def parameter_count(target: str) -> int | None:
    """The model's parameters (tied ones once), from its config alone: the model is built on the meta
    device and no weight is read (~0.7 s at Llama-3.1-8B's shape). None when the config cannot be read
    or built; the load that follows says why."""
    try:
        config = AutoConfig.from_pretrained(target)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    return sum(parameter.numel() for parameter in model.parameters())


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_fits(
    source: str, parameters: int | None, device: torch.device, dtype: torch.dtype, read_dtype: torch.dtype
) -> None:
    """Refuse, before reading any weight, a model whose weights do not fit: they take parameters × the
    dtype's bytes on `device` (activations come on top), and are first read on the host in `read_dtype`
    (a GGUF's float32 cache, cast there). Unknown counts or free memory pass."""
    if parameters is None:
        return
    if device.type != "cpu":
        free = free_memory(device)
        needed = parameters * dtype.itemsize
        if free is not None and needed > free:
            raise ModelLoadError(
                f"{source} needs ~{_size(needed)} in {_dtype_name(dtype)}; the GPU ({device}) has "
                f"{_size(free)} free. {_remedy(halving=dtype.itemsize > 2)}"
            )
    read = read_dtype  # `dtype` but for a GGUF's float32 cache
    free = free_memory(torch.device("cpu"))
    needed = parameters * read.itemsize
    if free is not None and needed > free:
        steps = [f"read in {_dtype_name(read)}, then cast to {_dtype_name(dtype)}"] if read != dtype else []
        steps += [f"before the move to {device}"] if device.type != "cpu" else []
        when = f" while it loads ({', '.join(steps)})" if steps else ""
        raise ModelLoadError(
            f"{source} needs ~{_size(needed)} in {_dtype_name(read)}{when}; this machine has "
            f"{_size(free)} of RAM free. {_remedy(halving=read == dtype and dtype.itemsize > 2)}"
        )


def _remedy(*, halving: bool) -> str:
    if halving:
        return "Use a smaller model, --dtype bfloat16 or float16 (half the memory), or a larger device."
    return "Use a smaller model or a larger device."
