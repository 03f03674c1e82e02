"""bench-results.json: each benchmark script records its own section, keeping the others."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "bench-results.json"


def record(section: str, results: dict) -> None:
    """Write `results` under `section` in bench-results.json and say so."""
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    existing[section] = results
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {RESULTS} ({section})")
