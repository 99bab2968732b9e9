"""Online backups, as docs/operations.md "Backups" gives them, taken while a writer process keeps
writing: SQLite's backup API (``sqlite3.connect(db).backup(...)``) and ``VACUUM INTO``; PostgreSQL's
``pg_dump --schema=... --format=custom`` restored with ``pg_restore`` into a new database.

Each backup opens as a store without migrating, holds a consistent prefix of the writer's work (at
least what was committed before the backup began, at most what was committed when it ended, every
rollout with its span), and the writer kept committing while and after it was taken.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lightning_sql import SqlLightningStore
from tests.conftest import PG_URL, BackendSpec
from tests.helpers import pg_execute

pytestmark = pytest.mark.slow

WRITER = textwrap.dedent(
    """
    import asyncio, os, sys
    from lightning_sql import Span, SqlLightningStore

    async def main(url, schema, stop):
        options = {"schema": schema} if schema else {}
        store = SqlLightningStore(url, run="live", clock_sync=False, **options)
        n = 0
        while not os.path.exists(stop):
            started = await store.start_rollout(input={"n": n})
            rid, aid = started.rollout_id, started.attempt.attempt_id
            await store.add_span(Span.from_attributes(attributes={"n": n}, rollout_id=rid, attempt_id=aid, sequence_id=1))
            n += 1
            print(n, flush=True)
        await store.close()

    asyncio.run(main(*sys.argv[1:4]))
    """
)


@contextmanager
def writer(backend: BackendSpec, tmp_path: Path) -> Iterator[Writer]:
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, backend.url, backend.schema or "", str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    live = Writer(proc)
    try:
        live.wait_for(20)  # running, and some work committed before the backup
        yield live
    finally:
        stop.touch()
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()


class Writer:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.committed = 0  # rollouts (with their span) the writer reported done

    def wait_for(self, n: int) -> int:
        """Read the writer's reports until it has committed ``n`` in all; the count so far."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120  # generous: start-up on a busy machine
        while self.committed < n:
            line = self.proc.stdout.readline()
            assert line, f"the writer ended (code {self.proc.poll()}) after {self.committed}"
            self.committed = int(line)
            assert time.monotonic() < deadline
        return self.committed


async def _backup_holds_a_prefix(store: SqlLightningStore, at_least: int, at_most: int) -> None:
    try:
        rollouts = await store.query_rollouts()
        assert at_least <= len(rollouts) <= at_most + 1, (at_least, len(rollouts), at_most)  # +1: in flight
        numbers = sorted(r.input["n"] for r in rollouts)
        assert numbers == list(range(len(numbers)))  # a prefix of the writer's work, no gap
        with_span = [r for r in rollouts if len(await store.query_spans(r.rollout_id)) == 1]
        assert len(with_span) >= len(rollouts) - 1  # the writer's last rollout may be without its span
    finally:
        await store.close()


@pytest.mark.parametrize("mp_backend", ["sqlite_file"], indirect=True)
@pytest.mark.parametrize("how", ["backup API", "VACUUM INTO"])
async def test_an_online_sqlite_backup_while_a_writer_writes(mp_backend: BackendSpec, tmp_path: Path, how: str) -> None:
    db = mp_backend.url.removeprefix("sqlite:///")
    copy = tmp_path / "backup.db"
    with writer(mp_backend, tmp_path) as live:
        before = live.committed
        source = sqlite3.connect(db)
        try:
            if how == "backup API":
                target = sqlite3.connect(copy)
                source.backup(target)
                target.close()
            else:
                source.execute("VACUUM INTO ?", (str(copy),))
        finally:
            source.close()
        after = live.committed
        live.wait_for(after + 20)  # the writer was never stopped by the backup
    check = sqlite3.connect(copy)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        check.close()
    await _backup_holds_a_prefix(
        SqlLightningStore(f"sqlite:///{copy}", run="live", read_only=True), before, max(after, live.committed)
    )


@pytest.mark.parametrize("mp_backend", ["postgres"], indirect=True)
async def test_an_online_pg_dump_while_a_writer_writes(mp_backend: BackendSpec, tmp_path: Path) -> None:
    schema = mp_backend.schema
    assert schema is not None
    pg_dump, pg_restore = shutil.which("pg_dump"), shutil.which("pg_restore")
    assert pg_dump and pg_restore, "PostgreSQL's client programs are part of the test machine"
    dump = tmp_path / "agents.dump"
    database = f"lsql_restore_{uuid.uuid4().hex[:8]}"
    dsn = PG_URL.replace("postgresql+asyncpg://", "postgresql://")
    with writer(mp_backend, tmp_path) as live:
        before = live.committed
        subprocess.run(
            [pg_dump, f"--schema={schema}", "--format=custom", f"--file={dump}", dsn], check=True, timeout=120
        )
        after = live.committed
        live.wait_for(after + 20)
    await pg_execute(PG_URL, f"CREATE DATABASE {database}")
    try:
        restored = dsn.rsplit("/", 1)[0] + f"/{database}"
        subprocess.run([pg_restore, f"--dbname={restored}", str(dump)], check=True, timeout=120)
        store = SqlLightningStore(restored, schema=schema, run="live", read_only=True, clock_sync=False)
        await _backup_holds_a_prefix(store, before, max(after, live.committed))
    finally:
        await asyncio.sleep(0)
        await pg_execute(PG_URL, f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
