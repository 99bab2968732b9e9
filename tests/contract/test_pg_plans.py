"""How PostgreSQL plans the store's statements: they find their rows through the key, not by
scanning the run's rows.

Keyed statements join their targets to a MATERIALIZED CTE of the keys, ``run_id`` included (ADR
0007; written with ``run_id = :run_id`` and an ``IN`` or ``= ANY`` on the ids, they were planned as
scans of the run whenever the planner believed the run small).  The tests run the calls for real
(captured with a ``before_cursor_execute`` listener), analyse the tables as autovacuum would on a
live database, and ask PostgreSQL for each statement's plan with the same parameters, at a size
(2,000 claimed rollouts) where a scan costs more than the look-ups; and they do the same for every
statement of a lifecycle of a NEW run in tables analysed while they held only an older one: the
state every new run of a live database starts in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import Engine, event

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore
from lightning_sql.types import RolloutConfig
from tests.conftest import PG_URL, BackendSpec
from tests.contract.test_spans import make_span
from tests.helpers import FakeClock, pg_execute, pg_fetch

pytestmark = pytest.mark.postgres

ROLLOUTS = 2000  # enough for a scan of the run to cost more than a key look-up per row
CALLERS = 8


async def _statements_of(store: SqlLightningStore, calls: Callable[[], Awaitable[Any]]) -> list[tuple[str, Any]]:
    """Every statement ``calls`` ran, with its parameters: the batches' from the store's statement
    log (``lightning_sql.sql`` at DEBUG: they run on the driver connection), the units' from
    SQLAlchemy's events (every engine of the process: the store's executor owns them)."""
    seen: list[tuple[str, Any]] = []

    def before(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if not executemany:
            seen.append((statement, parameters))

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            statement, parameters = record.args  # type: ignore[misc]
            seen.append((statement, parameters))

    log = logging.getLogger("lightning_sql.sql")
    handler, level = Capture(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    event.listen(Engine, "before_cursor_execute", before)
    try:
        await calls()
    finally:
        event.remove(Engine, "before_cursor_execute", before)
        log.removeHandler(handler)
        log.setLevel(level)
    return seen


async def _captured(
    store: SqlLightningStore, marker: str, calls: Callable[[], Awaitable[Any]]
) -> tuple[str, Any]:
    """The one statement containing ``marker`` that ``calls`` ran, with its parameters."""
    seen = [(sql, params) for sql, params in await _statements_of(store, calls) if marker in sql]
    assert len(seen) == 1, [s for s, _p in seen]
    return seen[0]


async def _analyze(schema: str) -> None:
    await pg_execute(PG_URL, f'ANALYZE "{schema}".rollouts, "{schema}".attempts, "{schema}".spans')


async def _plan(schema: str, statement: str, parameters: Any, *, analyze: bool = True) -> list[dict[str, Any]]:
    """Every node of the statement's plan (``EXPLAIN``, not run), after ``ANALYZE`` unless not."""
    if analyze:
        await _analyze(schema)
    ((raw,),) = await pg_fetch(PG_URL, "EXPLAIN (FORMAT JSON) " + statement, *parameters)
    nodes: list[dict[str, Any]] = []
    pending = [(json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]]
    while pending:
        node = pending.pop()
        nodes.append(node)
        pending.extend(node.get("Plans", []))
    return nodes


def _scans_of_the_run(nodes: list[dict[str, Any]]) -> list[str]:
    """The nodes that read rollouts or attempts other than by a key look-up."""
    keyed = ("Index Scan", "Index Only Scan")
    return [
        f"{n['Node Type']} on {n['Relation Name']} ({n.get('Index Name')}: {n.get('Index Cond') or n.get('Filter')})"
        for n in nodes
        if n.get("Relation Name") in ("rollouts", "attempts")
        and n["Node Type"] != "ModifyTable"
        and (n["Node Type"] not in keyed or "rollout_id" not in str(n.get("Index Cond", "")))
    ]


