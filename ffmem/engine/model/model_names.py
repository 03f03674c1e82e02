"""A model's slug (its name in URLs and the database) from the source it is loaded from; torch-free, so
the web can name the model a queued job is preparing before the model is stored."""

from __future__ import annotations

import os
import re
from pathlib import Path


def slugify(source: str) -> str:
    """`EleutherAI/pythia-70m` → `eleutherai-pythia-70m`; a .gguf file or a local folder by its name."""
    name = Path(source).stem if source.endswith(".gguf") else source.rstrip("/")
    if os.path.isdir(source):
        name = Path(source).resolve().name
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"
