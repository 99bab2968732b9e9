"""How SQLite plans a claim: it reads the head of the queue index, never the run's rollouts.

The queue is the partial index ``ix_rollouts_queue`` on ``(run_id, priority DESC, queue_seq)`` over
the claimable rollouts (docs/architecture.md §3, ADR 0002, docs/queue.md), and a claim reads its head
(and the head of the due rollouts in back-off): so its cost does not depend on the queue's length.  The test runs real claims, takes the statements they ran from the
store's statement log (``lightning_sql.sql`` at DEBUG), and asks SQLite for each one's plan
(``EXPLAIN QUERY PLAN``) with the same parameters, on a database whose tables have no statistics
(as the store leaves them) and again after ``ANALYZE``.  PostgreSQL's plans are in
``test_pg_plans.py``.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore
from tests.conftest import BackendSpec

QUEUED = 2000


async def _statements_of(calls: Callable[[], Awaitable[Any]]) -> list[tuple[str, Any]]:
    """Every statement the store's batches ran during ``calls``, with its parameters."""
    seen: list[tuple[str, Any]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            statement, parameters = record.args  # type: ignore[misc]
            seen.append((statement, parameters))

    log = logging.getLogger("lightning_sql.sql")
    handler, level = Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        await calls()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return seen


def _plan_rows(path: str, statement: str, parameters: Any) -> list[tuple[int, int, str]]:
    """The statement's plan (``EXPLAIN QUERY PLAN``: planned, not run) as (id, parent, detail)."""
    if parameters and isinstance(parameters[0], list):  # executemany: the first row's values
        parameters = parameters[0]
    conn = sqlite3.connect(path)
    try:
        return [(row[0], row[1], row[3]) for row in conn.execute("EXPLAIN QUERY PLAN " + statement, parameters)]
    finally:
        conn.close()


def _plan(path: str, statement: str, parameters: Any) -> list[str]:
    return [detail for _id, _parent, detail in _plan_rows(path, statement, parameters)]


def _sorts_beside_the_queue_read(rows: list[tuple[int, int, str]]) -> list[str]:
    """Sorts in the same (sub)query as the read of the queue index: a sort of what the index read,
    which an index in claim order makes needless.  A sort elsewhere orders the few candidates the
    claim's parts bring (the claimable head and the due rollouts in back-off, each at most LIMIT)."""
    readers = {parent for _id, parent, detail in rows if detail.startswith("SEARCH rollouts USING INDEX ix_rollouts_queue")}
    return [detail for _id, parent, detail in rows if parent in readers and "TEMP B-TREE" in detail]


def _analyze(path: str) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute("ANALYZE")
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("backend", ["sqlite_file"], indirect=True)
async def test_a_claim_reads_the_head_of_the_queue_index(backend: BackendSpec, store_factory: Any) -> None:
    store: SqlLightningStore = store_factory(run="plans", scan_debounce_seconds=3600)
    other: SqlLightningStore = store_factory(run="other-run", scan_debounce_seconds=3600)
    path = backend.url.removeprefix("sqlite:///")
    # A long queue in two runs, and claimed rollouts that left it (the run holds more than its queue).
    for st in (store, other):
        await st.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(QUEUED)])
    assert len(await store.dequeue_many_rollouts(limit=QUEUED // 2, worker_id="w0")) == QUEUED // 2
    await store.statistics()  # the lazy sweep runs here, outside the captured calls

    claimed: list[Any] = []

    async def claims() -> None:
        claimed.append(await store.dequeue_rollout(worker_id="w1"))
        claimed.extend(await store.dequeue_many_rollouts(limit=3, worker_id="w2"))

    for analysed in (False, True):
        if analysed:
            _analyze(path)
        claimed.clear()
        statements = [(sql, p) for sql, p in await _statements_of(claims) if "rollouts" in sql]
        assert len(claimed) == 4 and all(c is not None for c in claimed)
        picks = [(sql, p) for sql, p in statements if "ORDER BY" in sql and "queue_seq" in sql]
        assert len(picks) == 2, [sql for sql, _p in statements]  # one pick per claim
        assert len(statements) > len(picks)  # and the statements that mark the picked rollouts
        for sql, params in statements:
            rows = _plan_rows(path, sql, params)
            plan = [detail for _id, _parent, detail in rows]
            where = f"{sql}\n-> {plan} (analysed: {analysed})"
            assert not [step for step in plan if step.startswith("SCAN rollouts")], where
            if (sql, params) in picks:
                # The head of the queue, in the index's order: no scan, no sort of the queue.
                assert any(
                    step.startswith("SEARCH rollouts USING INDEX ix_rollouts_queue (run_id=?") for step in plan
                ), where
                assert not _sorts_beside_the_queue_read(rows), where
