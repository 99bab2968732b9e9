"""Group commit on the SQLite writer thread (docs/architecture.md §7).

Units that wait in the SQLite I/O thread's queue run together in one transaction, each in its own
savepoint: a unit that raises is rolled back alone and gets its own exception; a transient error or a
failed COMMIT rolls the group back and replays its units one by one.  To make a group happen on
purpose, the tests keep the I/O thread busy on one unit while the others queue up behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from lightning_sql import Attempt, Rollout, Span
from lightning_sql.store.sql import sqlite_executor as engine
from lightning_sql.store.sql.executor import SchemaUnit, UnitContext
from lightning_sql.store.sql.sqlite_executor import SqliteExecutor as SqliteThreadWorker
from tests.contract.test_spans import make_span

SQLITE_THREAD = pytest.mark.parametrize("backend", ["sqlite_file", "sqlite_memory"], indirect=True)


@pytest.fixture(autouse=True)
def _grouping_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "SQLITE_GROUP_COMMIT_MAX", 64)


@contextmanager
def held(worker: SqliteThreadWorker) -> Iterator[None]:
    """Keep the writer thread inside one unit; what is submitted meanwhile queues up behind it.  The
    unit ends its transaction first, so that it holds no lock while it waits."""
    started, release = threading.Event(), threading.Event()

    def blocker(ctx: UnitContext) -> None:
        ctx.conn.rollback()
        started.set()
        release.wait(30)

    fut = worker.submit(blocker, write=True, deadline_s=30)
    assert started.wait(10)
    try:
        yield
    finally:
        release.set()
        fut.result(10)


async def queued(worker: SqliteThreadWorker, n: int) -> None:
    deadline = time.monotonic() + 10
    while worker._queue.qsize() < n:
        assert time.monotonic() < deadline, f"{worker._queue.qsize()} of {n} units queued"
        await asyncio.sleep(0.005)


def counters(worker: SqliteThreadWorker) -> tuple[int, int, int]:
    return worker.group_commits, worker.grouped_units, worker.group_replays


async def settle(futs: list[concurrent.futures.Future[Any]]) -> list[Any]:
    """Each future's result, or its exception object."""
    out: list[Any] = []
    for fut in futs:
        try:
            out.append(await asyncio.wrap_future(fut))
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)
    return out


async def probe_worker(
    store: Any, ddl: tuple[str, ...] = ("CREATE TEMP TABLE gc_probe (k INTEGER PRIMARY KEY)",)
) -> SqliteThreadWorker:
    """The store's SQLite I/O thread, with temp tables on its connection for the units to write."""
    await store.statistics()
    worker = store._worker
    assert isinstance(worker, SqliteThreadWorker)

    def create(ctx: UnitContext) -> None:
        for statement in ddl:
            ctx.conn.exec_driver_sql(statement)

    await asyncio.wrap_future(worker.submit(create, write=True, deadline_s=10))
    return worker


async def probe_keys(worker: SqliteThreadWorker, table: str = "gc_probe") -> list[int]:
    sql = {
        "gc_probe": "SELECT k FROM gc_probe ORDER BY k",
        "gc_parent": "SELECT k FROM gc_parent ORDER BY k",
    }[table]
    # On the writer connection, whose temp tables they are (reads of a file run on reader connections).
    fut = worker.submit(lambda ctx: [r[0] for r in ctx.conn.exec_driver_sql(sql)], write=True, deadline_s=10)
    return await asyncio.wrap_future(fut)


def insert(k: int) -> Callable[[UnitContext], None]:
    def unit(ctx: UnitContext) -> None:
        ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (?)", (k,))

    return unit


# --- through the public API: every backend --------------------------------------------------------


