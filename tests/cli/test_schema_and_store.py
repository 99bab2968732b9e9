"""`db` on a schema newer than this code, the default store, and the lazily imported `serve`.

Issue 34 items 13 (no contradictory advice on a newer compatible schema) and 14 (commands work
without --url, on the Trainer's default store), and issue 33's `serve` registration.
"""

from __future__ import annotations

import asyncio
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path

import click
import pytest
from sqlalchemy import Column, MetaData, String, Table, create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from lightning_sql import SqlLightningStore
from lightning_sql.runtime.trainer import DEFAULT_STORE_URL
from lightning_sql.store.sql.migrate import COMPAT_TABLE, HEAD_REVISION
from lightning_sql.store.sql.schema import VERSION_TABLE
from tests.analysis.fixtures import Populated
from tests.cli.runner import as_json, invoke, ok

NEWER = "9999"


def stamp(spec: Populated, revision: str, min_code_revision: str) -> None:
    """Pretend a newer release migrated the database: rewrite its version and compat marker."""
    meta = MetaData(schema=spec.schema)
    version = Table(VERSION_TABLE, meta, Column("version_num", String(32)))
    compat = Table(COMPAT_TABLE, meta, Column("min_code_revision", String(32)))

    def write(conn: object) -> None:
        conn.execute(version.update().values(version_num=revision))  # type: ignore[attr-defined]
        conn.execute(compat.delete())  # type: ignore[attr-defined]
        conn.execute(compat.insert().values(min_code_revision=min_code_revision))  # type: ignore[attr-defined]

    if spec.is_postgres:
        async def go() -> None:
            engine = create_async_engine(spec.url.replace("postgresql://", "postgresql+asyncpg://", 1))
            async with engine.begin() as conn:
                await conn.run_sync(write)
            await engine.dispose()

        asyncio.run(go())
    else:
        engine = create_engine(spec.url)
        with engine.begin() as conn:
            write(conn)
        engine.dispose()


def test_newer_compatible_schema_is_called_compatible(fresh: Populated) -> None:
    args = fresh.cli_args()
    ok(["db", "upgrade", *args])
    stamp(fresh, NEWER, min_code_revision="0001")

    check = invoke(["db", "check", *args])
    assert check.exit_code == 0, check.output
    assert "newer than this code" in check.stdout and "compatible" in check.stdout
    assert "db upgrade" not in check.stdout
    assert ok(["db", "check", *args]) | {"differences": []} == {
        "ok": True, "revision": NEWER, "head": HEAD_REVISION, "state": "newer, compatible", "differences": []
    }

    upgrade = invoke(["db", "upgrade", *args])
    assert upgrade.exit_code == 0, upgrade.output
    assert "Nothing to upgrade" in upgrade.stdout and "compatible" in upgrade.stdout
    assert ok(["db", "current", *args])["state"] == "newer, compatible"
    assert ok(["db", "current", *args])["revision"] == NEWER  # untouched


def test_newer_incompatible_schema_says_to_upgrade_lightning_sql(fresh: Populated) -> None:
    args = fresh.cli_args()
    ok(["db", "upgrade", *args])
    stamp(fresh, NEWER, min_code_revision=NEWER)

    check = invoke(["db", "check", "--json", *args])
    assert check.exit_code == 1
    assert as_json(check)["state"] == "newer, incompatible"
    human = invoke(["db", "check", *args])
    assert human.exit_code == 1 and "upgrade lightning_sql" in human.stdout and "db upgrade" not in human.stdout

    upgrade = invoke(["db", "upgrade", "--json", *args])
    assert upgrade.exit_code == 1
    message = as_json(upgrade)["error"]
    assert "newer than this code" in message and "upgrade lightning_sql" in message
    assert "Can't locate revision" not in upgrade.output
    assert ok(["db", "current", *args])["revision"] == NEWER


# --- the default store -----------------------------------------------------------------------------------


def test_without_url_commands_use_the_trainers_default_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"LIGHTNING_SQL_URL": "", "LIGHTNING_SQL_RUN": ""}
    default_file = tmp_path / DEFAULT_STORE_URL.removeprefix("sqlite:///")

    missing = invoke(["runs"], env=env)
    assert missing.exit_code == 1
    assert str(default_file) in missing.output and "default store" in missing.output
    assert not default_file.exists()

    async def train() -> None:
        async with SqlLightningStore(DEFAULT_STORE_URL, run="defaulted") as store:
            await store.enqueue_rollout({"q": 1})

    asyncio.run(train())
    assert [r["name"] for r in ok(["runs"], env=env)] == ["defaulted"]
    assert len(ok(["rollouts", "--run", "defaulted"], env=env)) == 1
    assert ok(["db", "current"], env=env)["state"] == "up to date"


# --- serve and the console script ---------------------------------------------------------------------------


def test_serve_without_the_server_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning_sql.server.command", None)  # import fails: not installed
    for args in (["serve"], ["serve", "--url", "sqlite:///x.db", "--port", "1"]):
        result = invoke(args)
        assert result.exit_code == 1
        (line,) = result.output.strip().splitlines()
        assert "pip install 'lightning_sql[server]'" in line


def test_serve_runs_the_server_packages_command(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    @click.command("serve")
    @click.option("--port", type=int)
    def serve(port: int) -> None:
        calls.append(port)

    module = types.ModuleType("lightning_sql.server.command")
    module.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning_sql.server.command", module)
    result = invoke(["serve", "--port", "8123"])
    assert result.exit_code == 0, result.output
    assert calls == [8123]
    assert "serve" in invoke(["--help"]).stdout


def test_console_script_points_at_the_package() -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "lightning-sql"]
    assert script.value == "lightning_sql.cli:main"
    from lightning_sql import cli

    assert script.load() is cli.main
