"""Contract §2.15: the sweeper (lease expiry), driven only by the injected clock."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy import Engine, event

from lightning_sql import EnqueueRolloutRequest, PromptTemplate, RolloutConfig, Span
from tests.conftest import PG_URL, BackendSpec

TIMEOUT_RETRY = RolloutConfig(timeout_seconds=10, max_attempts=2, retry_condition=["timeout", "unresponsive"])


def _span(rollout_id: str, attempt_id: str, seq: int = 1) -> Span:
    return Span.from_attributes(attributes={}, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq)


async def _attempt_status(store: Any, rollout_id: str) -> str:
    attempt = await store.get_latest_attempt(rollout_id)
    assert attempt is not None
    return attempt.status


# --- what is hit, and with which status ----------------------------------------------------------


async def test_timeout_is_strictly_greater_and_measured_from_attempt_start(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=10))
    clock.advance(5)
    await store.touch_attempt(ar.rollout_id, ar.attempt.attempt_id)  # heartbeats do not extend a timeout
    clock.advance(5)  # exactly 10 s after the start
    assert await store.sweep() == 0
    assert await _attempt_status(store, ar.rollout_id) == "preparing"
    clock.advance(0.25)
    assert await store.sweep() == 1
    a = await store.get_latest_attempt(ar.rollout_id)
    assert a is not None and (a.status, a.end_time) == ("timeout", None)


async def test_unresponsive_measured_from_last_heartbeat_strictly(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(unresponsive_seconds=5))
    clock.advance(4)
    await store.touch_attempt(ar.rollout_id, ar.attempt.attempt_id)
    clock.advance(5)  # 9 s since start, exactly 5 s since the heartbeat
    assert await store.sweep() == 0
    clock.advance(0.25)
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "unresponsive"


async def test_span_heartbeat_keeps_the_attempt_alive(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(unresponsive_seconds=5))
    for i in range(1, 5):
        clock.advance(4)
        await store.add_span(_span(ar.rollout_id, ar.attempt.attempt_id, i))
        assert await store.sweep() == 0
    assert await _attempt_status(store, ar.rollout_id) == "running"
    clock.advance(5.5)
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "unresponsive"


async def test_no_heartbeat_measures_unresponsive_from_start(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(unresponsive_seconds=5))
    clock.advance(5)
    assert await store.sweep() == 0
    clock.advance(0.5)
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "unresponsive"


async def test_timeout_takes_precedence_over_unresponsive(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=10, unresponsive_seconds=3))
    clock.advance(11)  # both limits are exceeded
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "timeout"


async def test_unresponsive_before_timeout(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=10, unresponsive_seconds=3))
    clock.advance(4)
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "unresponsive"


async def test_rollouts_without_a_lease_never_expire(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(max_attempts=5, retry_condition=["timeout"]))
    clock.advance(10**7)
    assert await store.sweep() == 0
    assert await _attempt_status(store, ar.rollout_id) == "preparing"


async def test_only_in_flight_rollouts_with_attempts_are_candidates(store, clock):
    cfg = RolloutConfig(timeout_seconds=1)
    queued = await store.enqueue_rollout("q", config=cfg)
    no_attempt = await store.enqueue_rollout("n", config=cfg)
    await store.update_rollout(no_attempt.rollout_id, status="preparing")  # in flight but no attempt
    finished = {}
    for status in ("succeeded", "failed", "cancelled"):
        ar = await store.start_rollout(status, config=cfg)
        finished[status] = (ar, await store.update_rollout(ar.rollout_id, status=status))
    requeued = await store.start_rollout("r", config=cfg)
    await store.update_rollout(requeued.rollout_id, status="requeuing")
    clock.advance(100)
    assert await store.sweep() == 0
    for status, (ar, before) in finished.items():
        got = await store.get_rollout_by_id(ar.rollout_id)
        assert got is not None and (got.status, got.end_time) == (status, before.end_time)
        assert await _attempt_status(store, ar.rollout_id) == "preparing"
    assert (await store.get_rollout_by_id(queued.rollout_id)).status == "queuing"  # type: ignore[union-attr]
    assert (await store.get_rollout_by_id(no_attempt.rollout_id)).status == "preparing"  # type: ignore[union-attr]


async def test_only_the_latest_attempt_is_judged(store, clock):
    ar = await store.start_rollout(
        1, config=RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive"])
    )
    clock.advance(4)
    second = await store.start_attempt(ar.rollout_id)
    clock.advance(3)  # the first attempt is 7 s old, the latest 3 s
    assert await store.sweep() == 0
    clock.advance(3)
    assert await store.sweep() == 1
    statuses = [a.status for a in await store.query_attempts(ar.rollout_id)]
    assert statuses == ["preparing", "unresponsive"]
    assert second.attempt.sequence_id == 2


async def test_the_attempts_current_status_is_not_consulted(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=5))
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
    await store.update_rollout(ar.rollout_id, status="running")  # back in flight by hand
    clock.advance(6)
    assert await store.sweep() == 1
    assert await _attempt_status(store, ar.rollout_id) == "timeout"
    assert (await store.get_rollout_by_id(ar.rollout_id)).status == "failed"  # type: ignore[union-attr]


# --- requeue or fail ----------------------------------------------------------------------------


async def test_hit_with_retry_requeues_at_the_tail_and_signals_the_queue(store, clock):
    ar = await store.start_rollout("leased", config=TIMEOUT_RETRY)
    clock.advance(5)
    waiting = await store.enqueue_rollout("waiting")
    assert await store.dequeue_rollout() is not None  # the queue is empty again
    assert await store.wait_for_queue(timeout=0) is False
    tail = await store.enqueue_rollout("already queued")
    clock.advance(6)
    assert await store.sweep() == 1
    got = await store.get_rollout_by_id(ar.rollout_id)
    assert got is not None and (got.status, got.end_time) == ("requeuing", None)
    assert await store.wait_for_queue(timeout=0) is True
    first = await store.dequeue_rollout()
    second = await store.dequeue_rollout()
    assert first is not None and second is not None
    assert (first.rollout_id, second.rollout_id) == (tail.rollout_id, ar.rollout_id)
    assert second.attempt.sequence_id == 2
    assert waiting.rollout_id != ar.rollout_id


async def test_wait_for_queue_wakes_when_the_sweeper_requeues(backend, store_factory, clock):
    waiter_store = store_factory()
    sweeper_store = store_factory() if backend.persistent else waiter_store
    ar = await sweeper_store.start_rollout(1, config=TIMEOUT_RETRY)
    clock.advance(11)
    started = time.monotonic()
    task = asyncio.create_task(waiter_store.wait_for_queue(timeout=10))
    await asyncio.sleep(0.05)
    assert await sweeper_store.sweep() == 1
    assert await task is True
    assert time.monotonic() - started < 5  # woken, well before the timeout
    assert (await sweeper_store.get_rollout_by_id(ar.rollout_id)).status == "requeuing"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("config", "advance", "why"),
    [
        (
            RolloutConfig(timeout_seconds=10, max_attempts=3, retry_condition=["unresponsive"]),
            11,
            "status not retryable",
        ),
        (
            RolloutConfig(unresponsive_seconds=10, max_attempts=1, retry_condition=["unresponsive"]),
            11,
            "attempts used up",
        ),
        (RolloutConfig(timeout_seconds=10), 11, "defaults: no retry"),
    ],
)
async def test_hit_without_retry_fails_the_rollout_and_wakes_waiters(
    store_factory, clock, config, advance, why
):
    # A long debounce: only the explicit sweep below may expire the lease (not the waiter's own reads).
    store = store_factory(scan_debounce_seconds=1000)
    ar = await store.start_rollout(1, config=config)
    waiter = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[ar.rollout_id], timeout=10))
    await asyncio.sleep(0.05)
    clock.advance(advance)
    started = time.monotonic()
    assert await store.sweep() == 1, why
    done = await waiter
    assert time.monotonic() - started < 5
    assert [r.rollout_id for r in done] == [ar.rollout_id]
    assert (done[0].status, done[0].end_time) == ("failed", clock())
    a = await store.get_latest_attempt(ar.rollout_id)
    assert a is not None and a.end_time is None and a.status in ("timeout", "unresponsive")
    assert (await store.statistics())["queue_depth"] == 0


async def test_retries_until_max_attempts_then_fails(store, clock):
    cfg = RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout(1, config=cfg)
    for seq in (1, 2, 3):
        ar = await store.dequeue_rollout(worker_id="w")
        assert ar is not None and ar.rollout_id == r.rollout_id and ar.attempt.sequence_id == seq
        clock.advance(6)
        assert await store.sweep() == 1
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got is not None and (got.status, got.end_time) == ("failed", clock())
    assert [a.status for a in await store.query_attempts(r.rollout_id)] == ["unresponsive"] * 3
    assert await store.dequeue_rollout() is None


# --- workers ------------------------------------------------------------------------------------


async def test_worker_of_the_hit_attempt_becomes_unknown(store, clock):
    await store.update_worker("w", heartbeat_stats={"k": 1})
    hb = clock()
    ar = await store.start_rollout(1, worker_id="w", config=TIMEOUT_RETRY)
    clock.advance(11)
    assert await store.sweep() == 1
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.last_idle_time, w.current_rollout_id, w.current_attempt_id) == (
        "unknown",
        clock(),
        None,
        None,
    )
    assert (w.heartbeat_stats, w.last_heartbeat_time, w.last_busy_time) == ({"k": 1}, hb, ar.start_time)


async def test_worker_that_moved_on_keeps_its_state(store, clock):
    old = await store.start_rollout(1, worker_id="w", config=TIMEOUT_RETRY)
    # Worker "v": its leased attempt stays in flight, but it finishes other work meanwhile.
    leased_v = await store.start_rollout(3, worker_id="v", config=TIMEOUT_RETRY)
    clock.advance(5)
    await store.enqueue_rollout(2)
    new = await store.dequeue_rollout(worker_id="w")  # the worker moved on (or restarted and reused its id)
    assert new is not None
    later_v = await store.start_rollout(4, worker_id="v")
    await store.update_attempt(later_v.rollout_id, later_v.attempt.attempt_id, status="succeeded")
    finished_at = clock()
    clock.advance(6)
    assert await store.sweep() == 2
    assert await _attempt_status(store, leased_v.rollout_id) == "timeout"
    v = await store.get_worker_by_id("v")
    assert v is not None and (v.status, v.last_idle_time, v.current_attempt_id) == ("idle", finished_at, None)
    assert await _attempt_status(store, old.rollout_id) == "timeout"
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.current_rollout_id, w.current_attempt_id, w.last_idle_time) == (
        "busy",
        new.rollout_id,
        new.attempt.attempt_id,
        None,
    )


async def test_worker_without_id_or_with_empty_id_is_skipped(store, clock):
    a = await store.start_rollout(1, config=TIMEOUT_RETRY)
    b = await store.start_rollout(2, config=TIMEOUT_RETRY)
    await store.update_attempt(b.rollout_id, b.attempt.attempt_id, worker_id="")
    clock.advance(11)
    assert await store.sweep() == 2
    assert (await store.statistics())["total_workers"] == 0
    assert a.attempt.worker_id is None


# --- idempotence and concurrency -----------------------------------------------------------------


async def test_second_sweep_changes_nothing(store, clock):
    ids = []
    for i in range(5):
        ar = await store.start_rollout(
            i, worker_id=f"w{i}", config=TIMEOUT_RETRY if i % 2 else RolloutConfig(timeout_seconds=10)
        )
        ids.append(ar.rollout_id)
    clock.advance(11)
    assert await store.sweep() == 5
    snapshot = [await store.get_rollout_by_id(rid) for rid in ids]
    workers = list(await store.query_workers())
    stats = await store.statistics()
    clock.advance(1)
    assert await store.sweep() == 0
    assert [await store.get_rollout_by_id(rid) for rid in ids] == snapshot
    assert list(await store.query_workers()) == workers
    assert await store.statistics() | {"uptime": 0} == stats | {"uptime": 0}


async def test_concurrent_sweeps_hit_each_attempt_once(backend, store_factory, clock):
    stores = [store_factory() for _ in range(4 if backend.persistent else 1)]
    queued = await stores[0].enqueue_many_rollouts(
        [EnqueueRolloutRequest(input=i, config=TIMEOUT_RETRY) for i in range(20)]
    )
    claimed = await stores[0].dequeue_many_rollouts(limit=20, worker_id="w")
    assert len(claimed) == 20
    clock.advance(11)
    hits = await asyncio.gather(*(stores[i % len(stores)].sweep() for i in range(8)))
    assert sum(hits) == 20
    again = []
    while (ar := await stores[0].dequeue_rollout()) is not None:
        again.append(ar.rollout_id)
    assert sorted(again) == sorted(r.rollout_id for r in queued)
    for r in queued:
        assert [a.status for a in await stores[0].query_attempts(r.rollout_id)] == ["timeout", "preparing"]


# --- when it runs -------------------------------------------------------------------------------

SWEEPING_CALLS = {
    "start_rollout": lambda st, ctx: st.start_rollout("x"),
    "enqueue_rollout": lambda st, ctx: st.enqueue_rollout("x"),
    "enqueue_many_rollouts": lambda st, ctx: st.enqueue_many_rollouts([EnqueueRolloutRequest(input="x")]),
    "dequeue_rollout": lambda st, ctx: st.dequeue_rollout(),
    "dequeue_many_rollouts": lambda st, ctx: st.dequeue_many_rollouts(limit=0),
    "start_attempt": lambda st, ctx: st.start_attempt(ctx["other"]),
    "update_rollout": lambda st, ctx: st.update_rollout(ctx["other"], metadata={}),
    "update_attempt": lambda st, ctx: st.update_attempt(ctx["other"], "latest", metadata={}),
    "query_rollouts": lambda st, ctx: st.query_rollouts(),
    "get_rollout_by_id": lambda st, ctx: st.get_rollout_by_id("ro-none"),
    "query_attempts": lambda st, ctx: st.query_attempts("ro-none"),
    "get_latest_attempt": lambda st, ctx: st.get_latest_attempt("ro-none"),
    "query_spans": lambda st, ctx: st.query_spans("ro-none"),
    "update_resources": lambda st, ctx: st.update_resources(
        "r", {"p": PromptTemplate(template="", engine="f-string")}
    ),
    "wait_for_rollouts": lambda st, ctx: st.wait_for_rollouts(rollout_ids=[ctx["other"]], timeout=0),
    "query_workers": lambda st, ctx: st.query_workers(),
}

NON_SWEEPING_CALLS = {
    "add_resources": lambda st, ctx: st.add_resources({"p": PromptTemplate(template="", engine="f-string")}),
    "get_resources_by_id": lambda st, ctx: st.get_resources_by_id("r"),
    "get_latest_resources": lambda st, ctx: st.get_latest_resources(),
    "query_resources": lambda st, ctx: st.query_resources(),
    "add_span": lambda st, ctx: st.add_span(_span(ctx["other"], ctx["other_attempt"], 7)),
    "add_many_spans": lambda st, ctx: st.add_many_spans([_span(ctx["other"], ctx["other_attempt"], 8)]),
    "get_next_span_sequence_id": lambda st, ctx: st.get_next_span_sequence_id(ctx["other"], "at-x"),
    "get_many_span_sequence_ids": lambda st, ctx: st.get_many_span_sequence_ids([(ctx["other"], "at-x")]),
    "touch_attempt": lambda st, ctx: st.touch_attempt(ctx["other"], "latest"),
    "get_worker_by_id": lambda st, ctx: st.get_worker_by_id("w"),
    "update_worker": lambda st, ctx: st.update_worker("w"),
    "statistics": lambda st, ctx: st.statistics(),
    "wait_for_queue": lambda st, ctx: st.wait_for_queue(timeout=0),
    "list_runs": lambda st, ctx: st.list_runs(),
    "get_run": lambda st, ctx: st.get_run("test-run"),
    "mark_run_finished": lambda st, ctx: st.mark_run_finished(),
}


async def _each_call_on_an_expired_lease(store: Any, clock: Any, calls: dict[str, Any]) -> dict[str, int]:
    """For each call: expire a fresh lease, make the call, then report what an explicit sweep still finds."""
    other = await store.start_rollout("other")  # no lease: spans, counters and updates go here
    ctx = {"other": other.rollout_id, "other_attempt": other.attempt.attempt_id}
    left_for_sweep = {}
    for method in sorted(calls):
        leased = await store.start_rollout("leased", config=TIMEOUT_RETRY)
        clock.advance(11)
        await calls[method](store, ctx)
        left_for_sweep[method] = await store.sweep()  # 0: the call itself swept; 1: it did not
        await store.update_rollout(leased.rollout_id, status="cancelled")  # never a candidate again
    return left_for_sweep


async def test_sweeping_methods_sweep_first(store, clock):
    left = await _each_call_on_an_expired_lease(store, clock, SWEEPING_CALLS)
    assert left == dict.fromkeys(SWEEPING_CALLS, 0)


async def test_other_methods_never_sweep(store, clock):
    left = await _each_call_on_an_expired_lease(store, clock, NON_SWEEPING_CALLS)
    assert left == dict.fromkeys(NON_SWEEPING_CALLS, 1)


async def test_wait_for_rollouts_fallback_polls_sweep(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=10))
    waiter = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[ar.rollout_id], timeout=15))
    await asyncio.sleep(0.1)
    clock.advance(11)  # nobody else calls the store: the waiter's own fallback read must sweep
    done = await asyncio.wait_for(waiter, timeout=15)
    assert [r.status for r in done] == ["failed"]


# --- debounce -----------------------------------------------------------------------------------


async def test_debounce_sweeps_on_first_call_then_at_most_every_interval(store_factory, clock):
    st = store_factory(scan_debounce_seconds=10)
    t0 = clock()
    ar = await st.start_rollout(1, config=RolloutConfig(timeout_seconds=1))  # first call sweeps (nothing yet)
    clock.set(t0 + 2)  # expired, but the last sweep was 2 s ago
    assert await _attempt_status(st, ar.rollout_id) == "preparing"
    clock.set(t0 + 9.75)
    assert await _attempt_status(st, ar.rollout_id) == "preparing"
    clock.set(t0 + 10)  # boundary inclusive
    assert await _attempt_status(st, ar.rollout_id) == "timeout"


async def test_non_positive_debounce_sweeps_on_every_call(store_factory, clock):
    st = store_factory(scan_debounce_seconds=-5)
    a = await st.start_rollout(1, config=RolloutConfig(timeout_seconds=1))
    clock.advance(1.5)
    assert await _attempt_status(st, a.rollout_id) == "timeout"
    b = await st.start_rollout(2, config=RolloutConfig(timeout_seconds=1))
    clock.advance(1.5)
    assert await _attempt_status(st, b.rollout_id) == "timeout"


async def test_debounce_state_is_per_instance_and_starts_never_swept(backend, store_factory, clock):
    if not backend.persistent:
        pytest.skip("an in-memory database belongs to one instance")
    a = store_factory(scan_debounce_seconds=10)
    ar = await a.start_rollout(1, config=RolloutConfig(timeout_seconds=1))
    clock.advance(2)
    assert await _attempt_status(a, ar.rollout_id) == "preparing"
    b = store_factory(scan_debounce_seconds=10)
    assert await _attempt_status(b, ar.rollout_id) == "timeout"  # b has never swept: its first call does


async def test_debounce_sweeps_after_the_clock_steps_back(store_factory, clock):
    st = store_factory(scan_debounce_seconds=10)
    t0 = clock()
    ar = await st.start_rollout(1, config=RolloutConfig(timeout_seconds=100))  # swept at t0
    clock.set(t0 + 10)
    assert await _attempt_status(st, ar.rollout_id) == "preparing"  # swept at t0 + 10 (nothing expired)
    clock.set(t0 + 11)
    await st.update_rollout(ar.rollout_id, config=RolloutConfig(timeout_seconds=1))  # not due: no sweep
    assert await _attempt_status(st, ar.rollout_id) == "preparing"  # expired, but not due
    clock.set(t0 + 5)  # the wall clock steps back: a negative difference counts as due
    assert await _attempt_status(st, ar.rollout_id) == "timeout"


async def test_explicit_sweep_ignores_and_restarts_the_debounce(store_factory, clock):
    st = store_factory(scan_debounce_seconds=10)
    t0 = clock()
    first = await st.start_rollout(1, config=RolloutConfig(timeout_seconds=1))
    clock.set(t0 + 5)
    assert await st.sweep() == 1  # ignores the debounce
    second = await st.start_rollout(2, config=RolloutConfig(timeout_seconds=1))
    clock.set(t0 + 12)  # 12 s after the lazy sweep, 7 s after the explicit one
    assert await _attempt_status(st, second.rollout_id) == "preparing"
    clock.set(t0 + 15)
    assert await _attempt_status(st, second.rollout_id) == "timeout"
    assert await _attempt_status(st, first.rollout_id) == "timeout"


@contextmanager
def _sweeps_started() -> Iterator[list[str]]:
    """The sweeps' candidate SELECTs that start meanwhile (SQLAlchemy's statement events, on every
    engine of the process: the sweep is a unit on a SQLAlchemy connection)."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if " AS timed_out" in statement:
            seen.append(statement)

    event.listen(Engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", before)


@asynccontextmanager
async def _sweeps_held(backend: BackendSpec) -> AsyncIterator[None]:
    """Another connection holds what a sweep needs and a read does not: SQLite's write lock
    (``BEGIN IMMEDIATE``; reads of the WAL pass), or the rollouts table of PostgreSQL in EXCLUSIVE
    mode (plain SELECTs pass, the sweep's ``FOR UPDATE`` waits for it)."""
    if backend.is_postgres:
        conn = await asyncpg.connect(PG_URL)
        try:
            tx = conn.transaction()
            await tx.start()
            await conn.execute(f'LOCK TABLE "{backend.schema}".rollouts IN EXCLUSIVE MODE')
            try:
                yield
            finally:
                await tx.rollback()
        finally:
            await conn.close()
    else:
        assert backend.url.startswith("sqlite:///")
        holder = sqlite3.connect(backend.url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                holder.execute("ROLLBACK")
        finally:
            holder.close()


async def _reads_in_a_row(store: Any, rollout_id: str, n: int) -> None:
    for _ in range(n):
        assert await store.get_rollout_by_id(rollout_id) is not None


async def test_concurrent_calls_of_one_instance_sweep_once_and_do_not_wait_for_the_sweep(
    backend: BackendSpec, store_factory: Any, clock: Any
) -> None:
    st = store_factory(scan_debounce_seconds=10)
    ids = [(await st.start_rollout(i, config=RolloutConfig(timeout_seconds=1))).rollout_id for i in range(5)]
    clock.advance(10)  # the burst is due for a sweep, and every attempt has expired
    with _sweeps_started() as sweeps:
        if not backend.persistent:
            # One connection serves an in-memory database: nothing else can hold its sweep, so only
            # the count is checked here.
            results = await asyncio.gather(*(st.get_rollout_by_id(rid) for rid in ids))
        else:
            async with _sweeps_held(backend):
                calls = [asyncio.ensure_future(st.get_rollout_by_id(rid)) for rid in ids]
                deadline = time.monotonic() + 10
                while sum(c.done() for c in calls) < len(calls) - 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                returned_while_held = [c.done() for c in calls]
                # A call that meets the sweep in progress does not wait for it: 30 calls in a row take
                # a few milliseconds each, where waiting even 0.5 s for the sweep takes 15 s.
                row = asyncio.ensure_future(_reads_in_a_row(st, ids[0], 30))
                await asyncio.wait([row], timeout=7.5)  # never cancels: a held call cannot be
                row_done_while_held = row.done()
                still_held = [not c.done() for c in calls]
            results = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
            await asyncio.wait_for(row, timeout=30)
            # The caller that sweeps was held; the others returned meanwhile.
            assert returned_while_held.count(False) == 1, returned_while_held
            assert row_done_while_held, "30 calls in a row took over 7.5 s while the sweep was held: they waited for it"
            assert still_held == [not done for done in returned_while_held]
    assert all(r is not None for r in results)
    # Exactly one sweep: the clock did not move, so the later calls were not due.
    assert len(sweeps) == 1, sweeps
    assert (await st.statistics())["queue_depth"] == 0
    assert [await _attempt_status(st, rid) for rid in ids] == ["timeout"] * 5


# --- read-only stores and all runs ---------------------------------------------------------------


async def test_read_only_store_never_sweeps(backend, store_factory, clock):
    if not backend.persistent:
        pytest.skip("a read-only store needs a database another instance wrote")
    writer = store_factory()
    ar = await writer.start_rollout(1, config=TIMEOUT_RETRY)
    clock.advance(11)
    reader = store_factory(read_only=True, scan_debounce_seconds=0)
    assert (await reader.get_rollout_by_id(ar.rollout_id)).status == "preparing"  # type: ignore[union-attr]
    await reader.query_rollouts()
    await reader.query_workers()
    await reader.query_attempts(ar.rollout_id)
    assert await reader.wait_for_rollouts(rollout_ids=[ar.rollout_id], timeout=0.3) == []
    with pytest.raises(PermissionError, match="sweep"):
        await reader.sweep()
    with pytest.raises(PermissionError, match="sweep"):
        await reader.sweep(all_runs=True)
    assert await _attempt_status(reader, ar.rollout_id) == "preparing"
    assert await writer.sweep() == 1


async def test_sweep_all_runs(backend, store_factory, clock):
    a = store_factory(run="a")
    ra = await a.start_rollout(1, config=TIMEOUT_RETRY)
    if backend.persistent:
        b = store_factory(run="b")
        rb = await b.start_rollout(1, config=TIMEOUT_RETRY)
        unbound = store_factory(run=None, create_run=False)
        clock.advance(11)
        assert await unbound.sweep(all_runs=True) == 2
        assert (await b.get_rollout_by_id(rb.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
        with pytest.raises(ValueError):
            await unbound.sweep()  # a single-run sweep needs a bound run
    else:
        clock.advance(11)
        assert await a.sweep(all_runs=True) == 1
    assert (await a.get_rollout_by_id(ra.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    assert await a.sweep(all_runs=True) == 0


async def test_postgres_sweep_skips_locked_rollouts_instead_of_waiting(pg_backend, clock):
    st = pg_backend.open(run="locks", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    conn = None
    try:
        busy = await st.start_rollout("busy", config=TIMEOUT_RETRY)
        free = await st.start_rollout("free", config=TIMEOUT_RETRY)
        clock.advance(11)
        conn = await asyncpg.connect(PG_URL)
        await conn.execute(f'SET search_path TO "{pg_backend.schema}"')
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", busy.rollout_id)
        # Another transaction holds the busy rollout's row: the sweep must not wait for it.
        assert await asyncio.wait_for(st.sweep(), timeout=20) == 1
        assert await _attempt_status(st, free.rollout_id) == "timeout"
        await tx.rollback()
        assert await st.sweep() == 1  # the skipped row is left to the next sweep
        assert await _attempt_status(st, busy.rollout_id) == "timeout"
    finally:
        if conn is not None:
            await conn.close()
        await st.close()
