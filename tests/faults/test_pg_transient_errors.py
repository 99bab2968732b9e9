"""Transient PostgreSQL errors are retried with back-off until ``connect_deadline_seconds``.

Runs on a private cluster (tests/faults/servers.py), each scenario as a role of its own:
* ``statement_timeout`` (SQLSTATE 57014): the role's statement_timeout is 1 s while another session
  holds an ACCESS EXCLUSIVE lock on the rollouts table for LIGHTNING_SQL_FAULT_LOCK_SECONDS (CI 4 s,
  full 40 s).  A store call retries the cancelled statement and completes once the lock is released;
  a store whose deadline ends first raises StoreUnavailableError, never the raw error, and only after
  its deadline.  A worker whose store's deadline is shorter than the lock never exits: its rollouts
  end succeeded, once each.
* a role connection limit reached at start-up (SQLSTATE 53300): the role may hold one connection and
  another session holds it; a store call waits for the slot (freed after
  LIGHTNING_SQL_FAULT_SLOT_SECONDS, CI 2 s, full 10 s) and then succeeds; with a shorter deadline it
  raises StoreUnavailableError.

LIGHTNING_SQL_FAULT_SIZE=full selects the full sizes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest

from lightning_sql import SqlLightningStore, StoreUnavailableError
from lightning_sql.runtime.worker import run_worker_async
from tests.faults.servers import ThrowawayPostgres
from tests.faults.support import assert_consistent, sized

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SCHEMA = "faults"
SHORT_DEADLINE_S = 2.0
SETTLE_TIMEOUT_S = 60.0  # generous: how long the work may take once the database answers again


def lock_seconds() -> float:
    return sized("LIGHTNING_SQL_FAULT_LOCK_SECONDS", 4, 40)


@asynccontextmanager
async def exclusive_lock(pg: ThrowawayPostgres, database: str, table: str) -> AsyncIterator[None]:
    """ACCESS EXCLUSIVE on ``SCHEMA.table`` from a superuser session until the block ends."""
    conn = await asyncpg.connect(pg.url(database=database))
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute(f'LOCK TABLE "{SCHEMA}"."{table}" IN ACCESS EXCLUSIVE MODE')
        try:
            yield
        finally:
            await transaction.rollback()
    finally:
        await conn.close()


async def limit_to_one_connection(pg: ThrowawayPostgres, role: str) -> None:
    """CONNECTION LIMIT 1 for ``role``, once the set-up store's connections are gone."""
    deadline = time.monotonic() + 30
    while await pg.connections_of(role):
        assert time.monotonic() < deadline, f"the set-up store left connections of {role} open"
        await asyncio.sleep(0.05)
    await pg.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 1')


async def _timed(call: asyncio.Future[object] | object) -> tuple[float, object]:
    started = time.monotonic()
    try:
        result = await call  # type: ignore[misc]
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test looks at
        result = exc
    return time.monotonic() - started, result


async def test_statement_timeout_under_a_held_lock_is_retried_until_the_lock_goes(
    throwaway_pg: ThrowawayPostgres,
) -> None:
    hold = lock_seconds()
    url = await throwaway_pg.role_with_database("timeouts", role_settings={"statement_timeout": "1s"})
    patient = SqlLightningStore(url, run="locked", schema=SCHEMA, connect_deadline_seconds=hold + 60)
    impatient = SqlLightningStore(url, run="locked", schema=SCHEMA, connect_deadline_seconds=SHORT_DEADLINE_S)
    try:
        await patient.enqueue_many_rollouts([{"input": {"i": i}} for i in range(3)])
        await impatient.statistics()  # both stores are connected before the lock
        async with exclusive_lock(throwaway_pg, "timeouts", "rollouts"):
            calls = [
                asyncio.create_task(_timed(patient.enqueue_rollout({"i": 3}))),
                asyncio.create_task(_timed(patient.dequeue_rollout(worker_id="patient"))),
                asyncio.create_task(_timed(patient.query_rollouts(status_in=["queuing"], limit=0))),
            ]
            refused = asyncio.create_task(_timed(impatient.dequeue_rollout(worker_id="impatient")))
            await asyncio.sleep(hold)
        outcomes = [await call for call in calls]
        refused_after, refused_outcome = await refused

        for elapsed, result in outcomes:
            assert not isinstance(result, BaseException), f"a call failed under the lock: {result!r}"
            assert elapsed >= hold * 0.8, f"a call finished after {elapsed:.1f}s: the lock did not hold it up"
        enqueued, claimed, queued = (result for _, result in outcomes)
        assert getattr(enqueued, "status", None) == "queuing"
        assert claimed is not None and claimed.status == "preparing"  # type: ignore[attr-defined]
        assert isinstance(queued.total, int)  # type: ignore[attr-defined]

        assert isinstance(refused_outcome, StoreUnavailableError), (
            f"past its deadline the call must raise StoreUnavailableError, got {refused_outcome!r}"
        )
        assert refused_after >= SHORT_DEADLINE_S * 0.9, f"gave up after {refused_after:.1f}s, before its deadline"
        assert refused_after < SHORT_DEADLINE_S + 20, f"the call hung for {refused_after:.1f}s past its deadline"
        print(f"\n[statement_timeout] lock {hold:.0f}s: calls took {[round(e, 1) for e, _ in outcomes]}s; "
              f"the {SHORT_DEADLINE_S:.0f}s-deadline call raised after {refused_after:.1f}s: {refused_outcome}")

        assert (await patient.query_rollouts(limit=0)).total == 4
        await assert_consistent(patient)
    finally:
        await patient.close()
        await impatient.close()


