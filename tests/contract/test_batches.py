"""Batched execution (docs/architecture.md §7): concurrent calls of one operation share a statement,
and each caller still gets exactly its own result or its own error.

The statements a store runs are counted through its statement log (``lightning_sql.sql`` at
DEBUG), so these tests see batching happen without looking inside the executor.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore
from tests.conftest import MULTIPROCESS_BACKENDS, BackendSpec
from tests.contract.test_spans import make_span

BACKENDS = pytest.mark.parametrize("backend", ["sqlite_file", "sqlite_memory", "postgres"], indirect=True)
CALLERS = 64


@contextmanager
def statement_log() -> Iterator[list[tuple[str, Any]]]:
    """Every statement the stores' batches run meanwhile, with its parameters."""
    seen: list[tuple[str, Any]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.args)  # type: ignore[arg-type]

    log = logging.getLogger("lightning_sql.sql")
    handler, level = Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


async def outcomes(calls: list[Any]) -> list[Any]:
    """Each call's result, or its exception object, all started at once."""
    return await asyncio.gather(*calls, return_exceptions=True)


@BACKENDS
async def test_64_concurrent_callers_each_get_their_own_outcome(store: SqlLightningStore, backend: BackendSpec) -> None:
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(CALLERS)])
    rids = {r.rollout_id for r in rollouts}

    # Claims: 64 callers over 48 queued rollouts (16 left for later) and 16 more than the queue holds.
    for r in rollouts[48:]:
        await store.update_rollout(r.rollout_id, status="cancelled")
    with statement_log() as log:
        claims = await outcomes([store.dequeue_rollout(worker_id=f"w{i}") for i in range(CALLERS)])
    claimed = [c for c in claims if c is not None]
    assert len(claimed) == 48 and sum(c is None for c in claims) == 16
    assert len({c.rollout_id for c in claimed}) == 48 and {c.rollout_id for c in claimed} <= rids
    # One statement (PostgreSQL) or a few (SQLite) per batch: fewer than one per caller.
    assert 0 < len(log) < CALLERS, len(log)
    for i, c in enumerate(claims):
        worker = await store.get_worker_by_id(f"w{i}")
        assert worker is not None
        if c is None:
            assert worker.status == "idle"
        else:
            assert (worker.status, worker.current_rollout_id, worker.current_attempt_id) == (
                "busy",
                c.rollout_id,
                c.attempt.attempt_id,
            )

    pairs = [(c.rollout_id, c.attempt.attempt_id) for c in claimed]
    # Sequence ids: every fourth caller names a rollout that does not exist.
    calls = []
    for i in range(CALLERS):
        rid, aid = pairs[i % len(pairs)]
        calls.append(store.get_many_span_sequence_ids([("ro-missing", aid)] if i % 4 == 3 else [(rid, aid)] * 2))
    reserved = await outcomes(calls)
    by_rollout: dict[str, list[int]] = {}
    for i, got in enumerate(reserved):
        if i % 4 == 3:
            assert isinstance(got, ValueError) and "Rollout ro-missing not found" in str(got)
            continue
        assert isinstance(got, list) and len(got) == 2 and got[1] == got[0] + 1
        by_rollout.setdefault(pairs[i % len(pairs)][0], []).extend(got)
    for values in by_rollout.values():  # no value handed out twice, none skipped
        assert sorted(values) == list(range(1, len(values) + 1))

    # Spans: every fifth caller names an attempt that does not exist, every seventh repeats a span id.
    calls, expected = [], []
    for i in range(CALLERS):
        rid, aid = pairs[i % len(pairs)]
        if i % 5 == 4:
            calls.append(store.add_many_spans([make_span(rid, "at-missing", 1)]))
            expected.append("missing")
        elif i % 7 == 6:
            calls.append(store.add_many_spans([make_span(rid, aid, 1, span_id=f"dup{i}")] * 2))
            expected.append("dup")
        else:
            calls.append(store.add_many_spans([make_span(rid, aid, 1, span_id=f"s{i}-{k}") for k in range(3)]))
            expected.append("ok")
    added = await outcomes(calls)
    for got, kind in zip(added, expected, strict=True):
        if kind == "missing":
            assert isinstance(got, ValueError) and "Attempt at-missing not found" in str(got)
        elif kind == "dup":
            assert isinstance(got, list) and len(got) == 1
        else:
            assert isinstance(got, list) and len(got) == 3
    stored = 0
    for rid, aid in pairs:
        stored += len(await store.query_spans(rid, aid))
    assert stored == sum({"ok": 3, "dup": 1, "missing": 0}[kind] for kind in expected)

    # Attempt updates: a third finish their attempt, some name unknown rollouts or attempts.
    calls = []
    for i, (rid, aid) in enumerate(pairs):
        if i % 6 == 5:
            calls.append(store.update_attempt("ro-missing", "latest", status="succeeded"))
        elif i % 6 == 4:
            calls.append(store.update_attempt(rid, "at-missing", status="succeeded"))
        else:
            calls.append(store.update_attempt(rid, aid, status="succeeded" if i % 3 == 0 else "running"))
    updated = await outcomes(calls)
    for i, ((rid, aid), got) in enumerate(zip(pairs, updated, strict=True)):
        rollout = await store.get_rollout_by_id(rid)
        assert rollout is not None
        if i % 6 == 5:
            assert isinstance(got, ValueError) and "Rollout ro-missing not found" in str(got)
        elif i % 6 == 4:
            assert isinstance(got, ValueError) and f"Attempt at-missing not found for rollout {rid}" in str(got)
        else:
            status = "succeeded" if i % 3 == 0 else "running"
            assert got.attempt_id == aid and got.status == status
            assert rollout.status == status

    # Reads by id: every caller its own rollout, and unknown ids read nothing.
    reads = await outcomes([store.get_rollout_by_id(rid) for rid, _aid in pairs] + [store.get_rollout_by_id("ro-x")])
    assert [r.rollout_id for r in reads[:-1]] == [rid for rid, _aid in pairs] and reads[-1] is None
    traces = await outcomes([store.query_spans(rid, "latest") for rid, _aid in pairs])
    assert sum(len(t) for t in traces) == stored


