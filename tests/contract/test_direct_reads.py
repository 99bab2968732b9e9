"""ADR 0005 decision 14: on PostgreSQL a read of one prebuilt statement (``query_spans`` without
pagination) runs on the home loop as a coroutine, on a connection the home engine keeps for it: no
greenlet, no pool checkout. Whatever keeps it from running so (another read holds the connection,
the connection is lost, any error) sends the call through its unit, whose outcome is the call's.
These tests pin down that the kept connection is used, gives what the unit gives, survives a lost
connection and a cancelled caller (which ends it, as it may be mid-protocol), and is closed with
the store. (The whole contract suite's span
queries run on the home loop, through it.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from lightning_sql.store.sql import spans as span_units
from tests.conftest import PG_URL
from tests.contract.test_spans import make_span
from tests.helpers import pg_execute, pg_fetch

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


@pytest.fixture
async def store(store_factory: Callable[..., Any]) -> Any:
    """The contract suite's store without lazy sweeps: a sweep is a write unit, with a checkout of
    its own, that would land inside the counted calls."""
    return store_factory(scan_debounce_seconds=3600)


def _closed(record: Any) -> bool:
    conn = record.dbapi_connection
    return conn is None or conn._connection.is_closed()


def _page(result: Any) -> tuple[Any, ...]:
    return ([span.model_dump() for span in result], result.total, result.limit, result.offset)


def _count_units(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of ``query_spans``' unit (the path through a greenlet and a pool checkout)."""
    calls: list[int] = []
    unit = span_units.query_spans

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return unit(*args, **kwargs)

    monkeypatch.setattr(span_units, "query_spans", counted)
    return calls


def _count_checkouts(store: Any) -> list[int]:
    checkouts: list[int] = []
    event.listen(store._worker._home.engine.sync_engine, "checkout", lambda *_args: checkouts.append(1))
    return checkouts


def _server_pid(home: Any) -> int:
    return int(home._pinned.connection.dbapi_connection._connection.get_server_pid())


async def _rollout_with_spans(store: Any, n: int = 5) -> tuple[str, str]:
    ar = await store.start_rollout({"i": 1})
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    await store.add_many_spans([make_span(rid, aid, i, name=f"step-{i % 2}") for i in range(1, n + 1)])
    return rid, aid


