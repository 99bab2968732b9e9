"""``delete_run`` works in batches, each its own short transaction, and resumes after a crash
(docs/store-contract.md §2.17 and §4 "Runs": "a crash leaves a smaller run that a second call finishes").

A child process deletes a run of BATCHES × DELETE_BATCH_ROWS spans; the test watches the run's span
count from a connection of its own (each batch commits on its own, so the count falls by
DELETE_BATCH_ROWS at a time), SIGKILLs the child once the count has fallen but not reached zero, and
then finds a smaller, consistent run (children go first: its rollouts and attempts are all there), and
a second ``delete_run`` that finishes it, leaving the other run of the database untouched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from typing import Any

import asyncpg
import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.store.sql.runs import DELETE_BATCH_ROWS
from tests.conftest import PG_URL, BackendSpec
from tests.contract.test_spans import make_span

pytestmark = pytest.mark.slow

ROLLOUTS = 10
BATCHES = 6  # span batches of the run: enough that a kill lands between two of them
TABLES = ("spans", "attempts", "rollouts", "resource_versions", "resources", "workers")

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from lightning_sql import SqlLightningStore

    async def main(url, schema):
        options = {"schema": schema} if schema else {}
        store = SqlLightningStore(url, run="keep", create_run=False, clock_sync=False, **options)
        print("deleting", flush=True)
        print(await store.delete_run("big"), flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


class Counter:
    """Rows of one run per table, read on a connection of the test's own (not the store's)."""

    def __init__(self, backend: BackendSpec) -> None:
        self.backend = backend
        self.sqlite: sqlite3.Connection | None = None
        self.pg: asyncpg.Connection | None = None

    async def open(self) -> None:
        if self.backend.is_postgres:
            self.pg = await asyncpg.connect(PG_URL.replace("postgresql+asyncpg://", "postgresql://"))
        else:
            self.sqlite = sqlite3.connect(self.backend.url.removeprefix("sqlite:///"))

    async def close(self) -> None:
        if self.pg is not None:
            await self.pg.close()
        if self.sqlite is not None:
            self.sqlite.close()

    def _table(self, name: str) -> str:
        return f'"{self.backend.schema}".{name}' if self.backend.is_postgres else name

    async def run_id(self, name: str) -> int | None:
        rows = await self._fetch(f"SELECT run_id FROM {self._table('runs')} WHERE name = {self._p(1)}", name)
        return int(rows[0][0]) if rows else None

    async def count(self, table: str, run_id: int) -> int:
        rows = await self._fetch(f"SELECT count(*) FROM {self._table(table)} WHERE run_id = {self._p(1)}", run_id)
        return int(rows[0][0])

    def _p(self, n: int) -> str:
        return f"${n}" if self.backend.is_postgres else "?"

    async def _fetch(self, sql: str, *args: Any) -> list[Any]:
        if self.pg is not None:
            return list(await self.pg.fetch(sql, *args))
        assert self.sqlite is not None
        return self.sqlite.execute(sql, args).fetchall()


async def _fill(store: SqlLightningStore, spans: int) -> None:
    per_rollout = spans // ROLLOUTS
    for _ in range(ROLLOUTS):
        started = await store.start_rollout(input={"big": True})
        rid, aid = started.rollout_id, started.attempt.attempt_id
        for start in range(1, per_rollout + 1, 1000):
            await store.add_many_spans([make_span(rid, aid, k) for k in range(start, min(start + 1000, per_rollout + 1))])


async def test_a_killed_delete_run_leaves_a_smaller_run_that_a_second_call_finishes(mp_backend: BackendSpec) -> None:
    spans = BATCHES * DELETE_BATCH_ROWS
    big = mp_backend.open(run="big", clock_sync=False)
    keep = mp_backend.open(run="keep", clock_sync=False)
    await _fill(big, spans)
    await big.update_resources("res", {})
    kept = await keep.start_rollout(input={"keep": True})
    await keep.add_span(make_span(kept.rollout_id, kept.attempt.attempt_id, 1))
    await big.close()
    await keep.close()

    counter = Counter(mp_backend)
    await counter.open()
    try:
        run_id = await counter.run_id("big")
        keep_id = await counter.run_id("keep")
        assert run_id is not None and keep_id is not None
        assert await counter.count("spans", run_id) == spans

        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, mp_backend.url, mp_backend.schema or ""],
            stdout=subprocess.PIPE,
            text=True,
        )
        seen: list[int] = []
        try:
            deadline = time.monotonic() + 120  # generous: the child's start-up and the first batch
            while True:
                n = await counter.count("spans", run_id)
                if not seen or seen[-1] != n:
                    seen.append(n)
                if 0 < n < spans:
                    os.kill(child.pid, signal.SIGKILL)
                    break
                assert child.poll() is None, f"the child ended before the test saw a batch: {seen}"
                assert time.monotonic() < deadline, f"no batch committed in time: {seen}"
                await asyncio.sleep(0.002)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL

        # Each batch committed on its own: the count only ever fell by whole batches.
        assert all((spans - n) % DELETE_BATCH_ROWS == 0 for n in seen), seen

        # A smaller, consistent run: children first, so its rollouts and attempts are all there.
        left = await counter.count("spans", run_id)
        assert 0 < left < spans and left % DELETE_BATCH_ROWS == 0, (left, seen)
        assert await counter.count("rollouts", run_id) == ROLLOUTS
        assert await counter.count("attempts", run_id) == ROLLOUTS
        store = mp_backend.open(run="keep", create_run=False, clock_sync=False)
        try:
            assert [r.name for r in await store.list_runs()] == ["big", "keep"]
            assert await store.delete_run("big") is True  # the second call finishes it
            assert [r.name for r in await store.list_runs()] == ["keep"]
            assert await store.delete_run("big") is False
            for table in TABLES:
                assert await counter.count(table, run_id) == 0, table
            assert await counter.count("spans", keep_id) == 1
            assert [r.rollout_id for r in await store.query_rollouts()] == [kept.rollout_id]
        finally:
            await store.close()
    finally:
        await counter.close()
