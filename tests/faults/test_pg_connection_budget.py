"""The connection budget on PostgreSQL: one process holds at most ``pool_size`` + 1 connections (the +1
is the LISTEN connection), so many processes and hosts can share one server.

Runs on a private cluster (tests/faults/servers.py); every scenario logs in as a role of its own, so the
server's pg_stat_activity counts exactly that store's (or those workers') connections.

Guarantees:
* a busy store (concurrent claims, span writes, reports, reads and a waiter) never holds more than
  ``pool_size`` + 1 connections; ``pool_size`` defaults to at most 4 and is set by the store option
  ``pool_size=N`` or the URL query parameter ``?pool_size=N``; a bad value is a clear error; and no
  call of that busy store stalls (waiting out a pool checkout timeout while the others run);
* 8 ``lightning-sql worker -n 8`` processes logged in as a role limited to 24 connections (fewer than
  8 x (4 + 1)) share the slots: every rollout ends succeeded with exactly one attempt, and no worker
  exits, because a worker waits and retries "too many connections" (SQLSTATE 53300) instead of dying.

Size knobs: LIGHTNING_SQL_FAULT_BUDGET_ROLLOUTS (CI 300, full 2000), LIGHTNING_SQL_FAULT_BUDGET_SECONDS
(seconds of load per budget check: CI 2, full 10); LIGHTNING_SQL_FAULT_SIZE=full selects the full sizes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest

from lightning_sql import SqlLightningStore
from tests.faults.servers import ThrowawayPostgres, WorkerProcess, sample_max
from tests.faults.support import make_span, sized

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MAX_DEFAULT_POOL_SIZE = 4
ROLE_LIMIT = 24
N_WORKERS = 8
RUNNERS_PER_WORKER = 8
MAX_CALL_SECONDS = 15.0  # generous: under this load a call takes well under a second

T = TypeVar("T")


async def _count(admin: asyncpg.Connection, role: str) -> int:
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND backend_type = 'client backend'", role
        )
    )


async def _busy(store: SqlLightningStore, seconds: float, tasks: int = 32) -> None:
    """Everything a busy process does at once: claims, span batches, reports, reads, a waiter."""
    first = await store.enqueue_many_rollouts([{"input": {"first": i}} for i in range(8)])
    waiter = asyncio.create_task(
        store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in first], timeout=seconds + 60)
    )
    deadline = time.monotonic() + seconds
    slowest: list[tuple[float, str]] = [(0.0, "")]

    async def timed(name: str, call: Awaitable[T]) -> T:
        started = time.monotonic()
        try:
            return await call
        finally:
            slowest.append((time.monotonic() - started, name))

    async def one(n: int) -> None:
        while time.monotonic() < deadline:
            await timed("enqueue_rollout", store.enqueue_rollout({"n": n}))
            claimed = await timed("dequeue_rollout", store.dequeue_rollout(worker_id=f"busy-{n}"))
            if claimed is not None:
                rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
                await timed("add_many_spans", store.add_many_spans([make_span(rid, aid, k) for k in range(1, 4)]))
                await timed("update_attempt", store.update_attempt(rid, aid, status="succeeded"))
            await timed("query_rollouts", store.query_rollouts(status_in=["succeeded"], limit=5))

    await asyncio.gather(*(one(n) for n in range(tasks)))
    # A call that waits out a pool checkout timeout (30 s by default) stalls a claim for that long
    # while the others run: a budget enforced by queueing must hand the connections round instead.
    worst, name = max(slowest)
    assert worst < MAX_CALL_SECONDS, f"{name} took {worst:.1f}s under a {seconds:.0f}s load"
    finished = await waiter  # the first rollouts were claimed and finished first: the waiter woke
    assert sorted(r.rollout_id for r in finished) == sorted(r.rollout_id for r in first)
    assert {r.status for r in finished} == {"succeeded"}


async def _peak_connections(pg: ThrowawayPostgres, role: str, store: SqlLightningStore) -> int:
    """The most connections the server held for ``role`` while ``store`` was busy."""
    seconds = sized("LIGHTNING_SQL_FAULT_BUDGET_SECONDS", 2, 10)
    admin = await asyncpg.connect(pg.url())
    try:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_max(lambda: _count(admin, role), stop))
        try:
            await _busy(store, seconds)
        finally:
            stop.set()
            peak = await sampler
        await store.close()
        deadline = time.monotonic() + 10
        while await _count(admin, role) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert await _count(admin, role) == 0, "close() left connections open"
    finally:
        await admin.close()
    print(f"\n[connection budget] role {role}: at most {peak} connections")
    assert peak >= 1, "the sampler never saw the store's connections"
    return peak


async def test_default_pool_holds_at_most_five_connections(throwaway_pg: ThrowawayPostgres) -> None:
    url = await throwaway_pg.role_with_database("budget_default")
    store = SqlLightningStore(url, run="budget")
    try:
        peak = await _peak_connections(throwaway_pg, "budget_default", store)
    finally:
        await store.close()
    assert peak <= MAX_DEFAULT_POOL_SIZE + 1


async def test_pool_size_option_bounds_the_connections(throwaway_pg: ThrowawayPostgres) -> None:
    url = await throwaway_pg.role_with_database("budget_option")
    store = SqlLightningStore(url, run="budget", pool_size=1)
    try:
        peak = await _peak_connections(throwaway_pg, "budget_option", store)
    finally:
        await store.close()
    assert peak <= 1 + 1


async def test_pool_size_url_parameter_bounds_the_connections(throwaway_pg: ThrowawayPostgres) -> None:
    url = await throwaway_pg.role_with_database("budget_url")
    store = SqlLightningStore(f"{url}?pool_size=2", run="budget")
    try:
        peak = await _peak_connections(throwaway_pg, "budget_url", store)
    finally:
        await store.close()
    assert peak <= 2 + 1


@pytest.mark.parametrize(
    "url_suffix, options",
    [("?pool_size=many", {}), ("?pool_size=0", {}), ("", {"pool_size": 0}), ("", {"pool_size": "2"})],
)
def test_a_bad_pool_size_is_a_clear_error(
    throwaway_pg: ThrowawayPostgres, url_suffix: str, options: dict[str, Any]
) -> None:
    with pytest.raises((ValueError, TypeError), match="pool_size"):
        SqlLightningStore(throwaway_pg.url() + url_suffix, run="budget", **options)


async def test_many_workers_share_a_role_limited_to_24_connections(
    throwaway_pg: ThrowawayPostgres, tmp_path: Path
) -> None:
    n_rollouts = int(sized("LIGHTNING_SQL_FAULT_BUDGET_ROLLOUTS", 300, 2000))
    role = "budget_workers"
    url = await throwaway_pg.role_with_database(role, connection_limit=ROLE_LIMIT)
    run = "shared"
    setup = SqlLightningStore(url, run=run)
    try:
        await setup.enqueue_many_rollouts([{"input": {"i": i}} for i in range(n_rollouts)])
    finally:
        await setup.close()
    # The observer logs in as the superuser: role limits do not apply to it, so it never takes a slot.
    observer = SqlLightningStore(throwaway_pg.url(database=role), run=run, create_run=False)
    workers: list[WorkerProcess] = []
    try:
        started = time.monotonic()
        workers = [
            WorkerProcess(url, run, "tests.cli.agents:echo_agent", RUNNERS_PER_WORKER, tmp_path / f"worker-{k}")
            for k in range(N_WORKERS)
        ]
        timeout = 240 + n_rollouts * 0.1
        succeeded = 0
        while succeeded < n_rollouts:
            dead = [w for w in workers if not w.alive()]
            assert dead == [], "a worker exited before the run was done:\n" + "\n\n".join(w.describe() for w in dead)
            assert time.monotonic() - started < timeout, f"{succeeded}/{n_rollouts} succeeded after {timeout:.0f}s"
            succeeded = (await observer.query_rollouts(status_in=["succeeded"], limit=0)).total
            await asyncio.sleep(0.5)
        wall = time.monotonic() - started
        for w in workers:
            w.terminate()
        codes = [await asyncio.to_thread(w.wait, 60) for w in workers]
        assert codes == [0] * N_WORKERS, "\n\n".join(w.describe() for w in workers)
        print(f"\n[connection budget] {N_WORKERS} workers x {RUNNERS_PER_WORKER} runners, role limit {ROLE_LIMIT}: "
              f"{n_rollouts} rollouts in {wall:.1f}s")

        rollouts = list(await observer.query_rollouts())
        assert len(rollouts) == n_rollouts
        assert {r.status for r in rollouts} == {"succeeded"}
        for r in rollouts:  # exactly once: the latest attempt is the first, and it succeeded
            assert r.attempt is not None and r.attempt.sequence_id == 1 and r.attempt.status == "succeeded", r
    finally:
        for w in workers:
            w.kill()
        await observer.close()
