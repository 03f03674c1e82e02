"""The GPU check (bench/device/check.sh) as its dry run on the CPU, tiny shapes: every part runs and
writes the figures the GPU run will, so a script that fails is found here and not on a borrowed GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_checks_dry_run_writes_every_parts_figures(tmp_path):
    env = {
        **os.environ,
        "DRY_RUN": "1",
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        ["bash", "bench/device/check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for part in ("gpu", "index", "ratio"):
        assert f"{part}: exit 0 after" in done.stdout, done.stdout[-3000:]
    out = tmp_path / "out"
    parity = json.loads((out / "gpu.json").read_text())["parity"]  # the tiny models: gated and not
    assert [figures["passed"] for figures in parity.values()] == [True, True]
    gated = parity["tiny-llama (SwiGLU)"]
    assert gated["quadrant_examples"] > 0 and gated["quadrant_examples_unexplained"] == 0
    (index,) = json.loads((out / "index.json").read_text())["shapes"]
    assert index["shape"] == "tiny" and index["exit_code"] == 0
    assert index["stored"]["status"] == "done" and index["stored"]["layers_stored"] == 3
    assert {"loading", "mining", "storing"} <= set(index["stages"])
    assert all(stage["seconds"] >= 0 and stage["peak_host_bytes"] > 0 for stage in index["stages"].values())
    assert index["mining_ratio"]["checks"]["positions_ok"] and index["mining_ratio"]["mining_over_bare"] > 0
    trace = index["trace"]  # the live trace of a 32-token prompt
    assert trace["tokens"] == 32 and 0 < trace["trace_p50_ms"] <= trace["trace_p95_ms"]
    (ratio,) = json.loads((out / "ratio.json").read_text())["shapes"]
    assert ratio["shape"] == "tiny" and ratio["build_seconds"] > 0 and "trace" not in ratio
    assert ratio["mining_ratio"]["checks"]["histogram_ok"] and ratio["mining_ratio"]["mining_over_bare"] > 0
