"""The SQLite executor's reads, and models rebuilt from rows.

Reads of a SQLite file run in the calling thread on that thread's reader connection (WAL readers
never wait for the writer); a read that meets a lock is handed to the writer thread; an in-memory
database reads on its one connection, in the writer thread.  Rows become models through pydantic's
``model_construct``: what a caller reads back is what it stored.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select
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


def _worker(store: SqlLightningStore) -> Any:
    worker = store._worker
    assert worker is not None
    return worker


async def _thread_of_read(store: SqlLightningStore) -> str:
    worker, _run_id = await store._prepare()
    return await store._submit(worker, lambda ctx: threading.current_thread().name, write=False)


async def test_file_reads_run_in_the_calling_thread_memory_reads_in_the_writer_thread(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    memory = SqlLightningStore("sqlite://", run="r", clock_sync=False)
    try:
        assert await _thread_of_read(store) == threading.current_thread().name
        assert (await _thread_of_read(memory)).startswith("lightning-sql-sqlite")
        for each in (store, memory):  # the same answers either way
            ids = await _with_spans(each, 2)
            assert [sp.sequence_id for sp in await each.query_spans(ids[0], "latest")] == [1, 2]
    finally:
        await store.close()
        await memory.close()


class _Neighbour:
    """Another task of the running loop, counting its turns."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._task.cancel()


async def test_a_read_in_the_calling_thread_still_lets_the_loops_other_tasks_run(tmp_path: Path) -> None:
    """A loop polling with reads does not starve its neighbours: each read is a suspension point."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 1)
        neighbour = _Neighbour()
        for _ in range(20):
            await store.query_rollouts()
        assert neighbour.ticks >= 19
        neighbour.stop()
    finally:
        await store.close()


async def test_a_read_unit_cannot_write(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        worker, run_id = await store._prepare()

        def sneaky(ctx: Any) -> None:
            ctx.conn.execute(insert(s.workers).values(run_id=run_id, worker_id="sneaky", status="idle"))

        with pytest.raises(DBAPIError, match="readonly"):
            await store._submit(worker, sneaky, write=False)
        assert len(await store.query_workers()) == 0
    finally:
        await store.close()


async def test_a_read_that_meets_a_lock_goes_to_the_writer_thread(tmp_path: Path) -> None:
    """A reader has no busy timeout: a lock sends the unit to the writer thread (which waits and
    retries) instead of blocking the caller's loop.  An error of the unit itself is raised at once."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 2)
        worker, _run_id = await store._prepare()
        threads: list[str] = []

        def locked_here(ctx: Any) -> int:
            threads.append(threading.current_thread().name)
            if threading.current_thread() is threading.main_thread():
                raise sqlite3.OperationalError("database is locked")
            return int(ctx.execute(select(func.count()).select_from(s.rollouts)).scalar_one())

        assert await store._submit(worker, locked_here, write=False) == 2
        assert threads[0] == "MainThread" and threads[1].startswith("lightning-sql-sqlite")

        def bad(ctx: Any) -> None:
            threads.append(threading.current_thread().name)
            raise KeyError("the unit's own error")

        threads.clear()
        with pytest.raises(KeyError):
            await store._submit(worker, bad, write=False)
        assert threads == ["MainThread"]
        # The reader connection is usable after both failures (rolled back, not left in a transaction).
        assert len(await store.query_rollouts()) == 2
    finally:
        await store.close()


async def test_close_closes_every_connection(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())  # a reader in another thread too
    worker = _worker(store)
    await store.close()
    assert worker.closed
    worker._thread.join(5)
    # Every connection to the file is closed: an exclusive lock is possible at once, and SQLite
    # removed its WAL and shared-memory files with the last connection.
    locker = sqlite3.connect(tmp_path / "s.db", isolation_level=None, timeout=0)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    locker.rollback()
    locker.close()
    assert not (tmp_path / "s.db-wal").exists() and not (tmp_path / "s.db-shm").exists()


async def test_the_readers_of_threads_that_ended_are_closed(tmp_path: Path) -> None:
    """A caller that reads from a new thread each time does not pile up reader connections."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 1)
        await store.query_rollouts()
        worker = _worker(store)
        ended: list[Any] = []
        for _ in range(5):
            thread = threading.Thread(target=asyncio.run, args=(store.query_rollouts(),))
            thread.start()
            thread.join()
            ended.append(thread)
        assert [slot[0] for slot in worker._reader_slots] == [threading.main_thread(), ended[-1]]
        assert len(await store.query_rollouts()) == 1
    finally:
        await store.close()


async def test_a_closed_store_leaves_no_executor_behind(backend: Any) -> None:
    """Closing releases everything the store opened: once the caller drops the store, its executor,
    engines and connections are garbage."""
    store = backend.open(run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())
    worker = _worker(store)
    gone, thread = weakref.ref(worker), worker._thread
    del worker
    await store.close()
    del store
    thread.join(10)
    assert not thread.is_alive()
    gc.collect()
    assert gone() is None


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
