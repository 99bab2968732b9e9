"""Queue control (docs/queue.md): priorities and retry back-off, on every backend, with the store clock."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import pytest
from pydantic import ValidationError

from lightning_sql import EnqueueRolloutRequest, RolloutConfig, SqlLightningStore
from tests.conftest import MULTIPROCESS_BACKENDS, BackendSpec
from tests.contract.test_queue_claims import assert_queue_invariant, drain, raw_rows

T0 = 1_800_000_000.0  # the fake clock's start (conftest)


# --- priorities ------------------------------------------------------------------------------


async def test_higher_priority_is_claimed_first_fifo_within_one(store: SqlLightningStore) -> None:
    plan = [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0), ("f", 10), ("g", -1)]
    ids = {}
    for name, priority in plan:
        ids[(await store.enqueue_rollout(name, priority=priority)).rollout_id] = name
    claimed = [ids[rid] for rid in await drain(store)]
    assert claimed == ["f", "b", "d", "a", "e", "c", "g"]


async def test_enqueue_many_takes_each_requests_priority_and_a_batch_claim_keeps_the_order(
    store: SqlLightningStore,
) -> None:
    requests = [EnqueueRolloutRequest(input=i, priority=i % 3) for i in range(9)]
    created = await store.enqueue_many_rollouts(requests)
    assert [r.priority for r in created] == [i % 3 for i in range(9)]
    claimed = await store.dequeue_many_rollouts(limit=9, worker_id="w")
    assert [ar.input for ar in claimed] == [2, 5, 8, 1, 4, 7, 0, 3, 6]
    assert [ar.priority for ar in claimed] == [2, 2, 2, 1, 1, 1, 0, 0, 0]


async def test_concurrent_claims_of_one_batch_take_the_head_in_priority_order(store_factory: Any) -> None:
    """Claims gathered into one batch: earlier calls get earlier rollouts of the priority order (no
    lazy sweep due, which would hold one call back behind it)."""
    store = store_factory(scan_debounce_seconds=3600)
    await store.dequeue_many_rollouts(limit=0)  # the instance's first sweep
    for i in range(6):
        await store.enqueue_rollout(i, priority=-i)  # enqueued lowest priority last
    for i in range(6, 9):
        await store.enqueue_rollout(i, priority=100)
    got = await asyncio.gather(*(store.dequeue_rollout(worker_id=f"w{k}") for k in range(9)))
    assert sorted(ar.input for ar in got if ar is not None) == list(range(9))
    if not store.dialect == "postgresql":  # one writer: the calls' batch takes the head in their order
        assert [ar.input for ar in got if ar is not None] == [6, 7, 8, 0, 1, 2, 3, 4, 5]


async def test_a_requeued_rollout_keeps_its_priority(store: SqlLightningStore) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    urgent = await store.enqueue_rollout("urgent", config=config, priority=3)
    claimed = await store.dequeue_rollout()
    assert claimed is not None and claimed.rollout_id == urgent.rollout_id
    await store.enqueue_rollout("early", priority=0)
    await store.update_attempt(urgent.rollout_id, claimed.attempt.attempt_id, status="failed")
    again = await store.dequeue_rollout()
    assert again is not None and again.rollout_id == urgent.rollout_id and again.priority == 3
    assert again.attempt.sequence_id == 2


async def test_update_rollout_reprioritises_a_queued_rollout(store: SqlLightningStore) -> None:
    first = await store.enqueue_rollout("first")
    second = await store.enqueue_rollout("second")
    updated = await store.update_rollout(second.rollout_id, priority=7)
    assert updated.priority == 7
    read = await store.get_rollout_by_id(second.rollout_id)
    assert read is not None and read.priority == 7
    assert await drain(store) == [second.rollout_id, first.rollout_id]


@pytest.mark.parametrize("bad", [True, 1.5, "1", 2**31, -(2**31) - 1])
async def test_a_bad_priority_is_refused_before_any_write(store: SqlLightningStore, bad: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        await store.enqueue_rollout("x", priority=bad)
    rollout = await store.enqueue_rollout("y")
    with pytest.raises((TypeError, ValueError)):
        await store.update_rollout(rollout.rollout_id, priority=bad)
    with pytest.raises(ValidationError):
        EnqueueRolloutRequest(input=1, priority=bad)
    assert (await store.query_rollouts()).total == 1


# --- retry back-off --------------------------------------------------------------------------

BACKOFF = RolloutConfig(
    max_attempts=5,
    retry_condition=["failed", "timeout", "unresponsive"],
    retry_backoff_seconds=10.0,
    retry_backoff_factor=3.0,
    retry_backoff_max_seconds=50.0,
)


async def _fail_latest(store: SqlLightningStore, rollout_id: str) -> None:
    await store.update_attempt(rollout_id, "latest", status="failed")


async def test_a_failed_attempt_requeues_with_back_off_on_the_store_clock(store: SqlLightningStore, clock: Any) -> None:
    """Delays 10, 30, 50 (capped), 50: not claimable before ``not_before``, claimable at it."""
    rollout = await store.enqueue_rollout("task", config=BACKOFF)
    expected = []
    for delay in (10.0, 30.0, 50.0, 50.0):
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.rollout_id == rollout.rollout_id
        assert claimed.not_before == (expected[-1] if expected else None)
        clock.advance(1.5)
        failed_at = clock()
        await _fail_latest(store, rollout.rollout_id)
        read = await store.get_rollout_by_id(rollout.rollout_id)
        assert read is not None and read.status == "requeuing"
        assert read.not_before == failed_at + delay
        expected.append(failed_at + delay)
        clock.set(failed_at + delay - 0.001)
        assert await store.dequeue_rollout(worker_id="w") is None
        assert not await store.wait_for_queue(timeout=0)
        clock.set(failed_at + delay)
        assert await store.wait_for_queue(timeout=0)
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None and claimed.attempt.sequence_id == 5
    await _fail_latest(store, rollout.rollout_id)  # the last attempt: failed for good, no delay written
    read = await store.get_rollout_by_id(rollout.rollout_id)
    assert read is not None and read.status == "failed" and read.not_before == expected[-1]


async def test_without_back_off_a_requeue_is_claimable_at_once(store: SqlLightningStore) -> None:
    for config in (
        RolloutConfig(max_attempts=2, retry_condition=["failed"]),
        RolloutConfig(max_attempts=2, retry_condition=["failed"], retry_backoff_seconds=0),
    ):
        rollout = await store.enqueue_rollout("task", config=config)
        await store.dequeue_rollout()
        await _fail_latest(store, rollout.rollout_id)
        again = await store.dequeue_rollout()
        assert again is not None and again.rollout_id == rollout.rollout_id and again.not_before is None


async def test_a_delayed_rollout_is_passed_over_and_keeps_its_place_when_due(store: SqlLightningStore, clock: Any) -> None:
    """Rollouts behind a delayed one are claimed; once due it is claimed in queue order again."""
    config = BACKOFF.model_copy(update={"retry_backoff_seconds": 100.0, "retry_backoff_max_seconds": None})
    delayed = await store.enqueue_rollout("delayed", config=config, priority=1)
    await store.dequeue_rollout()
    await _fail_latest(store, delayed.rollout_id)
    others = [await store.enqueue_rollout(i) for i in range(3)]
    assert (await store.dequeue_rollout()).rollout_id == others[0].rollout_id  # type: ignore[union-attr]
    clock.advance(100.0)
    # Due: its priority puts it ahead of the others again.
    assert await drain(store) == [delayed.rollout_id, others[1].rollout_id, others[2].rollout_id]


async def test_timed_out_and_unresponsive_attempts_requeue_with_back_off(store: SqlLightningStore, clock: Any) -> None:
    config = BACKOFF.model_copy(update={"timeout_seconds": 5.0})
    timed = await store.enqueue_rollout("timed", config=config)
    silent = await store.enqueue_rollout("silent", config=BACKOFF.model_copy(update={"unresponsive_seconds": 5.0}))
    await store.dequeue_many_rollouts(limit=2, worker_id="w")
    clock.advance(6.0)
    swept_at = clock()
    assert await store.sweep() == 2
    for rollout, status in ((timed, "timeout"), (silent, "unresponsive")):
        read = await store.get_rollout_by_id(rollout.rollout_id)
        assert read is not None and read.status == "requeuing" and read.attempt.status == status  # type: ignore[union-attr]
        assert read.not_before == swept_at + 10.0
    assert await store.dequeue_rollout() is None
    clock.advance(10.0)
    assert len(await store.dequeue_many_rollouts(limit=5)) == 2


async def test_a_requeue_by_hand_is_claimable_at_once(store: SqlLightningStore, clock: Any) -> None:
    rollout = await store.enqueue_rollout("task", config=BACKOFF)
    await store.dequeue_rollout()
    await _fail_latest(store, rollout.rollout_id)
    assert await store.dequeue_rollout() is None
    await store.update_rollout(rollout.rollout_id, status="queuing")  # a manual retry
    claimed = await store.dequeue_rollout()
    assert claimed is not None and claimed.rollout_id == rollout.rollout_id and claimed.not_before is None


async def test_a_waiter_is_woken_when_a_delayed_rollout_becomes_due(store: SqlLightningStore, clock: Any) -> None:
    rollout = await store.enqueue_rollout("task", config=BACKOFF)
    await store.dequeue_rollout()
    await _fail_latest(store, rollout.rollout_id)
    waiting = asyncio.ensure_future(store.wait_for_queue(timeout=20))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    clock.advance(10.0)
    started = time.monotonic()
    assert await asyncio.wait_for(waiting, timeout=10)
    assert time.monotonic() - started < 3.0  # its next look is at most WAIT_FALLBACK_POLL_S away
    assert (await store.dequeue_rollout()).rollout_id == rollout.rollout_id  # type: ignore[union-attr]


def test_back_off_settings_are_checked() -> None:
    for bad in ({"retry_backoff_seconds": -1}, {"retry_backoff_factor": 0.5}, {"retry_backoff_factor": 1000},
                {"retry_backoff_max_seconds": float("inf")}, {"retry_backoff_seconds": float("nan")}):
        with pytest.raises(ValidationError):
            RolloutConfig(**bad)


async def test_the_config_travels_with_the_rollout(store: SqlLightningStore) -> None:
    rollout = await store.enqueue_rollout("task", config=BACKOFF)
    read = await store.get_rollout_by_id(rollout.rollout_id)
    assert read is not None and read.config == BACKOFF == rollout.config


@pytest.mark.parametrize("backend", MULTIPROCESS_BACKENDS, indirect=True)
async def test_a_replayed_update_writes_the_back_off_decided_by_the_call(
    backend: BackendSpec, store_factory: Any, clock: Any
) -> None:
    """The first try fails on a held lock; the clock moves on before the replay; ``not_before`` is the
    call's time plus the delay, not the replay's."""
    # No lazy sweep due: on SQLite it would wait for the lock before the call decides its time.
    if backend.is_postgres:
        store = store_factory(connect_args={"server_settings": {"lock_timeout": "50ms"}}, scan_debounce_seconds=3600)
    else:
        store = store_factory(busy_timeout=0.05, scan_debounce_seconds=3600)
    rollout = await store.enqueue_rollout("task", config=BACKOFF)
    await store.dequeue_rollout()
    release, held = threading.Event(), threading.Event()

    async def hold_pg() -> None:
        import asyncpg

        conn = await asyncpg.connect(backend.url)
        try:
            async with conn.transaction():
                await conn.execute(
                    f'SELECT 1 FROM "{backend.schema}".rollouts WHERE rollout_id = $1 FOR UPDATE', rollout.rollout_id
                )
                held.set()
                await asyncio.to_thread(release.wait, 10)
        finally:
            await conn.close()

    def hold_sqlite() -> None:
        conn = sqlite3.connect(backend.url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(10)
        conn.execute("ROLLBACK")
        conn.close()

    holder = asyncio.ensure_future(hold_pg() if backend.is_postgres else asyncio.to_thread(hold_sqlite))
    assert await asyncio.to_thread(held.wait, 10)
    called_at = clock()
    update = asyncio.ensure_future(_fail_latest(store, rollout.rollout_id))
    await asyncio.sleep(0.3)  # the first tries fail while the lock is held
    assert not update.done()
    clock.advance(1000.0)
    release.set()
    await update
    await holder
    read = await store.get_rollout_by_id(rollout.rollout_id)
    assert read is not None and read.not_before == called_at + 10.0
    rows = await raw_rows(backend, f"SELECT not_before FROM rollouts WHERE rollout_id = '{rollout.rollout_id}'")
    assert rows == [(called_at + 10.0,)]
    await assert_queue_invariant(backend, store)


# --- the claim reads the heads of the two indexes --------------------------------------------


async def _queue_with_delayed(store: SqlLightningStore, clock: Any, delayed: int, queued: int) -> None:
    """``delayed`` rollouts in back-off (none due) behind ``queued`` claimable ones of mixed priorities."""
    config = BACKOFF.model_copy(update={"retry_backoff_seconds": 1000.0, "retry_backoff_max_seconds": None})
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, config=config) for i in range(delayed)])
    claimed = await store.dequeue_many_rollouts(limit=delayed)
    await asyncio.gather(*(_fail_latest(store, ar.rollout_id) for ar in claimed))
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, priority=i % 4) for i in range(queued)])


@pytest.mark.parametrize("backend", ["sqlite_file"], indirect=True)
async def test_sqlite_claim_searches_the_head_of_each_index(backend: BackendSpec, store: SqlLightningStore, clock: Any) -> None:
    from lightning_sql.store.sql import sqlite_batches
    from lightning_sql.store.sql.statements import compiled

    await _queue_with_delayed(store, clock, 50, 50)
    stmt = compiled("sqlite", None, "sqlite_claim_pick", sqlite_batches._pick)
    with sqlite3.connect(backend.url.removeprefix("sqlite:///")) as conn:
        plan = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + stmt.sql, stmt.positional({"run_id": 1, "limit": 4, "now": clock()}))]
    reads = [step for step in plan if "rollouts" in step]
    assert reads == [
        "SEARCH rollouts USING INDEX ix_rollouts_queue (run_id=?)",
        "SEARCH rollouts USING INDEX ix_rollouts_delayed (run_id=? AND not_before>? AND not_before<?)",
    ], plan


@pytest.mark.postgres
async def test_postgres_claim_reads_the_head_of_each_index(pg_backend: BackendSpec, clock: Any) -> None:
    """At a size where a scan would cost more, the claim statement reads the claimable index in its
    order and the delayed one only up to ``now``; the analysed run is planned the same way."""
    from tests.contract.test_pg_plans import _captured, _plan

    store = SqlLightningStore(pg_backend.url, **pg_backend.options(run="plans", clock=clock, clock_sync=False))
    try:
        await _queue_with_delayed(store, clock, 1000, 1000)
        sql, params = await _captured(store, "FOR UPDATE SKIP LOCKED", lambda: store.dequeue_rollout(worker_id="w"))
        for analyze in (False, True):
            nodes = await _plan(str(pg_backend.schema), sql, params, analyze=analyze)
            reads = {
                n["Index Name"]: str(n.get("Index Cond"))
                for n in nodes
                if n.get("Relation Name") == "rollouts" and n["Node Type"] != "ModifyTable" and "Index Name" in n
            }
            scans = [n["Node Type"] for n in nodes if n.get("Relation Name") == "rollouts" and "Index Name" not in n and n["Node Type"] != "ModifyTable"]
            assert scans == [], nodes
            assert "ix_rollouts_queue" in reads and "ix_rollouts_delayed" in reads, reads
            assert "not_before <=" in reads["ix_rollouts_delayed"], reads
            # The claimable head comes out of the index in queue order: no Sort below its LIMIT (a
            # Result node is the one-time check that the run is not paused).
            between = _below_the_limit(nodes, "ix_rollouts_queue")
            assert "LockRows" in between and "Sort" not in between, between
    finally:
        await store.close()


def _below_the_limit(nodes: list[dict[str, Any]], index: str) -> list[str]:
    """The node types between the scan of ``index`` and the nearest LIMIT above it."""
    parents = {id(child): node for node in nodes for child in node.get("Plans", [])}
    (scan,) = [n for n in nodes if n.get("Index Name") == index]
    between, node = [], parents[id(scan)]
    while node["Node Type"] != "Limit":
        between.append(node["Node Type"])
        node = parents[id(node)]
    return between


# --- cancel ------------------------------------------------------------------------------------


async def test_cancel_rollout_takes_a_queued_rollout_out_for_good(store: SqlLightningStore, clock: Any) -> None:
    keep = await store.enqueue_rollout("keep")
    gone = await store.enqueue_rollout("gone", priority=9)
    cancelled = await store.cancel_rollout(gone.rollout_id)
    assert cancelled.status == "cancelled" and cancelled.end_time == clock()
    assert await drain(store) == [keep.rollout_id]
    assert (await store.wait_for_rollouts(rollout_ids=[gone.rollout_id], timeout=0))[0].status == "cancelled"
    # Idempotent on a finished rollout; an unknown id is refused.
    clock.advance(5)
    again = await store.cancel_rollout(gone.rollout_id)
    assert again.status == "cancelled" and again.end_time == cancelled.end_time
    done = await store.update_attempt(keep.rollout_id, "latest", status="succeeded")
    assert done.status == "succeeded"
    assert (await store.cancel_rollout(keep.rollout_id)).status == "succeeded"
    with pytest.raises(ValueError, match="not found"):
        await store.cancel_rollout("ro-missing")


async def test_cancel_run_ends_queued_delayed_and_running_rollouts(store: SqlLightningStore, clock: Any) -> None:
    from lightning_sql.checker import check_invariants

    finished = await store.enqueue_rollout("finished")
    await store.dequeue_rollout()
    await store.update_attempt(finished.rollout_id, "latest", status="succeeded")
    delayed = await store.enqueue_rollout("delayed", config=BACKOFF)
    await store.dequeue_rollout()
    await _fail_latest(store, delayed.rollout_id)
    running = await store.enqueue_rollout("running")
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None and claimed.rollout_id == running.rollout_id
    await store.update_attempt(running.rollout_id, claimed.attempt.attempt_id, status="running", metadata={"step": 3})
    queued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(3)])

    assert await store.cancel_run() == 5
    statuses = {r.rollout_id: r.status for r in await store.query_rollouts()}
    assert statuses.pop(finished.rollout_id) == "succeeded"
    assert set(statuses.values()) == {"cancelled"} and len(statuses) == 5
    attempt = await store.get_latest_attempt(running.rollout_id)
    assert attempt is not None and attempt.status == "failed" and attempt.end_time == clock()
    assert attempt.metadata == {"step": 3, "error": {"type": "cancelled", "message": "the rollout was cancelled", "traceback": ""}}
    clock.advance(1000)  # the back-off is over: still nothing to claim
    assert await store.dequeue_many_rollouts(limit=10) == []
    assert not await store.wait_for_queue(timeout=0)
    assert [r.rollout_id for r in queued if r.rollout_id in statuses] == [r.rollout_id for r in queued]
    assert await check_invariants(store) == []
    assert await store.cancel_run() == 0


async def test_a_running_agent_is_stopped_at_its_next_heartbeat(store_factory: Any) -> None:
    from lightning_sql import LitAgentRunner
    from tests.runtime.test_leases import BlockingAgent

    store = store_factory()
    rollout = await store.enqueue_rollout({"x": 1})
    agent = BlockingAgent()
    runner: Any = LitAgentRunner(max_rollouts=1, poll_interval=0.2, heartbeat_interval=0.2, interval_jitter=0.0)
    runner.init(agent)
    runner.init_worker(0, store)
    task = asyncio.ensure_future(runner.iter())
    await asyncio.wait_for(agent.started.wait(), 30)
    started = time.monotonic()
    await store.cancel_rollout(rollout.rollout_id)
    for _ in range(200):
        if agent.cancelled:
            break
        await asyncio.sleep(0.05)
    assert agent.cancelled == 1 and time.monotonic() - started < 5.0
    await asyncio.wait_for(task, 30)  # max_rollouts=1: the abandoned attempt was its one rollout
    attempt = await store.get_latest_attempt(rollout.rollout_id)
    assert attempt is not None and attempt.status == "failed" and attempt.metadata["error"]["type"] == "cancelled"
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "cancelled"  # type: ignore[union-attr]
    assert runner.completed_rollouts == 0  # not reported: the cancel ended the attempt


# --- pause, drain, resume -------------------------------------------------------------------


async def test_a_paused_run_claims_nothing_and_in_flight_attempts_finish(
    store_factory: Any, backend: BackendSpec
) -> None:
    store = store_factory()
    other = store_factory() if backend.persistent else store  # another "host" on the same database
    running = await store.enqueue_rollout("running")
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None
    queued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(3)])
    run = await store.pause_run()
    assert run.paused and (await other.get_run(run.name)).paused  # type: ignore[union-attr]
    assert await other.dequeue_rollout(worker_id="w2") is None
    assert await other.dequeue_many_rollouts(limit=5) == []
    assert not await other.wait_for_queue(timeout=0)
    assert not await store.wait_for_drain(timeout=0.2)  # the claimed attempt is still in flight
    done = await other.update_attempt(running.rollout_id, claimed.attempt.attempt_id, status="succeeded")
    assert done.status == "succeeded"
    assert await store.wait_for_drain(timeout=5)
    assert (await store.statistics())["queue_depth"] == 3
    assert (await store.pause_run()).paused  # idempotent
    resumed = await store.resume_run()
    assert not resumed.paused
    assert await drain(other) == [r.rollout_id for r in queued]


async def test_resume_wakes_a_waiting_claimer(store: SqlLightningStore) -> None:
    await store.enqueue_rollout("task")
    await store.pause_run()
    waiting = asyncio.ensure_future(store.wait_for_queue(timeout=20))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    started = time.monotonic()
    await store.resume_run()
    assert await asyncio.wait_for(waiting, timeout=10)
    assert time.monotonic() - started < 3.0
    assert await store.dequeue_rollout() is not None


async def test_a_drain_waiter_returns_when_the_last_attempt_ends(store: SqlLightningStore) -> None:
    assert await store.wait_for_drain(timeout=0)  # nothing in flight
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(2)])
    claimed = await store.dequeue_many_rollouts(limit=2)
    await store.pause_run()
    draining = asyncio.ensure_future(store.wait_for_drain(timeout=20))
    await store.update_attempt(claimed[0].rollout_id, "latest", status="succeeded")
    await asyncio.sleep(0.3)
    assert not draining.done()
    await store.update_attempt(claimed[1].rollout_id, "latest", status="failed")
    assert await asyncio.wait_for(draining, timeout=10)
    with pytest.raises(TypeError):
        await store.wait_for_drain(timeout="1")  # type: ignore[arg-type]
