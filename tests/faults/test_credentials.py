"""Credentials and least privilege (docs/operations.md, "Credentials" and "PostgreSQL roles").

* A password in the URL never appears in ``repr(store)``, ``store.url``, a StoreUnavailableError, the
  logs of a failed connect, or the CLI's output.
* The documented least-privilege setup works: a writer role (trainers, runners) can run the whole
  lifecycle without owning anything; a read-only role (analysts) can read every table and view and
  can write nothing, neither through a ``read_only=True`` store nor with raw SQL.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import asyncpg
import pytest
from click.testing import CliRunner

from lightning_sql import SqlLightningStore, StoreUnavailableError
from tests.conftest import PG_URL, BackendSpec
from tests.faults.support import assert_consistent, make_span
from tests.helpers import pg_execute

SECRET = "s3cret"
DEAD_URL = f"postgresql://user:{SECRET}@127.0.0.1:1/x"  # nothing listens on port 1


async def test_password_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store = SqlLightningStore(DEAD_URL, run="r", connect_deadline_seconds=0.5)
    try:
        assert SECRET not in repr(store) and SECRET not in store.url and "***" in store.url
        with pytest.raises(StoreUnavailableError) as info:
            await store.enqueue_rollout({})
        assert "127.0.0.1:1" in str(info.value)
        for text in (str(info.value), repr(info.value), str(info.value.__cause__ or "")):
            assert SECRET not in text
        assert SECRET not in caplog.text
    finally:
        await store.close()
    with pytest.raises(ValueError) as bad_url:
        SqlLightningStore(f"mysql://user:{SECRET}@host/db")
    assert SECRET not in str(bad_url.value)


def test_cli_output_masks_the_password() -> None:
    cli = pytest.importorskip("lightning_sql.cli")
    runner = CliRunner()
    for args in (
        ["runs", "--url", DEAD_URL, "--connect-timeout", "0.5"],
        ["check", "--url", DEAD_URL, "--run", "r", "--connect-timeout", "0.5"],
        ["runs", "--url", DEAD_URL, "--connect-timeout", "0.5", "--json"],
    ):
        result = runner.invoke(cli.cli, args)
        output = result.output + (str(result.exception) if result.exception else "")
        assert result.exit_code != 0, args
        assert SECRET not in output, (args, output)


# --- least-privilege roles ---------------------------------------------------------------------------

WRITER_GRANTS = """
GRANT USAGE ON SCHEMA {schema} TO {writer};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {writer};
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {writer};
"""
READER_GRANTS = """
GRANT USAGE ON SCHEMA {schema} TO {reader};
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {reader};
"""


def _as(role: str) -> str:
    return PG_URL.replace("postgres@", f"{role}:pw-{role}@", 1)


async def test_writer_and_read_only_roles(pg_backend: BackendSpec, caplog: pytest.LogCaptureFixture) -> None:
    suffix = uuid.uuid4().hex[:8]
    writer, reader = f"lsql_writer_{suffix}", f"lsql_reader_{suffix}"
    schema = pg_backend.schema
    assert schema is not None
    await pg_execute(PG_URL, f"CREATE ROLE {writer} LOGIN PASSWORD 'pw-{writer}'; CREATE ROLE {reader} LOGIN PASSWORD 'pw-{reader}'")
    try:
        # The owner (a migration role) creates and upgrades the schema once.
        owner = pg_backend.open(run="roles", clock_sync=False)
        await owner.list_runs()
        await owner.close()
        await pg_execute(PG_URL, WRITER_GRANTS.format(schema=schema, writer=writer) + READER_GRANTS.format(schema=schema, reader=reader))

        # Writer: the full lifecycle, no DDL privileges needed.
        caplog.set_level(logging.DEBUG, logger="lightning_sql.store.sql.store")
        store = SqlLightningStore(_as(writer), run="roles", schema=schema, auto_migrate=False)
        try:
            await store.add_resources({})
            r = await store.enqueue_rollout({"q": 1})
            claimed = await store.dequeue_rollout(worker_id="runner-1")
            assert claimed is not None
            await store.add_span(make_span(r.rollout_id, claimed.attempt.attempt_id, 1))
            await store.touch_attempt(r.rollout_id, claimed.attempt.attempt_id)
            await store.update_attempt(r.rollout_id, claimed.attempt.attempt_id, status="succeeded")
            await store.update_worker("runner-1", heartbeat_stats={"ok": True})
            await store.sweep()
            await assert_consistent(store)
        finally:
            await store.close()
        # Its lazy sweep looked for tables to ANALYZE (ADR 0006) as a role that owns none: no error.
        checks = [r.getMessage() for r in caplog.records if "ANALYZE" in r.getMessage()]
        assert checks and all(m.startswith("No table of schema") for m in checks), caplog.text

        # Reader, through a read-only store: every read works.
        ro = SqlLightningStore(_as(reader), run="roles", schema=schema, read_only=True)
        try:
            rollouts = await ro.query_rollouts()
            assert [x.status for x in rollouts] == ["succeeded"]
            assert len(await ro.query_spans(r.rollout_id)) == 1
            assert (await ro.get_latest_resources()) is not None
            assert len(await ro.query_workers()) == 1
            await ro.statistics()
            await assert_consistent(ro)
            with pytest.raises(PermissionError, match="enqueue_rollout"):
                await ro.enqueue_rollout({})
        finally:
            await ro.close()

        # Reader, with raw SQL: reads every table and view of the schema; every kind of write is refused.
        conn = await asyncpg.connect(_as(reader))
        try:
            await conn.execute(f"SET search_path TO {schema}")
            relations = [
                row["table_name"]
                for row in await conn.fetch(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1", schema
                )
            ]
            assert {"runs", "rollouts", "attempts", "spans", "workers", "resources"} <= set(relations)
            for rel in relations:  # tables and views alike
                await conn.fetch(f'SELECT * FROM "{rel}" LIMIT 1')
            for sql in (
                "INSERT INTO runs (name, status, created_at) VALUES ('x', 'active', 0)",
                "UPDATE rollouts SET status = 'failed'",
                "DELETE FROM spans",
                "TRUNCATE workers",
                "DROP TABLE attempts",
                "CREATE TABLE sneaky (x int)",
                "SELECT nextval('lightning_sql_position_seq')",
            ):
                with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
                    await conn.execute(sql)
        finally:
            await conn.close()

        # A writable store logged in as the reader cannot write either: a clear error, not a retry loop.
        sneaky = SqlLightningStore(_as(reader), run="roles", schema=schema, connect_deadline_seconds=5)
        try:
            with pytest.raises(PermissionError) as info:
                await asyncio.wait_for(sneaky.enqueue_rollout({}), timeout=30)
            assert f"pw-{reader}" not in str(info.value)
        finally:
            await sneaky.close()
    finally:
        await pg_execute(
            PG_URL,
            f"DROP OWNED BY {writer}; DROP OWNED BY {reader}; DROP ROLE IF EXISTS {writer}; DROP ROLE IF EXISTS {reader}"
        )
