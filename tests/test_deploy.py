"""docker-compose.yml and the Dockerfile: the file parses, has what a team server needs, and every
command it runs exists in this project (there is no Docker engine here to run it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from ffmem.cli import cli
from ffmem.config import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def run_ffmem(argv: list[str]) -> None:
    """Resolve `ffmem …` against the real CLI: the subcommand and every option must exist."""
    assert argv[0] == "ffmem", argv
    command = typer.main.get_command(cli)
    sub = command.get_command(command.make_context("ffmem", [argv[1]], resilient_parsing=True), argv[1])
    assert sub is not None, f"no command ffmem {argv[1]}"
    sub.make_context(argv[1], list(argv[2:]))  # raises on an unknown option or a bad value


def test_compose_has_postgres_app_and_gpu_workers():
    services = COMPOSE["services"]
    assert set(services) == {"postgres", "app", "worker"}
    postgres = services["postgres"]
    assert (
        postgres["healthcheck"]["test"][0] == "CMD-SHELL"
        and "pg_isready" in postgres["healthcheck"]["test"][1]
    )
    assert any(volume.endswith(":/var/lib/postgresql/data") for volume in postgres["volumes"])
    for name in ("app", "worker"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert services[name]["environment"]["FFMEM_DATABASE_URL"].startswith(
            "postgresql+psycopg://ffmem:ffmem@postgres:5432/"
        )
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "ports" not in services["worker"], "workers scale with --scale worker=N: no fixed ports"
    assert any(volume.endswith(":/cache") for volume in services["worker"]["volumes"])
    assert set(COMPOSE["volumes"]) == {"pgdata", "models"}


def test_every_command_it_runs_exists():
    for service in ("app", "worker"):
        run_ffmem(COMPOSE["services"][service]["command"])
    cmd = re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    run_ffmem(yaml.safe_load(cmd))


def test_settings_it_sets_exist():
    fields = set(Settings.model_fields)
    for service in ("app", "worker"):
        for variable in COMPOSE["services"][service]["environment"]:
            assert variable.removeprefix("FFMEM_").lower() in fields, variable


def test_the_dockerfile_copies_what_the_app_needs():
    text = (ROOT / "Dockerfile").read_text()
    copied = {
        source for line in text.splitlines() if line.startswith("COPY ") for source in shlex.split(line)[1:-1]
    }
    for needed in ("ffmem", "migrations", "alembic.ini", "pyproject.toml"):
        assert needed in copied, needed
    assert (ROOT / "alembic.ini").exists()
    assert all((ROOT / "ffmem" / "web" / name).is_dir() for name in ("templates", "static"))


def test_a_bad_command_or_option_would_be_caught():
    with pytest.raises(Exception, match="No such option: --no-such-option"):
        run_ffmem(["ffmem", "serve", "--no-such-option"])
    with pytest.raises(AssertionError, match="no command ffmem launch"):
        run_ffmem(["ffmem", "launch"])
