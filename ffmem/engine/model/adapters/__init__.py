"""Adapter registry, keyed by Hugging Face class name (config.architectures / type(model).__name__).

A family file may also define `unsupported(config) -> str | None` for configs of a supported class
whose memories the adapter cannot read (e.g. post-LN OPT); adapter_for refuses those.
"""

from __future__ import annotations

from torch import nn

from ffmem.engine.errors import FfmemError
from ffmem.engine.model.adapters import gpt2, gpt_neo, gpt_neox, gptj, llama, opt
from ffmem.engine.model.adapters.base import Adapter

FAMILIES = (gpt2, gpt_neo, gptj, gpt_neox, llama, opt)

ADAPTERS: dict[str, Adapter] = {
    name: family.ADAPTER for family in FAMILIES for name in family.ADAPTER.architectures
}

_UNSUPPORTED = {
    name: family.unsupported
    for family in FAMILIES
    if hasattr(family, "unsupported")
    for name in family.ADAPTER.architectures
}


class UnsupportedArchitecture(FfmemError, ValueError):
    pass


def adapter_for(model: nn.Module) -> Adapter:
    name = type(model).__name__
    try:
        adapter = ADAPTERS[name]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UnsupportedArchitecture(
            f"ffmem has no adapter for {name}. Supported architectures: {supported}. "
            "Add one file under ffmem/engine/model/adapters/ to support another family."
        ) from None
    if name in _UNSUPPORTED and (reason := _UNSUPPORTED[name](model.config)):
        raise UnsupportedArchitecture(f"ffmem cannot read this {name}: {reason}.")
    return adapter


__all__ = ["ADAPTERS", "Adapter", "UnsupportedArchitecture", "adapter_for"]
