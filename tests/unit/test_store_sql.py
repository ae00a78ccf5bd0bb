"""The store on SQLite files (the behaviours in tests/store_cases.py), and what only
SQLite has: URL forms, WAL, the defaults in the cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.protocol.errors import ConfigError
from omnistage.store.engine import engine_url
from omnistage.store.open import default_media_url, default_store_url, open_store
from omnistage.store.sql import SqlStore
from tests.store_cases import StoreCases, job


class TestSqliteStore(StoreCases):
    @pytest.fixture
    def store_url(self, tmp_path: Path) -> str:
        return f"sqlite:///{tmp_path}/store.db"


def test_urls_name_sqlite_files_or_postgresql_over_psycopg(tmp_path: Path) -> None:
    assert engine_url(f"sqlite:///{tmp_path}/a.db").database == f"{tmp_path}/a.db"
    assert engine_url(str(tmp_path / "b.db")).database == str(tmp_path / "b.db")
    assert engine_url("rel.db").database == str(Path("rel.db").absolute())
    for scheme in ("postgres", "postgresql"):
        url = engine_url(f"{scheme}://u@db.example:5433/omni")
        assert url.drivername == "postgresql+psycopg"
        assert (url.host, url.port, url.database) == ("db.example", 5433, "omni")
    assert engine_url("postgresql+psycopg2://h/db").drivername == "postgresql+psycopg2"
    with pytest.raises(ConfigError, match="--store-url"):
        engine_url("mysql://h/db")


async def test_a_bare_path_is_a_sqlite_file_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "store.db"
    store = SqlStore(str(path))
    await store.start()
    try:
        await store.create_job(job("j1", 1.0))
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        await store.close()
    assert path.is_file()


async def test_an_in_memory_store_works_across_calls() -> None:
    store = SqlStore("sqlite://")
    await store.start()
    try:
        await store.create_job(job("j1", 1.0))
        assert (await store.get_job("j1", "alice")).id == "j1"
    finally:
        await store.close()


async def test_the_default_store_and_media_live_in_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path / "cache"))
    # Without OMNISTAGE_STORE_URL / _MEDIA_URL (the suite sets them: tests/conftest.py).
    monkeypatch.delenv("OMNISTAGE_STORE_URL", raising=False)
    monkeypatch.delenv("OMNISTAGE_MEDIA_URL", raising=False)
    assert default_store_url() == f"sqlite:///{tmp_path}/cache/store.db"
    assert default_media_url() == f"{tmp_path}/cache/media"
    store = open_store()
    await store.start()
    await store.close()
    assert (tmp_path / "cache" / "store.db").is_file()
    # The environment's URL is the default of a head built in-process too, as of the CLI.
    monkeypatch.setenv("OMNISTAGE_STORE_URL", f"sqlite:///{tmp_path}/env.db")
    store = open_store()
    await store.start()
    await store.close()
    assert (tmp_path / "env.db").is_file()
