"""The SQLite executor's reads, and models rebuilt from rows.

Reads of a SQLite file run on the executor's reader thread, on a ``query_only`` WAL connection of
its own (readers never wait for the writer, and a long read never holds the caller's event loop);
an in-memory database reads on its one connection, in the writer thread.  What a caller reads back
is what it stored.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.exc import DBAPIError

from lightning_sql import SqlLightningStore
from lightning_sql.store.sql import rows as rows_module
from lightning_sql.store.sql import schema as s
from lightning_sql.types import EnqueueRolloutRequest, OtelResource, SpanContext, TraceStatus
from tests.contract.test_spans import make_span


async def _with_spans(store: SqlLightningStore, n: int = 3) -> list[str]:
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])
    ids = []
    for ar in await store.dequeue_many_rollouts(limit=n, worker_id="w"):
        await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, k) for k in (1, 2)])
        ids.append(ar.rollout_id)
    return ids


def _threads_of_this_store() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning-sql-")]


async def test_file_reads_run_on_the_reader_thread_memory_reads_in_the_writer_thread(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    memory = SqlLightningStore("sqlite://", run="r", clock_sync=False)

    def thread_name(_ctx: Any) -> str:
        return threading.current_thread().name

    try:
        assert (await store.run_sql(thread_name)).startswith("lightning-sql-sqlite-read")
        assert (await store.run_sql(thread_name, write=True)).startswith("lightning-sql-sqlite[")
        assert (await memory.run_sql(thread_name)).startswith("lightning-sql-sqlite[")
        for each in (store, memory):  # the same answers either way
            ids = await _with_spans(each, 2)
            assert [sp.sequence_id for sp in await each.query_spans(ids[0], "latest")] == [1, 2]
    finally:
        await store.close()
        await memory.close()


class _Neighbour:
    """Another task of the running loop, counting its turns and the longest gap between them."""

    def __init__(self) -> None:
        self.ticks = 0
        self.longest = 0.0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now
            self.ticks += 1

    def stop(self) -> None:
        self._task.cancel()


async def test_a_long_read_does_not_hold_the_callers_loop(tmp_path: Path) -> None:
    """A read of a whole long trace runs on the reader thread: the caller's other tasks keep their
    turns meanwhile (each waits for the interpreter's switch intervals, never for the read).  The
    garbage collector is off while it reads: its full collections stop every thread, reader or not."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    gc.disable()
    try:
        ar = await store.start_rollout({"q": 1})
        spans = [make_span(ar.rollout_id, ar.attempt.attempt_id, k, attributes={"v": "x" * 200}) for k in range(6000)]
        await store.add_many_spans(spans)
        neighbour = _Neighbour()
        started = time.perf_counter()
        assert len(await store.query_spans(ar.rollout_id)) == 6000
        took = time.perf_counter() - started
        neighbour.stop()
        # The read took many times what one gap between the neighbour's turns did.
        assert neighbour.ticks > 10 and neighbour.longest < took / 4, (neighbour.ticks, neighbour.longest, took)
    finally:
        gc.enable()
        await store.close()


async def test_a_read_cannot_write(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:

        def sneaky(ctx: Any) -> None:
            ctx.conn.execute(insert(s.workers).values(run_id=ctx.run_id, worker_id="sneaky", status="idle"))

        with pytest.raises(DBAPIError, match="readonly"):
            await store.run_sql(sneaky)
        assert len(await store.query_workers()) == 0
        # The reader connection is usable after the failure (rolled back, not left in a transaction).
        assert await store.run_sql(lambda ctx: ctx.conn.execute(select(s.runs.c.name)).scalar()) == "r"
    finally:
        await store.close()


async def test_reads_never_wait_for_a_writer(tmp_path: Path) -> None:
    """WAL readers: while another connection holds the write lock with a write not committed yet,
    the store's reads answer at once, from the last commit."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 2)
        writer = sqlite3.connect(tmp_path / "s.db", isolation_level=None, timeout=10)
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE rollouts SET status = 'failed'")
        try:
            started = time.perf_counter()
            assert {r.status for r in await store.query_rollouts()} == {"running"}  # spans promoted them
            assert time.perf_counter() - started < 5  # no busy wait (the busy timeout is 30 s)
        finally:
            writer.rollback()
            writer.close()
    finally:
        await store.close()


async def test_close_closes_every_connection(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())  # a caller in another thread too
    await store.close()
    for thread in _threads_of_this_store():
        thread.join(5)
    # Every connection to the file is closed: an exclusive lock is possible at once, and SQLite
    # removed its WAL and shared-memory files with the last connection.
    locker = sqlite3.connect(tmp_path / "s.db", isolation_level=None, timeout=0)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    locker.rollback()
    locker.close()
    assert not (tmp_path / "s.db-wal").exists() and not (tmp_path / "s.db-shm").exists()


async def test_a_closed_store_leaves_no_executor_behind(backend: Any) -> None:
    """Closing releases everything the store opened: its threads end, and once the caller drops the
    store, its executor, engines and connections are garbage."""
    before = set(_threads_of_this_store())
    store = backend.open(run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())
    threads = [t for t in _threads_of_this_store() if t not in before]
    assert threads
    executor = weakref.ref(store._worker)
    await store.close()
    del store
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), thread.name
    gc.collect()
    assert executor() is None


async def test_models_read_back_do_not_share_state(store: SqlLightningStore) -> None:
    """Each model read back owns its extras: an extra field set on one span's status or context
    (their models allow extras) shows on no other span, read now or later."""
    ar = await store.start_rollout({"q": 1})
    await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, k) for k in (1, 2)])
    first, second = await store.query_spans(ar.rollout_id)
    first.status.note = "mine"  # type: ignore[attr-defined]
    first.context.note = "mine"  # type: ignore[union-attr]
    assert first.status.__pydantic_extra__ is not second.status.__pydantic_extra__
    assert not hasattr(second.status, "note") and not hasattr(second.context, "note")
    again = (await store.query_spans(ar.rollout_id))[0]
    assert not hasattr(again.status, "note") and not hasattr(again.context, "note")


def test_span_values_encode_what_model_dump_gives() -> None:
    """``span_values`` encodes sub-models from their fields' dict when it can; the stored text must
    be that of ``model_dump()`` for plain models, models with extras and subclasses alike."""
    from lightning_sql.types import encode_json

    class TaggedContext(SpanContext):
        tag: str = "t"

    rich = make_span("r", "a", 1, parent_id="00000000000000aa", extra_field={"n": [1]})
    rich.status = TraceStatus(status_code="ERROR", description="boom", code_detail=7)  # an extra field
    rich.parent = TaggedContext(trace_id=rich.trace_id, span_id="00000000000000aa", is_remote=True, trace_state={})
    rich.resource = OtelResource(attributes={"service.name": "svc"}, schema_url="u")
    bare = make_span("r", "a", 2)
    bare.context = None
    for span in (rich, bare):
        row = rows_module.span_values(span, 1)
        extra = {
            "status": span.status.model_dump(),
            "context": None if span.context is None else span.context.model_dump(),
            "parent": None if span.parent is None else span.parent.model_dump(),
            **(span.model_extra or {}),
        }
        assert str(row["extra"]) == encode_json(extra, "x")
        assert str(row["resource"]) == encode_json(span.resource.model_dump(), "x")
    assert '"code_detail":7' in str(rows_module.span_values(rich, 1)["extra"])
    assert '"tag":"t"' in str(rows_module.span_values(rich, 1)["extra"])