async def _claimed(store: SqlLightningStore) -> list[tuple[str, str]]:
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(ROLLOUTS)])
    claimed = await store.dequeue_many_rollouts(limit=ROLLOUTS, worker_id="w")
    return [(ar.rollout_id, ar.attempt.attempt_id) for ar in claimed][:CALLERS]


def _add_one_span_each(store: SqlLightningStore, pairs: list[tuple[str, str]]) -> Awaitable[Any]:
    return asyncio.gather(*(store.add_span(make_span(rid, aid, 1)) for rid, aid in pairs))


def _reserve_each(store: SqlLightningStore, pairs: list[tuple[str, str]]) -> Awaitable[Any]:
    return asyncio.gather(*(store.get_many_span_sequence_ids([pair] * 3) for pair in pairs))


async def test_a_page_of_rollouts_finds_their_latest_attempts_by_key(pg_backend: BackendSpec) -> None:
    """``query_rollouts`` reads each rollout's latest attempt by its key.  As a row-value ``IN``
    list of (rollout, sequence id) pairs, a page of first attempts (the pairs sharing sequence id
    1) was planned as a read of every attempt of the run with that id, filtered by an ``OR`` of the
    ids: 160 ms per 500 pairs in a run of 30,000 (docs/performance.md, twenty-third pass)."""
    store = pg_backend.open(run="r", scan_debounce_seconds=3600)
    try:
        await _claimed(store)
        await store.statistics()  # the lazy sweep runs here, outside the captured calls
        page: list[Any] = []

        async def read_a_page() -> None:
            page.extend(await store.query_rollouts(limit=ROLLOUTS // 2, offset=ROLLOUTS // 4))

        reads = [(sql, p) for sql, p in await _statements_of(store, read_a_page) if "last_heartbeat_time" in sql]
        assert len(page) == ROLLOUTS // 2 and all(r.attempt.sequence_id == 1 for r in page)
        assert len(reads) == 1  # one statement for the page's attempts, whatever its length
        assert pg_backend.schema is not None
        nodes = await _plan(pg_backend.schema, *reads[0])
        assert any(n.get("Relation Name") == "attempts" for n in nodes)
        assert _scans_of_the_run(nodes) == []
    finally:
        await store.close()


async def test_a_sweep_rechecks_the_attempts_it_times_out_by_key(pg_backend: BackendSpec) -> None:
    """The sweeper re-checks and updates the attempts it found expired by their keys.  As a
    row-value ``IN`` list of keys sharing ``run_id``, the re-check was planned as a walk of every
    in-flight rollout of the run through ``(run_id, status)``, filtered by the list: a sweep timing
    out 5,000 of 30,000 claimed rollouts took 1.16 s (docs/performance.md, twenty-third pass)."""
    clock = FakeClock(1_000_000.0)
    store = pg_backend.open(run="r", clock=clock, clock_sync=False, scan_debounce_seconds=1)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(ROLLOUTS)])
        expiring = EnqueueRolloutRequest(input={"i": -1}, config=RolloutConfig(timeout_seconds=5))
        await store.enqueue_many_rollouts([expiring.model_copy(deep=True) for _ in range(CALLERS)])
        claimed = await store.dequeue_many_rollouts(limit=ROLLOUTS + CALLERS, worker_id="w")
        assert len(claimed) == ROLLOUTS + CALLERS
        clock.advance(10)
        failed: list[Any] = []

        async def sweep_and_read() -> None:  # query_rollouts sweeps first (lazily, once a second)
            failed.extend(await store.query_rollouts(status_in=["failed"]))

        statements = await _statements_of(store, sweep_and_read)
        assert len(failed) == CALLERS  # the sweep timed them out (one attempt each: failed)
        recheck = [(sql, p) for sql, p in statements if re.search(r"UPDATE \S*attempts SET status", sql)]
        assert len(recheck) == 1, [sql[:120] for sql, _p in statements]
        assert pg_backend.schema is not None
        nodes = await _plan(pg_backend.schema, *recheck[0])
        assert any(n["Node Type"] == "ModifyTable" and n.get("Relation Name") == "attempts" for n in nodes)
        assert _scans_of_the_run(nodes) == []
    finally:
        await store.close()


