"""`ffmem demo` (what `make demo` runs): the explorer answers at once while its worker builds the
index, whose progress the job page shows, and then answers live traces; here with the tiny model
instead of SmolLM2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from explorer_index import EXPLORER_SENTENCES


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_demo_serves_at_once_and_builds_in_the_background(tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(EXPLORER_SENTENCES * 4) + "\n")
    port, worker_port = _free_port(), _free_port()
    env = dict(
        os.environ,
        FFMEM_DATABASE_URL=f"sqlite:///{tmp_path / 'demo.db'}",
        FFMEM_MODEL=str(tiny_model_dir),
        FFMEM_CORPUS=str(corpus),
        FFMEM_CACHE_DIR=str(tmp_path / "cache"),
        FFMEM_DEVICE="cpu",
        FFMEM_TOP_K="4",
        FFMEM_SENTENCES=str(3 * len(EXPLORER_SENTENCES)),  # the rest is held out for the analyses
        FFMEM_SHARD_SENTENCES="8",
        FFMEM_WORKER_URL=f"http://127.0.0.1:{worker_port}",
    )
    command = [sys.executable, "-c", "from ffmem.cli import main; main()", "demo", "--port", str(port)]
    demo = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert demo.poll() is None, demo.stdout.read()
            assert time.monotonic() < deadline, "the explorer did not come up"
            try:
                home = httpx.get(f"{base}/.json", timeout=2).json()
                break
            except httpx.TransportError:
                time.sleep(0.2)
        # The index run, and its analyses waiting for it.
        assert [(job["id"], job["kind"]) for job in home["jobs"]] == [(2, "analysis"), (1, "index")]
        deadline = time.monotonic() + 120
        while (job := httpx.get(f"{base}/jobs/1.json").json())["job"]["status"] != "done":
            assert job["job"]["status"] in ("queued", "running"), job
            assert time.monotonic() < deadline, "the background worker did not finish"
            time.sleep(0.3)
        assert job["progress"]["fraction"] == 1.0 and job["polling"] is False
        slug = job["model"]
        key = httpx.get(f"{base}/m/{slug}/layers/1/keys/2.json").json()
        assert len(key["triggers"]) == 4 and key["run"]["id"] == job["run"]["id"]
        # The same worker answers live traces (it preloaded the model it was told to index).
        traced = httpx.get(
            f"{base}/m/{slug}/trace.json", params={"text": "The capital of France is"}, timeout=30
        )
        assert traced.status_code == 200, traced.text
        assert len(traced.json()["layers"]) == 3 and traced.json()["run"] == job["run"]["id"]
        # Then the same worker computes the analyses (the demo's size), and the page shows them.
        deadline = time.monotonic() + 120
        while (analysis := httpx.get(f"{base}/jobs/2.json").json())["job"]["status"] != "done":
            assert analysis["job"]["status"] in ("queued", "running"), analysis
            assert time.monotonic() < deadline, "the analyses did not finish"
            time.sleep(0.3)
        assert analysis["job"]["run_id"] == job["run"]["id"]
        assert analysis["job"]["options"] == {
            "examples": 500,
            "keys": 10,
            "triggers": 10,
            "seed": 0,
        }
        page = httpx.get(f"{base}/m/{slug}/analysis.json").json()
        assert page["missing"] == [] and page["computed"]["census"]["options"]["examples"] == 500
    finally:
        demo.terminate()  # SIGTERM, as a service manager stops it
        demo.wait(timeout=30)
    database = str(tmp_path / "demo.db")
    deadline = time.monotonic() + 15
    while (
        subprocess.run(["pgrep", "-f", f"worker --db sqlite:///{database}"], capture_output=True).returncode
        == 0
    ):
        assert time.monotonic() < deadline, "the background worker outlived the demo"
        time.sleep(0.2)
