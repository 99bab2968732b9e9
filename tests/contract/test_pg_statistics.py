"""Planner statistics on PostgreSQL: the lazy sweep analyses a run table once it has changed by as
many rows as it held at its last analysis (at least 1,000), and leaves it alone otherwise
(``planner_stats``, ADR 0006).

The counts come from ``pg_stat_user_tables``, which the server updates a moment after the writes
(each backend reports its counts when it goes idle): the test waits for them before it sweeps.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore
from lightning_sql.store.sql.planner_stats import MIN_CHANGES
from tests.conftest import PG_URL, BackendSpec
from tests.contract.test_spans import make_span
from tests.helpers import pg_fetch

pytestmark = pytest.mark.postgres

TABLES = ("rollouts", "attempts", "spans")


async def _table_stats(schema: str) -> dict[str, tuple[int, int, float]]:
    """Per run table: (analyses so far, changes since the last one, rows the planner believes)."""
    rows = await pg_fetch(
        PG_URL,
        """SELECT t.relname, t.analyze_count, t.n_mod_since_analyze, c.reltuples
           FROM pg_stat_user_tables t JOIN pg_class c ON c.oid = t.relid
           WHERE t.schemaname = $1 AND t.relname = ANY($2::text[])""",
        schema,
        list(TABLES),
    )
    return {r["relname"]: (r["analyze_count"], r["n_mod_since_analyze"], r["reltuples"]) for r in rows}


async def _changes_reported(schema: str, table: str, at_least: int) -> dict[str, tuple[int, int, float]]:
    deadline = time.monotonic() + 30.0  # generous: the server reports a backend's counts once it is idle
    while True:
        stats = await _table_stats(schema)
        if stats[table][1] >= at_least or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def _open(pg_backend: BackendSpec, **options: object) -> SqlLightningStore:
    return pg_backend.open(run="r", scan_debounce_seconds=0, clock_sync=False, **options)


async def test_a_table_changed_by_its_size_is_analysed_by_the_next_sweep(pg_backend: BackendSpec) -> None:
    assert pg_backend.schema is not None
    store = _open(pg_backend, analyze_check_seconds=0)
    try:
        n = MIN_CHANGES + 200
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])
        before = await _changes_reported(pg_backend.schema, "rollouts", n)
        assert before["rollouts"][:2] == (0, n), before  # never analysed; n rows inserted
        assert await store.dequeue_rollout(worker_id="w") is not None  # its lazy sweep looks
        after = await _table_stats(pg_backend.schema)
        assert after["rollouts"][0] == 1 and after["rollouts"][2] == n, after  # analysed: n rows known
        assert after["attempts"][0] == 0 and after["spans"][0] == 0, after  # below MIN_CHANGES: left alone
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None
        assert (await _table_stats(pg_backend.schema))["rollouts"][0] == 1  # no change of its size since
        # The spans table: its key and filter columns (RUN_TABLES) are analysed once it is due.
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        await store.add_many_spans([make_span(rid, aid, k) for k in range(1, n + 1)])
        reported = await _changes_reported(pg_backend.schema, "spans", n)
        assert reported["spans"][:2] == (0, n), reported
        await store.dequeue_rollout(worker_id="w")
        after = await _table_stats(pg_backend.schema)
        assert after["spans"][0] == 1 and after["spans"][2] == n, after
    finally:
        await store.close()


# case: (analyze_check_seconds, whether a sweep runs before the table is due)
NOT_ANALYSED = {
    # None: the store never looks.
    "switched off": (None, False),
    # A store looks at most once per analyze_check_seconds: its first sweep looks (nothing is due on
    # an empty table); within the hour that follows, later sweeps do not, even once a table is due.
    "debounced": (3600, True),
}


@pytest.mark.parametrize("case", list(NOT_ANALYSED))
async def test_a_due_table_is_left_alone(pg_backend: BackendSpec, case: str) -> None:
    check_seconds, sweep_first = NOT_ANALYSED[case]
    assert pg_backend.schema is not None
    store = _open(pg_backend, analyze_check_seconds=check_seconds)
    try:
        if sweep_first:
            await store.dequeue_rollout(worker_id="w")
        n = MIN_CHANGES + 200
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])
        reported = await _changes_reported(pg_backend.schema, "rollouts", n)
        assert reported["rollouts"][1] >= n, reported  # the table is due
        await store.dequeue_rollout(worker_id="w")
        assert (await _table_stats(pg_backend.schema))["rollouts"][0] == 0
    finally:
        await store.close()