@pytest.mark.parametrize("limit", [-1, 10])
async def test_a_page_of_spans_reads_the_index_in_its_order(pg_backend: BackendSpec, limit: int) -> None:
    """``query_spans``' default order, ``sequence_id`` with ties in insertion order (``id``), is the
    order of the spans' index (revision 0004): PostgreSQL reads a page in order and stops at its end,
    whatever its statistics say.  With the index ending at ``sequence_id`` it needed a sort, a full
    one of every span of the attempt when its statistics did not describe the trace (measured: a
    table not analysed since the trace was written): a page of 10 from a trace of 10,000 spans took 55-58
    ms against ~3 (docs/performance.md, twenty-sixth pass)."""
    store = pg_backend.open(run="r", scan_debounce_seconds=3600)
    try:
        pairs = await _claimed(store)
        await store.add_many_spans(
            [make_span(rid, aid, 1 + k // 3, span_id=f"s{k}") for rid, aid in pairs for k in range(300)]
        )
        await store.statistics()  # the lazy sweep runs here, outside the captured call
        rid = pairs[3][0]
        page: list[Any] = []

        async def read_a_page() -> None:
            page.extend(await store.query_spans(rid, "latest", limit=limit))

        reads = [(sql, p) for sql, p in await _statements_of(store, read_a_page) if "FROM" in sql and "spans" in sql]
        assert [s.span_id for s in page] == [f"s{k}" for k in range(300)][: limit if limit > 0 else None]
        page_statement = [(sql, p) for sql, p in reads if "count(" not in sql]
        assert len(page_statement) == 1, [sql[:120] for sql, _p in reads]
        assert pg_backend.schema is not None
        nodes = await _plan(pg_backend.schema, *page_statement[0])
        assert [n["Node Type"] for n in nodes if "Sort" in n["Node Type"]] == []
        scans = [n for n in nodes if n.get("Relation Name") == "spans"]
        assert [(n["Node Type"], n.get("Index Name")) for n in scans] == [
            ("Index Scan", "ix_spans_run_id_rollout_id_attempt_id_sequence_id_id")
        ]
    finally:
        await store.close()


async def test_a_page_at_an_offset_reads_only_its_own_spans_rows(pg_backend: BackendSpec) -> None:
    """PostgreSQL computes the output columns of every row an OFFSET skips (each span's JSONB as
    text, its out-of-line attributes fetched): a page at an offset finds its ids first, in the
    spans' index, and reads the JSON of its own rows only (a page of 10 at offset 5,000 of a
    10,000-span trace: docs/performance.md, twenty-sixth pass).  The plan says so: below the
    LIMIT, nothing outputs a JSON column."""
    store = pg_backend.open(run="r", scan_debounce_seconds=3600)
    try:
        pairs = await _claimed(store)
        rid, aid = pairs[0]
        await store.add_many_spans([make_span(rid, aid, 1 + k // 3, span_id=f"s{k}") for k in range(300)])
        await store.statistics()  # the lazy sweep runs here, outside the captured call
        page: list[Any] = []

        async def read_a_page() -> None:
            page.extend(await store.query_spans(rid, "latest", limit=10, offset=200))

        reads = [sql_p for sql_p in await _statements_of(store, read_a_page) if "attributes" in sql_p[0]]
        assert [s.span_id for s in page] == [f"s{k}" for k in range(200, 210)]
        assert len(reads) == 1, [sql[:120] for sql, _p in reads]
        assert pg_backend.schema is not None
        statement, parameters = reads[0]
        await _analyze(pg_backend.schema)
        ((raw,),) = await pg_fetch(PG_URL, "EXPLAIN (VERBOSE, FORMAT JSON) " + statement, *parameters)
        plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
        limits, pending = [], [plan]
        while pending:
            node = pending.pop()
            if node["Node Type"] == "Limit" and any(c.endswith(".id") for c in node.get("Output", [])):
                limits.append(node)  # the page's (the latest attempt's look-up has one too)
            pending.extend(node.get("Plans", []))
        assert len(limits) == 1
        below, pending = [], list(limits[0].get("Plans", []))
        while pending:
            node = pending.pop()
            below.append(node)
            pending.extend(node.get("Plans", []))
        outputs = [column for node in below for column in node.get("Output", [])]
        assert outputs and not [
            c for c in outputs if re.search(r"attributes|events|links|resource|extra", c)
        ], outputs
    finally:
        await store.close()


# -- a new run in tables analysed before it existed ------------------------------------------------


def _reads_beyond_the_keys(nodes: list[dict[str, Any]]) -> list[str]:
    """The nodes that read rollouts, attempts or spans other than through a rollout's key, or the
    heads of the queue indexes (the claim: the claimable index, and the delayed one up to now)."""
    bad = []
    for n in nodes:
        relation, index = n.get("Relation Name"), n.get("Index Name")
        kind = n["Node Type"]
        if kind in ("ModifyTable", "Bitmap Heap Scan", "LockRows") or (relation or "") not in (
            "rollouts",
            "attempts",
            "spans",
            "",
        ):
            continue
        if relation is None and index is None:
            continue
        cond = str(n.get("Index Cond", ""))
        if kind in ("Index Scan", "Index Only Scan", "Bitmap Index Scan") and (
            "rollout_id" in cond or index == "ix_rollouts_queue" or (index == "ix_rollouts_delayed" and "not_before <=" in cond)
        ):
            continue
        if index is not None and not index.startswith(("pk_", "uq_", "ix_")):
            continue  # an index of another table (runs, workers)
        bad.append(f"{kind} on {relation or ''} ({index}: {cond or n.get('Filter')})")
    return bad


async def test_a_new_run_in_tables_analysed_before_it_finds_its_rows_by_key(pg_backend: BackendSpec) -> None:
    """Tables analysed while holding an older run (as autovacuum or the store's own ANALYZE leave
    them): every statement of a new run's lifecycle still reads its rows by key.  With ``run_id``
    sampled (before revision 0003) the planner took the new run for an empty one and read it
    through ``ix_rollouts_run_id_status`` instead (docs/performance.md, fifteenth pass)."""
    assert pg_backend.schema is not None
    old = pg_backend.open(run="old", analyze_check_seconds=None)
    new = pg_backend.open(run="new", analyze_check_seconds=None, scan_debounce_seconds=3600)
    try:
        await old.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(ROLLOUTS)])
        old_spans = [make_span(c.rollout_id, c.attempt.attempt_id, 1) for c in await old.dequeue_many_rollouts(limit=ROLLOUTS)]
        for start in range(0, ROLLOUTS, 500):
            await old.add_many_spans(old_spans[start : start + 500])
        await _analyze(pg_backend.schema)  # the statistics know of the old run only
        await new.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(ROLLOUTS)])
        await new.dequeue_many_rollouts(limit=ROLLOUTS // 2, worker_id="w")  # the new run holds 2,000 rows

        async def lifecycle() -> None:
            claimed = [await new.dequeue_rollout(worker_id=f"w-{i}") for i in range(CALLERS)]
            pairs = [(c.rollout_id, c.attempt.attempt_id) for c in claimed if c is not None]
            await _reserve_each(new, pairs)
            await _add_one_span_each(new, pairs)
            rid, aid = pairs[0]
            await new.get_many_span_sequence_ids([(rid, aid)] * 2)
            await new.add_many_spans([make_span(rid, aid, 10), make_span(rid, aid, 11)])
            await new.touch_attempt(rid, aid)
            await asyncio.gather(*(new.update_attempt(r, a, status="succeeded") for r, a in pairs))
            await new.get_rollout_by_id(rid)
            await new.query_spans(rid, "latest")

        await new.statistics()  # the lazy sweep runs here, outside the captured calls
        statements = await _statements_of(new, lifecycle)
        assert len(statements) >= 8
        problems = []
        for statement, parameters in statements:
            nodes = await _plan(pg_backend.schema, statement, parameters, analyze=False)
            problems += [f"{found}\n    in {statement[:160]}" for found in _reads_beyond_the_keys(nodes)]
        assert problems == []
    finally:
        await old.close()
        await new.close()


# -- a run that starts small and grows -------------------------------------------------------------


async def _rows_read(schema: str) -> int:
    """Rows read so far from the schema's rollouts, attempts and spans (every backend's, as flushed)."""
    await asyncio.sleep(STATS_FLUSH_SECONDS)
    ((total,),) = await pg_fetch(
        PG_URL,
        "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0)::bigint"
        " FROM pg_stat_user_tables WHERE schemaname = $1 AND relname IN ('rollouts', 'attempts', 'spans')",
        schema,
    )
    return int(total)


# A backend reports its table statistics at most once a second, and within about a second of going
# idle, unless it finds the shared statistics locked; it then tries again 10 s later (PostgreSQL 15,
# PGSTAT_IDLE_INTERVAL). Waiting this long before reading them sees every call made before: with
# 2.5 s the test below counted 114 to 2,121 rows per lifecycle in consecutive runs on a 2-core
# machine (earlier lifecycles' reads arriving late), with 11 s 24.0 in each of three.
STATS_FLUSH_SECONDS = 11.0


async def _run_lifecycles(store: SqlLightningStore, n: int, runners: int = CALLERS) -> None:
    """``n`` lifecycles by ``runners`` concurrent tasks: claim, three sequence ids, three single-span
    adds (batched across the tasks: ADR 0005 decision 10), succeed."""
    left = [n]

    async def runner(k: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            claimed = await store.dequeue_rollout(worker_id=f"w-{k}")
            assert claimed is not None
            rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
            for seq in await store.get_many_span_sequence_ids([(rid, aid)] * 3):
                await store.add_span(make_span(rid, aid, seq))
            await store.update_attempt(rid, aid, status="succeeded")

    await asyncio.gather(*(runner(k) for k in range(runners)))


async def test_a_run_that_starts_small_reads_by_key_once_it_has_grown(pg_backend: BackendSpec) -> None:
    """A connection keeps the generic plan it made of a prepared statement after five executions,
    whatever the tables grow to, until something (an ANALYZE) invalidates it; made on a table of a
    page or two, that plan scans the table, and rightly so then. The store analyses its tables as
    they grow (ADR 0006), when its lazy sweep runs: after a run that started with 40 rollouts has
    grown to 4,000, a lifecycle reads a few rows by key, not the run (measured on 2026-12-03: 24.0
    rows per lifecycle in three runs; 3,672-3,679 with ``analyze_check_seconds=None``; 2026-12-02,
    counted with sweeps among the lifecycles and a 2.5-s wait for the statistics: 7-8 and
    2,200-5,000). The store clock is the test's: a sweep (at most one per second of it) runs where
    the test moves it, before each growth step and once after, never in the lifecycles counted (a
    sweep reads rows of its own, which are not what is measured here); the last one after the
    growth's changes have reached the server's statistics (with a one-statement enqueue of the
    4,000, on 2026-12-04, the growth took 0.6 s, and no sweep saw them without the wait: 3,679
    rows per lifecycle). Rows are counted, not timed."""
    assert pg_backend.schema is not None
    clock = FakeClock(1_000_000.0)
    store = pg_backend.open(run="r", scan_debounce_seconds=1, analyze_check_seconds=0, clock=clock)
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(40)])
        await _run_lifecycles(store, 40)  # every statement planned on tiny tables
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(4000)])
        for _step in range(6):  # the run grows; its tables get analysed as they do
            clock.advance(2.0)
            await _run_lifecycles(store, 50)
        # The growth's changes reach the statistics the sweep reads (a second or more of real time,
        # which a live run spends; this one can grow in under one).
        await asyncio.sleep(STATS_FLUSH_SECONDS)
        clock.advance(2.0)
        await _run_lifecycles(store, 1)  # the last sweep, and the last look for tables to analyse
        before = await _rows_read(pg_backend.schema)
        await _run_lifecycles(store, 100)  # the clock stands still: no sweep
        per_lifecycle = (await _rows_read(pg_backend.schema) - before) / 100
        assert per_lifecycle < 100, per_lifecycle
    finally:
        await store.close()
