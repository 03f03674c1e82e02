"""Settings: every field is documented, and environment variables override the defaults."""

from __future__ import annotations

from ffmem.config import Settings


def test_every_setting_is_documented():
    fields = Settings.model_fields.items()
    undocumented = [name for name, field in fields if not (field.description or "").strip()]
    assert undocumented == []


def test_database_url_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("FFMEM_DATABASE_URL", raising=False)
    assert Settings(_env_file=None).database_url == "sqlite:///data/ffmem.db"
    monkeypatch.setenv("FFMEM_DATABASE_URL", "postgresql+psycopg://ffmem@db:5432/ffmem")
    assert Settings(_env_file=None).database_url == "postgresql+psycopg://ffmem@db:5432/ffmem"


def test_the_upload_folder_is_the_one_named_or_corpora_in_the_data_folder(monkeypatch, tmp_path):
    """Issue 39: `upload_dir` when set; else `corpora` beside the SQLite database's file (read from the
    current URL, so a copy with another one follows it); for a server database, data/corpora."""
    from pathlib import Path

    monkeypatch.delenv("FFMEM_UPLOAD_DIR", raising=False)
    monkeypatch.delenv("FFMEM_DATABASE_URL", raising=False)
    default = Settings(_env_file=None)
    assert default.upload_dir is None and default.upload_folder == Path("data/corpora")
    moved = default.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'db' / 'ffmem.db'}"})
    assert moved.upload_folder == tmp_path / "db" / "corpora"
    server = Settings(_env_file=None, database_url="postgresql+psycopg://ffmem@db:5432/ffmem")
    assert server.upload_folder == Path("data/corpora")
    named = Settings(_env_file=None, database_url="sqlite:////srv/ffmem.db", upload_dir=tmp_path / "up")
    assert named.upload_folder == tmp_path / "up"