@BACKENDS
async def test_a_call_that_fails_its_statement_fails_alone(store: SqlLightningStore) -> None:
    """A call whose values the database refuses makes its batch's statement fail: the batch runs its
    calls one by one, and only that caller gets the error."""
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(8)])
    claimed = await store.dequeue_many_rollouts(limit=8, worker_id="w")
    good = [make_span(ar.rollout_id, ar.attempt.attempt_id, 1) for ar in claimed]
    # Past BIGINT: the model refuses it, but a copy skips validation and the database refuses it.
    bad = make_span(claimed[0].rollout_id, claimed[0].attempt.attempt_id, 2).model_copy(update={"sequence_id": 2**63})
    got = await outcomes([store.add_span(span) for span in good] + [store.add_span(bad)])
    assert all(g is span for g, span in zip(got, good, strict=False))
    assert isinstance(got[-1], Exception)
    total = 0
    for r in rollouts:
        total += len(await store.query_spans(r.rollout_id))
    assert total == 8


@pytest.mark.parametrize("backend", MULTIPROCESS_BACKENDS, indirect=True)
async def test_a_batch_replayed_after_a_transient_error_gives_the_same_answers(
    backend: BackendSpec, store_factory: Any
) -> None:
    """Another connection holds what the batch needs (SQLite: the write lock; PostgreSQL: the rows,
    with a short lock timeout on the store's connections): the first try fails transiently, the
    replay succeeds, and every caller gets what it would have got without the outage."""
    if backend.is_postgres:
        store = store_factory(connect_args={"server_settings": {"lock_timeout": "50ms"}})
    else:
        store = store_factory(busy_timeout=0.05)
    rollouts = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(6)])
    claimed = await store.dequeue_many_rollouts(limit=6, worker_id="w")
    release = threading.Event()
    held = threading.Event()

    async def hold_pg() -> None:
        import asyncpg

        conn = await asyncpg.connect(backend.url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            async with conn.transaction():
                await conn.execute(
                    f'SELECT 1 FROM "{backend.schema}".rollouts WHERE rollout_id = ANY($1::text[]) FOR UPDATE',
                    [r.rollout_id for r in rollouts],
                )
                held.set()
                await asyncio.to_thread(release.wait, 10)
        finally:
            await conn.close()

    def hold_sqlite() -> None:
        path = backend.url.removeprefix("sqlite:///")
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(10)
        conn.execute("ROLLBACK")
        conn.close()

    holder = asyncio.ensure_future(hold_pg() if backend.is_postgres else asyncio.to_thread(hold_sqlite))
    assert await asyncio.to_thread(held.wait, 10)
    calls = asyncio.gather(
        *(store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded") for ar in claimed)
    )
    await asyncio.sleep(0.3)  # the first tries fail while the lock is held
    assert not calls.done()
    release.set()
    got = await calls
    await holder
    assert [a.attempt_id for a in got] == [ar.attempt.attempt_id for ar in claimed]
    assert all(a.status == "succeeded" for a in got)
    assert {r.status for r in await store.query_rollouts()} == {"succeeded"}


def test_the_sqlite_span_insert_takes_its_values_row_by_row_in_column_order() -> None:
    """``sqlite_batches.add_spans`` binds the multi-row INSERT's values as one list in that order."""
    from lightning_sql.store.sql import sqlite_batches
    from lightning_sql.store.sql.statements import compiled

    names = ("run_id", *sqlite_batches._SPAN_VALUE_COLUMNS)
    for rows in (1, 7):
        stmt = compiled("sqlite", None, ("test_span_insert", rows), lambda rows=rows: sqlite_batches._span_insert(rows))
        assert stmt.names == tuple(f"{name}_{i}" for i in range(rows) for name in names)