async def test_a_one_statement_read_runs_on_the_kept_connection_and_gives_what_its_unit_gives(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid, aid = await _rollout_with_spans(store)
    await store.query_spans(rid)  # the home engine keeps its connection (one checkout, once)
    home = store._worker._home
    assert home is not None and home.reader is not None and home._pinned is not None
    units = _count_units(monkeypatch)
    checkouts = _count_checkouts(store)
    calls: list[dict[str, Any]] = [
        {"rollout_id": rid},
        {"rollout_id": rid, "attempt_id": "latest"},
        {"rollout_id": rid, "attempt_id": aid, "name": "step-1"},
        {"rollout_id": rid, "name_contains": "step", "sort_order": "desc"},
        {"rollout_id": rid, "attempt_id": "no-such-attempt"},
        {"rollout_id": "no-such-rollout"},
    ]
    direct = [_page(await store.query_spans(**call)) for call in calls]
    assert units == [] and checkouts == []
    reader, home.reader = home.reader, None  # as LIGHTNING_SQL_PG_DIRECT_READS=0
    try:
        via_units = [_page(await store.query_spans(**call)) for call in calls]
    finally:
        home.reader = reader
    assert len(units) == len(checkouts) == len(calls)
    assert direct == via_units
    assert [len(page[0]) for page in direct] == [5, 5, 3, 5, 0, 0]
    assert [span["sequence_id"] for span in direct[3][0]] == [5, 4, 3, 2, 1]


async def test_a_paginated_read_runs_its_unit(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rid, _aid = await _rollout_with_spans(store)
    await store.query_spans(rid)
    units = _count_units(monkeypatch)
    page = await store.query_spans(rid, limit=2, offset=1)
    assert [span.sequence_id for span in page] == [2, 3] and page.total == 5
    assert units == [1]


async def test_a_lost_kept_connection_sends_the_read_through_its_unit_and_is_replaced(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rid, _aid = await _rollout_with_spans(store)
    expected = _page(await store.query_spans(rid))
    home = store._worker._home
    pid = _server_pid(home)
    await pg_execute(PG_URL, f"SELECT pg_terminate_backend({pid})")
    deadline = time.monotonic() + 30
    while await pg_fetch(PG_URL, "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid):
        assert time.monotonic() < deadline, "the terminated backend did not go away"
        await asyncio.sleep(0.05)
    units = _count_units(monkeypatch)
    assert _page(await store.query_spans(rid)) == expected
    assert units == [1] and home._pinned is None  # given up; the unit answered
    assert _page(await store.query_spans(rid)) == expected
    assert units == [1] and _server_pid(home) != pid  # a new one kept


async def _gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while await pg_fetch(PG_URL, "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid):
        assert time.monotonic() < deadline, f"backend {pid} of a given-up connection is still there"
        await asyncio.sleep(0.05)


async def test_a_read_cancelled_in_its_statement_gives_up_the_kept_connection(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read runs in the caller's task: a cancellation that lands before the statement changes
    nothing, one that lands in it ends the kept connection (it may be mid-protocol; its backend
    goes away), and the next read keeps another.  No read runs its unit."""
    rid, _aid = await _rollout_with_spans(store)
    expected = _page(await store.query_spans(rid))
    home = store._worker._home
    reader_pool = home.reader.sync_engine.pool
    units = _count_units(monkeypatch)
    outcomes: list[str] = []
    for turns in range(8):  # cancel at several points: before, during and after the statement
        pid = _server_pid(home)
        task = asyncio.ensure_future(store.query_spans(rid))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            assert _page(await task) == expected  # it finished before the cancellation landed
            outcomes.append("finished")
        except asyncio.CancelledError:
            outcomes.append("kept" if home._pinned is not None else "given up")
        assert not home._reading
        if home._pinned is None:
            await _gone(pid)
            assert reader_pool.checkedout() == 0
        else:
            assert _server_pid(home) == pid and reader_pool.checkedout() == 1
        assert _page(await store.query_spans(rid)) == expected  # kept (again)
        assert reader_pool.checkedout() == 1
    assert units == []
    assert outcomes[0] == "kept" and "given up" in outcomes, outcomes  # turn 0: before it started


async def test_a_read_cancelled_while_its_connection_opens_leaves_nothing_checked_out(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first read opens the connection to keep; a caller cancelled meanwhile lets it open and
    gives it up then, so the pool of one is free for the next read."""
    rid, _aid = await _rollout_with_spans(store)
    await store.query_spans(rid, limit=10)  # the home engine exists; nothing kept yet
    home = store._worker._home
    assert home._pinned is None
    reader_pool = home.reader.sync_engine.pool
    for turns in (1, 2, 3):
        task = asyncio.ensure_future(store.query_spans(rid))
        for _ in range(turns):
            await asyncio.sleep(0)
        assert home._pinned is None and home._reading  # still opening
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 30
        while reader_pool.checkedout():
            assert time.monotonic() < deadline, "the connection opened for a cancelled read stays checked out"
            await asyncio.sleep(0.01)
        assert home._pinned is None and not home._reading
    units = _count_units(monkeypatch)
    assert len(await store.query_spans(rid)) == 5
    assert units == [] and home._pinned is not None and reader_pool.checkedout() == 1


async def test_concurrent_reads_share_the_kept_connection_with_their_units(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One read at a time on the kept connection; the others of the moment run their units."""
    pairs = [await _rollout_with_spans(store, n) for n in range(1, 9)]
    await store.query_spans(pairs[0][0])
    units = _count_units(monkeypatch)
    pages = await asyncio.gather(*(store.query_spans(rid) for rid, _aid in pairs))
    assert [[span.sequence_id for span in page] for page in pages] == [list(range(1, n + 1)) for n in range(1, 9)]
    assert 1 <= len(units) <= 7


async def test_closing_the_store_closes_the_kept_connection(backend: Any, clock: Any) -> None:
    store = backend.open(run="close-direct", clock=clock, clock_sync=False)
    rid, _aid = await _rollout_with_spans(store)
    await store.query_spans(rid)
    home = store._worker._home
    kept = home._pinned.connection._connection_record
    records = list(home.opened)
    assert kept in records and not _closed(kept)
    await store.close()
    assert all(_closed(r) for r in records)


async def test_closing_from_another_thread_closes_the_kept_connection_on_its_loop(backend: Any, clock: Any) -> None:
    store = backend.open(run="close-direct-elsewhere", clock=clock, clock_sync=False)
    rid, _aid = await _rollout_with_spans(store)
    await store.query_spans(rid)
    worker = store._worker
    kept = worker._home._pinned.connection._connection_record
    records = list(worker._home.opened)
    thread = threading.Thread(target=lambda: asyncio.run(store.close()))
    thread.start()
    await asyncio.to_thread(thread.join, 60)
    assert worker.closed and worker._home is None
    assert kept in records and all(_closed(r) for r in records)


def test_a_closed_home_loop_ends_its_kept_connection_without_leaking_it(backend: Any, clock: Any) -> None:
    """Consecutive ``asyncio.run`` calls without ``close()`` in between: when the next loop becomes
    home, the old loop's kept connection is ended and handed back to its pool (no connection is
    left for the garbage collector to find checked out)."""
    import gc
    import warnings

    store = backend.open(run="loops-direct", clock=clock, clock_sync=False, scan_debounce_seconds=3600)
    try:
        async def written_and_read() -> str:
            rid, _aid = await _rollout_with_spans(store)
            assert len(await store.query_spans(rid)) == 5  # on the loop that is home: kept
            return rid

        rid = asyncio.run(written_and_read())
        old = store._worker._home
        kept = old._pinned.connection._connection_record
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(asyncio.run(store.query_spans(rid))) == 5  # a new loop: the old home is ended
            assert store._worker._home is not old and _closed(kept)
            gc.collect()
        leaks = [str(w.message) for w in caught if "non-checked-in connection" in str(w.message)]
        assert leaks == []
    finally:
        asyncio.run(store.close())
