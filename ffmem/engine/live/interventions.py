"""Interventions on memories as people type them (URL, form, command line). Importing it needs no torch.

One intervention per comma-separated item, layers and keys 0-based:
- `L12K345`      switches memory 345 of layer 12 off: m = 0 at every position;
- `L12K345*0.5`  scales its coefficient (`*-1` flips the value's effect);
- `L12K345=3.2`  forces it on: m = 3.2 at every position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffmem.engine.errors import FfmemError
from ffmem.engine.live.protocol import MAX_INTERVENTIONS, MAX_MAGNITUDE

SYNTAX = "L12K345 (off), L12K345*0.5 (scale) or L12K345=3.2 (force on), comma separated"
_ITEM = re.compile(
    r"L(\d{1,9})\s*K(\d{1,9})(?:\s*([*=])\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d{1,3})?))?", re.I
)


class InterventionError(FfmemError, ValueError):
    """An intervention that cannot be read or names a memory the model does not have."""


@dataclass(frozen=True)
class Intervention:
    layer: int
    key: int
    mode: str  # off | scale | set
    value: float = 0.0  # the factor (scale) or the coefficient (set)

    def apply(self, coefficient):
        """The edited coefficient (a float or a tensor of them)."""
        if self.mode == "off":
            return coefficient * 0
        if self.mode == "scale":
            return coefficient * self.value
        return coefficient * 0 + self.value

    def __str__(self) -> str:
        suffix = {"off": "", "scale": f"*{self.value:g}", "set": f"={self.value:g}"}[self.mode]
        return f"L{self.layer}K{self.key}{suffix}"


def parse_interventions(text: str | None, n_layers: int, n_keys: int) -> list[Intervention]:
    """`"L3K7, L4K9*2"` → interventions; an error names the bad item and what is allowed."""
    items = [item.strip() for item in (text or "").split(",") if item.strip()]
    if len(items) > MAX_INTERVENTIONS:
        raise InterventionError(f"at most {MAX_INTERVENTIONS} interventions at once, got {len(items)}")
    found: dict[tuple[int, int], Intervention] = {}
    for item in items:
        match = _ITEM.fullmatch(item)
        if match is None:
            raise InterventionError(f"cannot read intervention {item[:40]!r}: write {SYNTAX}")
        layer, key = int(match[1]), int(match[2])
        if layer >= n_layers:
            raise InterventionError(f"{item}: layer {layer} does not exist; layers are 0–{n_layers - 1}")
        if key >= n_keys:
            raise InterventionError(f"{item}: key {key} does not exist; keys are 0–{n_keys - 1}")
        mode = {None: "off", "*": "scale", "=": "set"}[match[3]]
        value = float(match[4]) if match[4] else 0.0
        if abs(value) > MAX_MAGNITUDE:
            raise InterventionError(f"{item}: the value must lie within ±{MAX_MAGNITUDE:g}")
        if (layer, key) in found:
            raise InterventionError(f"memory L{layer}K{key} is named twice; keep one intervention per memory")
        found[layer, key] = Intervention(layer, key, mode, value)
    return list(found.values())


def format_interventions(interventions: list[Intervention]) -> str:
    """The text `parse_interventions` reads back: the form the URL keeps."""
    return ",".join(str(intervention) for intervention in interventions)