async def test_worker_outlives_a_lock_longer_than_its_deadline(
    throwaway_pg: ThrowawayPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    hold = lock_seconds()
    n_rollouts = 6
    url = await throwaway_pg.role_with_database("timeouts_worker", role_settings={"statement_timeout": "1s"})
    store = SqlLightningStore(url, run="locked", schema=SCHEMA)
    stop = threading.Event()
    caplog.set_level(logging.INFO)
    try:
        await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(n_rollouts)])
        async with exclusive_lock(throwaway_pg, "timeouts_worker", "rollouts"):
            worker = asyncio.create_task(
                run_worker_async(
                    url, "locked", "tests.cli.agents:echo_agent", n=2, stop_event=stop, schema=SCHEMA,
                    poll_interval=0.2, heartbeat_interval=0.5, connect_deadline_seconds=SHORT_DEADLINE_S,
                )
            )
            await asyncio.sleep(hold)
            assert not worker.done(), f"the worker ended while the table was locked: {worker}"
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (await store.query_rollouts(status_in=["succeeded"], limit=0)).total < n_rollouts:
            assert not worker.done(), f"the worker ended before the run was done: {worker}"
            assert time.monotonic() < deadline, "the rollouts did not finish after the lock was released"
            await asyncio.sleep(0.2)
        stop.set()
        reported = await asyncio.wait_for(worker, SETTLE_TIMEOUT_S)
        assert reported == n_rollouts
        for rollout in await store.query_rollouts():
            assert rollout.status == "succeeded"
            assert rollout.attempt is not None and rollout.attempt.sequence_id == 1, rollout  # type: ignore[attr-defined]
        assert "unusable value" not in caplog.text
        await assert_consistent(store)
    finally:
        stop.set()
        await store.close()


async def test_role_connection_limit_reached_at_start_up_is_waited_out(throwaway_pg: ThrowawayPostgres) -> None:
    slot_seconds = sized("LIGHTNING_SQL_FAULT_SLOT_SECONDS", 2, 10)
    role = "one_slot"
    url = await throwaway_pg.role_with_database(role)
    setup = SqlLightningStore(url, run="slot", schema=SCHEMA)
    try:
        await setup.enqueue_rollout({"i": 0})  # schema and run exist; the limit comes next
    finally:
        await setup.close()
    await limit_to_one_connection(throwaway_pg, role)
    squatter = await asyncpg.connect(url)  # the role's only slot
    store = SqlLightningStore(url, run="slot", schema=SCHEMA, connect_deadline_seconds=slot_seconds + 60)
    try:

        async def free_the_slot() -> None:
            await asyncio.sleep(slot_seconds)
            await squatter.close()

        freeing = asyncio.create_task(free_the_slot())
        elapsed, result = await _timed(store.enqueue_rollout({"i": 1}))
        await freeing
        assert not isinstance(result, BaseException), f"the call failed instead of waiting for the slot: {result!r}"
        assert elapsed >= slot_seconds * 0.8, f"the call finished after {elapsed:.1f}s: the slot was not taken"
        print(f"\n[connection limit] the first call waited {elapsed:.1f}s for the role's only slot")
        claimed = await store.dequeue_rollout(worker_id="one-slot")
        assert claimed is not None
        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        assert (await store.query_rollouts(limit=0)).total == 2
        await assert_consistent(store)
    finally:
        if not squatter.is_closed():
            await squatter.close()
        await store.close()


async def test_role_connection_limit_past_the_deadline_raises_store_unavailable(
    throwaway_pg: ThrowawayPostgres,
) -> None:
    role = "no_slot"
    url = await throwaway_pg.role_with_database(role)
    setup = SqlLightningStore(url, run="slot", schema=SCHEMA)
    try:
        await setup.enqueue_rollout({"i": 0})
    finally:
        await setup.close()
    await limit_to_one_connection(throwaway_pg, role)
    squatter = await asyncpg.connect(url)
    store = SqlLightningStore(url, run="slot", schema=SCHEMA, connect_deadline_seconds=SHORT_DEADLINE_S)
    try:
        elapsed, result = await _timed(store.query_rollouts(limit=0))
        assert isinstance(result, StoreUnavailableError), f"expected StoreUnavailableError, got {result!r}"
        assert elapsed >= SHORT_DEADLINE_S * 0.9, f"gave up after {elapsed:.1f}s, before its deadline"
        assert elapsed < SHORT_DEADLINE_S + 20, f"the call hung for {elapsed:.1f}s past its deadline"
        await squatter.close()
        assert (await store.query_rollouts(limit=0)).total == 1  # the same store goes on once a slot is free
    finally:
        if not squatter.is_closed():
            await squatter.close()
        await store.close()