async def test_concurrent_calls_with_failures_in_the_middle(backend, store_factory):
    """50 concurrent span/attempt/enqueue calls, 15 of them for unknown ids: the bad ones get their
    own error and change nothing, the good ones are all stored (one group on the SQLite thread)."""
    store = store_factory(scan_debounce_seconds=3600)
    started = [await store.start_rollout({"s": i}) for i in range(6)]
    ids = [(ar.rollout_id, ar.attempt.attempt_id) for ar in started]
    rid0, aid0 = ids[0]

    calls: list[tuple[str, Callable[[], Any], Any]] = []  # (kind, call, expected error or None)
    for i in range(20):
        rid, aid = ids[i % 6]
        calls.append(
            ("span", lambda rid=rid, aid=aid, i=i: store.add_span(make_span(rid, aid, 1 + i // 6)), None)
        )
    for j in range(10):
        calls.append(("enqueue", lambda j=j: store.enqueue_rollout({"n": j}), None))
    for i in range(1, 6):
        rid, aid = ids[i]
        calls.append(
            ("attempt", lambda rid=rid, aid=aid, i=i: store.update_attempt(rid, aid, metadata={"m": i}), None)
        )
    for j in range(5):
        calls.append(
            (
                "bad",
                lambda j=j: store.add_span(make_span(f"ro-missing-{j}", aid0, 1)),
                f"Rollout ro-missing-{j} not found",
            )
        )
        calls.append(
            (
                "bad",
                lambda j=j: store.update_attempt(f"ro-gone-{j}", "at-x", status="running"),
                f"Rollout ro-gone-{j} not found",
            )
        )
        calls.append(
            (
                "bad",
                lambda j=j: store.add_span(make_span(rid0, f"at-missing-{j}", 100 + j)),
                f"Attempt at-missing-{j} not found for rollout {rid0}",
            )
        )
    random.Random(7).shuffle(calls)
    assert len(calls) == 50

    worker = store._worker
    grouping = isinstance(worker, SqliteThreadWorker)
    if grouping:
        before = counters(worker)
        with held(worker):
            tasks = [asyncio.ensure_future(call()) for _, call, _ in calls]
            await queued(worker, 50)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        commits, units, replays = (a - b for a, b in zip(counters(worker), before, strict=True))
        assert (commits, units, replays) == (1, 50, 0)  # one group carried all 50 calls
    else:
        results = await asyncio.gather(*(call() for _, call, _ in calls), return_exceptions=True)

    enqueued: list[str] = []
    for (kind, _, error), result in zip(calls, results, strict=True):
        if kind == "bad":
            assert type(result) is ValueError and str(result) == error
        elif kind == "span":
            assert isinstance(result, Span)
        elif kind == "enqueue":
            assert isinstance(result, Rollout) and result.status == "queuing"
            enqueued.append(result.rollout_id)
        else:
            assert isinstance(result, Attempt) and result.metadata == {"m": int(result.metadata["m"])}

    stats = await store.statistics()
    assert stats["total_spans"] == 20
    assert stats["total_rollouts"] == 6 + 10 and stats["queue_depth"] == 10
    assert sorted(r.rollout_id for r in await store.query_rollouts(status_in=["queuing"])) == sorted(enqueued)
    for i, (rid, aid) in enumerate(ids):
        seqs = sorted(s.sequence_id for s in await store.query_spans(rid))
        expected = sorted(1 + k // 6 for k in range(20) if k % 6 == i)
        assert seqs == expected
        # The failed spans of rid0 (sequence ids 100+) moved no counter.
        assert await store.get_next_span_sequence_id(rid, aid) == max(expected) + 1
        attempt = (await store.query_attempts(rid))[-1]
        assert attempt.metadata == ({"m": i} if i else None)
        assert attempt.status == "running"  # the spans promoted it; the failed updates did not touch it


# --- the SQLite I/O thread itself --------------------------------------------------------------------


@SQLITE_THREAD
async def test_a_failing_unit_is_rolled_back_alone(store):
    worker = await probe_worker(store)
    errors = {i: ValueError(f"bad {i}") for i in (3, 11, 17, 29)}
    order: list[int] = []

    def unit(i: int) -> Callable[[UnitContext], int]:
        def run(ctx: UnitContext) -> int:
            order.append(i)
            ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (?)", (i,))
            if i in errors:
                raise errors[i]  # after its write: the savepoint takes the write back
            if i == 20:  # a driver error after a write: a duplicate key
                ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (1000)")
                ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (1000)")
            return i

        return run

    before = counters(worker)
    with held(worker):
        futs = [worker.submit(unit(i), write=True, deadline_s=10) for i in range(30)]
        await queued(worker, 30)
    results = await settle(futs)
    assert order == list(range(30))  # queue order, each unit once
    for i, result in enumerate(results):
        if i in errors:
            assert result is errors[i]  # the very exception object the unit raised
        elif i == 20:
            assert isinstance(result, IntegrityError) and "UNIQUE" in str(result)
        else:
            assert result == i
    good = [i for i in range(30) if i not in errors and i != 20]
    assert await probe_keys(worker) == good
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (1, 30, 0)


@SQLITE_THREAD
async def test_a_transient_error_replays_the_group_one_by_one(store):
    worker = await probe_worker(store)
    seen: list[tuple[int, int]] = []
    failed = threading.Event()

    def unit(i: int) -> Callable[[UnitContext], int]:
        def run(ctx: UnitContext) -> int:
            seen.append((i, ctx.attempt))
            ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (?)", (i,))
            if i == 4 and not failed.is_set():
                failed.set()
                raise sqlite3.OperationalError("database is locked")
            return i

        return run

    before = counters(worker)
    with held(worker):
        futs = [worker.submit(unit(i), write=True, deadline_s=10) for i in range(10)]
        await queued(worker, 10)
    assert await settle(futs) == list(range(10))
    # The group ran up to the transient error, was rolled back, and every unit ran again alone (a
    # unit that wrote twice would have hit the primary key).
    assert seen == [(i, 0) for i in range(5)] + [(i, 0) for i in range(10)]
    assert await probe_keys(worker) == list(range(10))
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (0, 0, 1)


# A deferred foreign key is checked at COMMIT: a unit that violates it fails the COMMIT, not itself.
_DEFERRED_FK_TABLES = (
    "CREATE TEMP TABLE gc_parent (k INTEGER PRIMARY KEY)",
    "CREATE TEMP TABLE gc_child (p INTEGER REFERENCES gc_parent (k) DEFERRABLE INITIALLY DEFERRED)",
)


@SQLITE_THREAD
async def test_a_failed_commit_replays_the_group_one_by_one(store):
    # A deferred foreign key is checked at COMMIT: one unit's violation fails the shared commit.
    worker = await probe_worker(store, _DEFERRED_FK_TABLES)
    seen: list[tuple[int, int]] = []

    def unit(i: int) -> Callable[[UnitContext], int]:
        def run(ctx: UnitContext) -> int:
            seen.append((i, ctx.attempt))
            if i == 5:
                ctx.conn.exec_driver_sql("INSERT INTO gc_child (p) VALUES (999)")
            else:
                ctx.conn.exec_driver_sql("INSERT INTO gc_parent (k) VALUES (?)", (i,))
            return i

        return run

    before = counters(worker)
    with held(worker):
        futs = [worker.submit(unit(i), write=True, deadline_s=10) for i in range(8)]
        await queued(worker, 8)
    results = await settle(futs)
    assert isinstance(results[5], IntegrityError) and "FOREIGN KEY" in str(results[5])
    assert results[:5] + results[6:] == [0, 1, 2, 3, 4, 6, 7]
    # Replays after a failed commit look for their own earlier writes (attempt 1), like a unit that
    # came alone; the unit after the failing one found a usable connection.
    assert seen == [(i, 0) for i in range(8)] + [(i, 1) for i in range(8)]
    assert await probe_keys(worker, "gc_parent") == [0, 1, 2, 3, 4, 6, 7]
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (0, 0, 1)


@SQLITE_THREAD
async def test_a_failed_commit_of_a_lone_unit_leaves_a_usable_connection(store):
    worker = await probe_worker(store, _DEFERRED_FK_TABLES)

    def bad(ctx: UnitContext) -> None:
        ctx.conn.exec_driver_sql("INSERT INTO gc_child (p) VALUES (999)")

    def good(ctx: UnitContext) -> None:
        ctx.conn.exec_driver_sql("INSERT INTO gc_parent (k) VALUES (1)")

    with pytest.raises(IntegrityError, match="FOREIGN KEY"):
        await asyncio.wrap_future(worker.submit(bad, write=True, deadline_s=10))
    await asyncio.wrap_future(worker.submit(good, write=True, deadline_s=10))
    assert await probe_keys(worker, "gc_parent") == [1]


@pytest.mark.parametrize("backend", ["sqlite_file"], indirect=True)
async def test_a_group_waits_out_another_process_write_lock(backend, store_factory):
    store = store_factory(busy_timeout=0.1)
    worker = await probe_worker(store)
    path = backend.url.split("///", 1)[1]
    other = sqlite3.connect(path, isolation_level=None)
    try:
        before = counters(worker)
        with held(worker):
            other.execute("BEGIN IMMEDIATE")  # another writer holds the database's write lock
            futs = [worker.submit(insert(i), write=True, deadline_s=30) for i in range(6)]
            await queued(worker, 6)
        await asyncio.sleep(0.5)
        assert not any(f.done() for f in futs)
        other.execute("ROLLBACK")
        assert await settle(futs) == [None] * 6
    finally:
        other.close()
    assert await probe_keys(worker) == list(range(6))
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (0, 0, 1)


@SQLITE_THREAD
async def test_units_cancelled_before_they_start_never_run(store):
    worker = await probe_worker(store)
    before = counters(worker)
    with held(worker):
        futs = [worker.submit(insert(i), write=True, deadline_s=10) for i in range(6)]
        await queued(worker, 6)
        assert futs[1].cancel() and futs[4].cancel()
    await asyncio.sleep(0)
    for i in (0, 2, 3, 5):
        assert futs[i].result(10) is None
    assert await probe_keys(worker) == [0, 2, 3, 5]
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (1, 4, 0)


@SQLITE_THREAD
async def test_group_size_cap_and_schema_units_run_alone(store, monkeypatch):
    monkeypatch.setattr(engine, "SQLITE_GROUP_COMMIT_MAX", 4)
    worker = await probe_worker(store)
    before = counters(worker)
    with held(worker):
        futs = [worker.submit(insert(i), write=True, deadline_s=10) for i in range(10)]
        futs.append(worker.submit(SchemaUnit(True, False), write=True, deadline_s=10))
        futs += [worker.submit(insert(i), write=True, deadline_s=10) for i in range(10, 13)]
        await queued(worker, 14)
    assert await settle(futs) == [None] * 14
    assert await probe_keys(worker) == list(range(13))
    # Groups of 4, 4 and 2; the schema unit alone; then a group of 3.
    assert tuple(a - b for a, b in zip(counters(worker), before, strict=True)) == (4, 13, 0)


@SQLITE_THREAD
async def test_grouping_off_runs_one_transaction_per_unit(store, monkeypatch):
    monkeypatch.setattr(engine, "SQLITE_GROUP_COMMIT_MAX", 1)
    worker = await probe_worker(store)
    errors = {2: ValueError("bad 2")}

    def unit(i: int) -> Callable[[UnitContext], int]:
        def run(ctx: UnitContext) -> int:
            ctx.conn.exec_driver_sql("INSERT INTO gc_probe (k) VALUES (?)", (i,))
            if i in errors:
                raise errors[i]
            return i

        return run

    before = counters(worker)
    with held(worker):
        futs = [worker.submit(unit(i), write=True, deadline_s=10) for i in range(5)]
        await queued(worker, 5)
    assert await settle(futs) == [0, 1, errors[2], 3, 4]
    assert await probe_keys(worker) == [0, 1, 3, 4]
    assert counters(worker) == before
