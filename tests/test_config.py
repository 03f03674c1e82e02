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
