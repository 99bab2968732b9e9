"""ADR 0005 decision 8: on PostgreSQL the units of a worker's home loop (the first event loop that
calls it) run in that loop, on an engine of its own; other loops' units go through the I/O thread.
Same results either way (the whole contract suite runs on the home loop); these tests pin down
where units run and what happens to the home engine's connections."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from lightning_sql.store.sql.engine import AsyncLoopWorker

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


async def _unit_thread(store: Any) -> int:
    """The thread that ran a read unit of ``store`` called from the running loop."""
    return await store._call("test", lambda _ctx, _run_id, _now: threading.get_ident(), write=False)


async def _write_thread(store: Any) -> int:
    return await store._call("test", lambda _ctx, _run_id, _now: threading.get_ident(), write=True)


def _closed(record: Any) -> bool:
    conn = record.dbapi_connection
    return conn is None or conn._connection.is_closed()


async def test_the_home_loop_runs_its_units_itself_and_other_loops_hop(store: Any) -> None:
    await store.enqueue_rollout({"i": 1})  # schema, run: the first calls go through the I/O thread
    worker = store._worker
    assert isinstance(worker, AsyncLoopWorker) and worker.home_units
    here = threading.get_ident()
    assert await _unit_thread(store) == here
    assert await _write_thread(store) == here
    assert worker._home is not None and worker._home.loop is asyncio.get_running_loop()

    seen: dict[str, int] = {}

    def other_loop() -> None:
        async def main() -> None:
            seen["read"] = await _unit_thread(store)
            seen["write"] = await _write_thread(store)
            seen["thread"] = threading.get_ident()

        asyncio.run(main())

    thread = threading.Thread(target=other_loop)
    thread.start()
    await asyncio.to_thread(thread.join, 60)
    io_thread = worker._thread.ident
    assert seen["read"] == seen["write"] == io_thread != seen["thread"]
    assert worker._home.loop is asyncio.get_running_loop()  # still home

    worker.home_units = False  # LIGHTNING_SQL_PG_HOME_LOOP=0
    assert await _unit_thread(store) == io_thread


async def test_results_are_the_same_on_the_home_loop_and_through_the_thread(store: Any) -> None:
    await store.enqueue_rollout({"i": 0})
    worker = store._worker
    results = []
    for home in (True, False):
        worker.home_units = home
        ar = await store.start_rollout({"home": home})
        pair = (ar.rollout_id, ar.attempt.attempt_id)
        ids = await asyncio.gather(*(store.get_many_span_sequence_ids([pair, pair]) for _ in range(3)))
        attempt = await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
        rollout = await store.get_rollout_by_id(ar.rollout_id)
        assert rollout is not None
        results.append(([list(i) for i in ids], attempt.status, rollout.status))
    assert results[0] == results[1] == ([[1, 2], [3, 4], [5, 6]], "succeeded", "succeeded")


def test_a_new_loop_becomes_home_once_the_old_one_is_closed(backend: Any, clock: Any) -> None:
    """Consecutive ``asyncio.run`` calls: the second loop adopts the worker, and the connections of
    the first loop's engine (which nothing can close politely any more) are ended."""
    store = backend.open(run="loops", clock=clock, clock_sync=False)
    try:
        asyncio.run(store.enqueue_rollout(1))
        first_thread = asyncio.run(_unit_thread(store))  # runs on the first loop that asked
        worker = store._worker
        old = worker._home
        assert first_thread == threading.get_ident() and old is not None and old.loop.is_closed()
        records = list(old.opened)
        assert records and not all(_closed(r) for r in records)  # left open by a loop that ended

        async def again() -> tuple[int, Any]:
            return await _unit_thread(store), asyncio.get_running_loop()

        thread, loop = asyncio.run(again())
        assert thread == threading.get_ident()
        assert worker._home is not old and worker._home.loop is loop
        assert all(_closed(r) for r in records)
    finally:
        asyncio.run(store.close())


async def test_closing_the_last_store_on_the_home_loop_closes_the_home_engine(backend: Any, clock: Any) -> None:
    store = backend.open(run="close", clock=clock, clock_sync=False)
    await store.enqueue_rollout(1)
    await _unit_thread(store)
    worker = store._worker
    home = worker._home
    records = list(home.opened)
    assert records
    await store.close()
    assert worker._home is None and worker.closed
    assert all(_closed(r) for r in records)


async def test_a_second_holder_keeps_the_home_engine_open(backend: Any, clock: Any) -> None:
    first = backend.open(run="a", clock=clock, clock_sync=False)
    second = backend.open(run="b", clock=clock, clock_sync=False)
    try:
        await first.enqueue_rollout(1)
        await second.enqueue_rollout(2)
        assert first._worker is second._worker  # one worker per process and database
        home = first._worker._home
        await first.close()
        assert second._worker._home is home and not second._worker.closed
        assert await _unit_thread(second) == threading.get_ident()
    finally:
        await first.close()
        await second.close()


async def test_closing_from_another_thread_disposes_of_the_home_engine_on_its_loop(backend: Any, clock: Any) -> None:
    """The last ``close()`` from another loop: the home loop (running, here awaiting the thread)
    closes its own connections."""
    store = backend.open(run="close-elsewhere", clock=clock, clock_sync=False)
    await store.enqueue_rollout(1)
    await _unit_thread(store)
    worker = store._worker
    records = list(worker._home.opened)
    assert records and not any(_closed(r) for r in records)
    thread = threading.Thread(target=lambda: asyncio.run(store.close()))
    thread.start()
    await asyncio.to_thread(thread.join, 60)
    assert worker.closed and worker._home is None
    assert all(_closed(r) for r in records)
