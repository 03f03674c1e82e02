"""`ffmem index` and `ffmem db upgrade` from the command line: summary, clean errors, exit codes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ffmem.cli import cli
from ffmem.config import get_settings
from ffmem.store import runs
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import Job, Run


@pytest.fixture(autouse=True)
def settings_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("FFMEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FFMEM_VALUE_TOKENS", "3")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_index_command_stores_a_run_and_prints_a_summary(tmp_path, tiny_model_dir):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"text": "The capital of France is Paris. Water boils at one hundred degrees."}\n{bad\n'
    )
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = CliRunner().invoke(
        cli,
        [
            "index",
            "--model",
            str(tiny_model_dir),
            "--corpus",
            str(corpus),
            "--sentences",
            "10",
            "--top-k",
            "2",
            "--db",
            url,
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "stored run 1:" in result.output and "over 2 sentences of corpus.jsonl" in result.output
    assert "3 layers × 48 keys" in result.output
    with make_sessionmaker(make_engine(url))() as session:
        run = session.get(Run, 1)
        assert (run.status, run.top_k, run.n_value_tokens, run.corpus.skipped) == (
            "done",
            2,
            3,
            {"invalid_json": 1},
        )
        assert runs.count_entries(session=session, run_id=1, kind="triggers") == 3 * 48 * 2 * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--corpus", "/nonexistent/corpus.txt"], "error: no corpus file at /nonexistent/corpus.txt"),
        (["--model", "/nonexistent/model.gguf"], "error: no GGUF file at /nonexistent/model.gguf"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, tiny_model_dir, args, message):
    base = [
        "index",
        "--model",
        str(tiny_model_dir),
        "--db",
        f"sqlite:///{tmp_path / 'x.db'}",
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(cli, base + args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("flag", "setting", "wanted"),
    [
        ([], "", False),
        (["--first-position"], "", True),
        ([], "true", True),
        (["--no-first-position"], "true", False),
    ],
)
def test_first_position_flag_and_setting_reach_the_job(tmp_path, monkeypatch, flag, setting, wanted):
    if setting:
        monkeypatch.setenv("FFMEM_FIRST_POSITION", setting)
        get_settings.cache_clear()
    url = f"sqlite:///{tmp_path / 'q.db'}"
    result = CliRunner().invoke(cli, ["index", "--queue", "--db", url, *flag])
    assert result.exit_code == 0 and "job 1: queued" in result.output, result.output
    with make_sessionmaker(make_engine(url))() as session:
        assert session.get(Job, 1).options["first_position"] is wanted


def test_out_of_range_top_k_is_refused(tmp_path):
    result = CliRunner().invoke(cli, ["index", "--top-k", "0", "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    assert result.exit_code == 2 and "--top-k" in result.output


def test_db_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'new' / 'ffmem.db'}"
    result = CliRunner().invoke(cli, ["db", "upgrade", "--db", url])
    assert result.exit_code == 0 and "is up to date" in result.output
    assert (tmp_path / "new" / "ffmem.db").exists()


def test_unreachable_postgres_is_a_clear_error():
    result = CliRunner().invoke(
        cli, ["db", "upgrade", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.startswith("error: ")


def test_trace_command_prints_the_breakdown(tiny, tiny_model_dir):
    from ffmem.engine.live.interventions import Intervention
    from ffmem.engine.live.trace import trace

    result = CliRunner().invoke(
        cli,
        [
            "trace",
            "The capital of France is",
            "--model",
            str(tiny_model_dir),
            "--device",
            "cpu",
            "--intervene",
            "L2K3",
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    ids = tiny.tokenizer("The capital of France is").input_ids
    expected = trace(tiny, ids, memories=3, interventions=[Intervention(2, 3, "off")])  # what it printed
    decoded = tiny.tokenizer.decode([expected.prediction]).replace(" ", "␣")
    unedited = tiny.tokenizer.decode([expected.unedited.prediction]).replace(" ", "␣")
    assert f"prediction after position {len(expected.token_ids) - 1}" in result.output
    assert decoded in result.output and f"with the edits (without them: {unedited})" in result.output
    for layer in expected.layers:
        assert f"K{layer.memories[0].key} {layer.memories[0].coefficient:+.2f}" in result.output
        assert layer.case in result.output
    assert "p edited" in result.output  # the edit's table


def test_trace_command_attributes_a_typed_target(tiny, tiny_model_dir):
    """--target: per layer the memories' sum beside the FF's change, and the memories that push most."""
    from ffmem.engine.live.trace import trace

    arguments = ["trace", "The capital of France is", "--model", str(tiny_model_dir), "--device", "cpu"]
    result = CliRunner().invoke(
        cli, [*arguments, "--target", "#7", "--readout", "raw"], env={"COLUMNS": "240"}
    )
    assert result.exit_code == 0, result.output
    ids = tiny.tokenizer("The capital of France is").input_ids
    expected = trace(tiny, ids, memories=3, readout="raw", target=7).attribution
    assert expected.target == 7 and "(raw readout, logit" in result.output
    for layer in expected.layers:
        cells = (layer.layer, f"{layer.memories_sum:+.3f}", f"{layer.change:+.3f}", f"{layer.residual:+.3f}")
        row = r"│\s*" + r"\s*│\s*".join(re.escape(str(cell)) for cell in cells) + r"\s*│"
        assert re.search(row, result.output), row
        assert f"K{layer.memories[0].key} {layer.memories[0].contribution:+.3f}" in result.output
    top = expected.promoters[0]
    assert f"promoters: L{top.layer}K{top.key} {top.contribution:+.3f}" in result.output


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["Paris", "--target", "#999999"], "error: no token #999999: token ids run 0–"),
        (["Paris", "--target", ""], "error: the target is empty"),
        (["   "], "error: the prompt is empty"),
        (["Paris", "--position", "99"], "error: position 99 is past the prompt's"),
        (["Paris", "--intervene", "L9K1"], "error: L9K1: layer 9 does not exist; layers are 0–2"),
    ],
)
def test_trace_command_errors_are_one_line(tiny_model_dir, arguments, message):
    result = CliRunner().invoke(cli, ["trace", *arguments, "--model", str(tiny_model_dir), "--device", "cpu"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_worker_answers_live_traces_over_http(tmp_path, tiny_model_dir):
    """`ffmem worker` loads the model it is told to and answers /trace beside its (empty) job queue."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-c",
        "from ffmem.cli import main; main()",
        "worker",
        "--db",
        f"sqlite:///{tmp_path / 'w.db'}",
    ]
    command += ["--device", "cpu", "--port", str(port), "--preload", str(tiny_model_dir)]
    worker = subprocess.Popen(
        command, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert worker.poll() is None, worker.stdout.read()
            assert time.monotonic() < deadline, "the live worker did not get ready"
            try:
                if httpx.get(f"{base}/health", timeout=2).json()["status"] == "ready":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        answer = httpx.post(
            f"{base}/trace", json={"model": str(tiny_model_dir), "text": "Paris", "memories": 2}
        )
        assert answer.status_code == 200 and len(answer.json()["layers"]) == 3
        refused = httpx.post(
            f"{base}/trace", json={"model": str(tiny_model_dir), "text": "Paris", "memories": 0}
        )
        assert refused.status_code == 400
        assert refused.json() == {
            "ok": False,
            "error": "memories: Input should be greater than or equal to 1",
            "status": 400,
        }
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) is not None


def test_a_sigterm_landing_in_a_weakref_callback_still_stops_the_process():
    """Python ignores an exception raised inside a weakref callback: `ffmem serve`'s and `ffmem worker`'s
    SIGTERM handler raises SystemExit, so a SIGTERM landing there would leave the process running (a demo's
    worker once ran on for minutes after its explorer stopped). It is raised again outside the callback."""
    script = """
import signal, time, weakref
from ffmem.cli.serve import _stop_on_sigterm
_stop_on_sigterm()
class Thing:
    pass
def callback(ref):
    signal.raise_signal(signal.SIGTERM)  # its handler runs at the callback's next bytecode
    for _ in range(3):
        pass
thing = Thing()
ref = weakref.ref(thing, callback)
try:
    del thing
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pass
    print("ran on")
except SystemExit as stopped:
    print("stopped", stopped.code)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "stopped 143", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
