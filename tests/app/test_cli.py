"""`ffmem index` and `ffmem db upgrade` from the command line: summary, clean errors, exit codes."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.db import make_engine, make_sessionmaker
from app.models import Run, Trigger


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
        assert session.scalar(select(func.count()).select_from(Trigger)) == 3 * 48 * 2 * 2


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
