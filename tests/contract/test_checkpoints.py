"""ADR 0005 decision 9: on a SQLite file, WAL checkpoints run on the worker's checkpointer thread
(PASSIVE, at most every ``SQLITE_CHECKPOINT_INTERVAL_S`` while writes go on), not inside the
COMMIT of a caller's write; the committing connection checkpoints by itself only past a backstop."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from typing import Any

import pytest

from lightning_sql.store.sql import engine

pytestmark = pytest.mark.parametrize("backend", ["sqlite_file"], indirect=True)

PAYLOAD = {"blob": "x" * 4000}  # a page or more per rollout: the WAL grows quickly


async def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _db_path(store: Any) -> str:
    return store._worker.target.path


async def test_writes_are_checkpointed_by_the_checkpointer_thread(store: Any) -> None:
    await store.enqueue_rollout(PAYLOAD)
    worker = store._worker
    path = _db_path(store)
    assert worker.background_checkpoints
    await _wait_for(lambda: worker.checkpoints >= 1)  # the first commits asked for one
    size_before = os.path.getsize(path)
    done = worker.checkpoints
    for i in range(100):
        await store.enqueue_rollout({**PAYLOAD, "i": i})
    # A database file in WAL mode grows only when a checkpoint copies pages into it.
    await _wait_for(lambda: worker.checkpoints > done and os.path.getsize(path) > size_before + 200_000)
    names = {t.name for t in threading.enumerate()}
    assert any(name.startswith("lightning-sql-checkpoint[") for name in names), names
    backstop = await store._call(
        "test", lambda ctx, _run_id, _now: ctx.conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar(), write=True
    )
    assert backstop == engine.SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES
    assert (await store.query_rollouts(limit=0)).total == 101


async def test_a_reader_keeps_its_snapshot_and_writers_go_on_during_checkpoints(store: Any) -> None:
    await store.enqueue_rollout(PAYLOAD)
    worker = store._worker
    reader = sqlite3.connect(_db_path(store), isolation_level=None)
    try:
        reader.execute("BEGIN")
        seen = reader.execute("SELECT count(*) FROM rollouts").fetchone()[0]
        done = worker.checkpoints
        for i in range(60):  # every write commits although the reader pins the WAL
            await store.enqueue_rollout({**PAYLOAD, "i": i})
        await _wait_for(lambda: worker.checkpoints > done)
        assert reader.execute("SELECT count(*) FROM rollouts").fetchone()[0] == seen  # its snapshot
        reader.execute("COMMIT")
        assert reader.execute("SELECT count(*) FROM rollouts").fetchone()[0] == seen + 60
    finally:
        reader.close()


async def test_a_fork_in_progress_skips_the_checkpoint(store: Any) -> None:
    await store.enqueue_rollout(PAYLOAD)
    worker = store._worker
    await _wait_for(lambda: worker.checkpoints >= 1)
    assert worker.read_gate.close(5)  # what _quiesce_before_fork does: nobody enters SQLite
    done = worker.checkpoints  # none under way (close waited for it), none can start
    try:
        await store.enqueue_rollout(PAYLOAD)  # asks for a checkpoint
        await asyncio.sleep(engine.SQLITE_CHECKPOINT_INTERVAL_S * 4)
        assert worker.checkpoints == done
    finally:
        worker.read_gate.open()
    await store.enqueue_rollout(PAYLOAD)
    await _wait_for(lambda: worker.checkpoints > done)


async def test_switched_off_sqlite_checkpoints_by_itself(backend: Any, clock: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(engine, "SQLITE_BACKGROUND_CHECKPOINTS", False)  # LIGHTNING_SQL_SQLITE_BACKGROUND_CHECKPOINT=0
    store = backend.open(run="off", clock=clock, clock_sync=False)
    try:
        for i in range(5):
            await store.enqueue_rollout({**PAYLOAD, "i": i})
        worker = store._worker
        assert not worker.background_checkpoints and worker._checkpointer is None and worker.checkpoints == 0
        pages = await store._call(
            "test", lambda ctx, _run_id, _now: ctx.conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar(), write=True
        )
        assert pages == 1000  # SQLite's default
    finally:
        await store.close()


async def test_closing_the_store_ends_the_checkpointer(backend: Any, clock: Any) -> None:
    store = backend.open(run="close", clock=clock, clock_sync=False)
    await store.enqueue_rollout(PAYLOAD)
    worker = store._worker
    await _wait_for(lambda: worker._checkpointer is not None)
    thread = worker._checkpointer
    await store.close()
    await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive()
