"""Contract §2.12 (wait_for_rollouts) and §4 wait_for_queue: results, timeouts, prompt wake-ups.

Latency bounds separate mechanisms, they are not benchmarks: a same-process finish wakes a waiter
through the in-process signal, a finish in another process through NOTIFY (PostgreSQL) or
``PRAGMA data_version`` polling (SQLite); both are well under the ~1 s polling fallback.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import uuid
from typing import Any

import pytest

from lightning_sql import Rollout, SqlLightningStore
from tests.helpers import pg_execute

# Wake-up bound that separates a signal, NOTIFY or SQLite's ~50 ms data_version poll (milliseconds)
# from the 1 s polling fallback: each test finishes the rollout 0.1 s (another process: 0.3 s, its
# LISTEN or poll is set up) into the waiter's 1 s fallback cycle, so a fallback wake would come at
# least 0.6 s after the finish, and several rounds must all pass.
WAKE_BOUND_S = 0.5
# How long the waiter is left idle in its wait before the finish (same process: its in-process
# signal needs no set-up).
IDLE_BEFORE_FINISH_S = 0.1


async def _finished(store, status: str = "succeeded") -> Rollout:
    r = await store.enqueue_rollout(1)
    await store.update_rollout(r.rollout_id, status=status)
    return r


async def _in_flight(store) -> str:
    return (await store.start_rollout(1)).rollout_id


async def test_returns_finished_in_id_order_and_omits_unknown(store):
    a = await _finished(store, "succeeded")
    b = await _finished(store, "failed")
    c = await _finished(store, "cancelled")
    t0 = time.monotonic()
    got = await store.wait_for_rollouts(rollout_ids=[c.rollout_id, "ro-unknown", a.rollout_id, b.rollout_id])
    assert time.monotonic() - t0 < 2.0  # never waits for unknown ids, even with timeout=None
    assert [r.rollout_id for r in got] == [c.rollout_id, a.rollout_id, b.rollout_id]
    assert all(type(r) is Rollout for r in got)
    assert [r.status for r in got] == ["cancelled", "succeeded", "failed"]
    assert await store.wait_for_rollouts(rollout_ids=["ro-unknown"]) == []
    assert await store.wait_for_rollouts(rollout_ids=[]) == []


async def test_non_positive_timeout_is_one_read(store):
    done = await _finished(store)
    pending = await _in_flight(store)
    for timeout in (0, -1, 0.0):
        t0 = time.monotonic()
        got = await store.wait_for_rollouts(rollout_ids=[pending, done.rollout_id], timeout=timeout)
        assert [r.rollout_id for r in got] == [done.rollout_id]
        assert time.monotonic() - t0 < 1.0


async def test_short_timeout_is_honoured(store):
    pending = await _in_flight(store)
    await store.wait_for_rollouts(rollout_ids=[pending], timeout=0)  # warm-up: schema, run
    t0 = time.monotonic()
    assert await store.wait_for_rollouts(rollout_ids=[pending], timeout=0.1) == []
    elapsed = time.monotonic() - t0
    assert 0.09 <= elapsed < 0.8, elapsed  # well under the 1 s fallback poll


async def test_return_when_first_and_all(store):
    a = await _in_flight(store)
    b = await _in_flight(store)
    c = await _in_flight(store)
    first = asyncio.create_task(
        store.wait_for_rollouts(rollout_ids=[a, b, c], timeout=30, return_when="first")
    )
    every = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[a, b, c], timeout=30))
    await asyncio.sleep(0.2)
    assert not first.done() and not every.done()
    await store.update_attempt(b, "latest", status="succeeded")
    got = await asyncio.wait_for(first, 5)
    assert [r.rollout_id for r in got] == [b]
    await asyncio.sleep(0.2)
    assert not every.done()
    await store.update_rollout(a, status="cancelled")
    await store.update_attempt(c, "latest", status="failed")
    got = await asyncio.wait_for(every, 5)
    assert [(r.rollout_id, r.status) for r in got] == [(a, "cancelled"), (b, "succeeded"), (c, "failed")]
    # "first" on already-finished ids returns every finished one at once.
    got = await store.wait_for_rollouts(rollout_ids=[c, a, "ro-x"], timeout=5, return_when="first")
    assert [r.rollout_id for r in got] == [c, a]


async def test_timeout_returns_what_finished(store):
    a = await _in_flight(store)
    b = await _in_flight(store)
    await store.update_attempt(a, "latest", status="succeeded")
    got = await store.wait_for_rollouts(rollout_ids=[a, b], timeout=0.3)
    assert [r.rollout_id for r in got] == [a]


async def test_bad_return_when(store):
    with pytest.raises(ValueError, match="return_when"):
        await store.wait_for_rollouts(rollout_ids=["x"], return_when="any")


async def _measure_same_process_wake(waiter, finisher, rid: str, finish) -> float:
    task = asyncio.create_task(waiter.wait_for_rollouts(rollout_ids=[rid], timeout=10))
    await asyncio.sleep(IDLE_BEFORE_FINISH_S)  # the waiter is registered and idle in its wait
    assert not task.done()
    await finish(finisher, rid)
    t_finished = time.monotonic()  # committed (the call returned); the signal fired on commit
    got = await task
    elapsed = time.monotonic() - t_finished
    assert [r.rollout_id for r in got] == [rid]
    return elapsed


async def test_wakes_promptly_on_finish_in_same_process(store):
    waiter = other = store
    rids = [await _in_flight(waiter) for _ in range(3)]

    async def by_attempt(s, rid):
        await s.update_attempt(rid, "latest", status="succeeded")

    async def by_rollout(s, rid):
        await s.update_rollout(rid, status="failed")

    elapsed = [
        await _measure_same_process_wake(waiter, other, rids[0], by_attempt),
        await _measure_same_process_wake(waiter, other, rids[1], by_rollout),
        await _measure_same_process_wake(waiter, other, rids[2], by_attempt),
    ]
    assert max(elapsed) < WAKE_BOUND_S, elapsed


async def test_wakes_promptly_when_another_instance_finishes(persistent_backend, clock):
    # Two instances on one database and run in this process (they share the process's I/O thread).
    waiter = persistent_backend.open(run="wake", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    finisher = persistent_backend.open(run="wake", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    try:
        rids = [(await finisher.start_rollout(i)).rollout_id for i in range(2)]

        async def finish(s, rid):
            await s.update_attempt(rid, "latest", status="succeeded")

        elapsed = [await _measure_same_process_wake(waiter, finisher, rid, finish) for rid in rids]
        assert max(elapsed) < WAKE_BOUND_S, elapsed
    finally:
        await waiter.close()
        await finisher.close()


async def test_cancelling_a_wait_is_prompt_and_unregisters(store):
    rid = await _in_flight(store)
    task = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[rid]))
    await asyncio.sleep(0.2)
    worker = store._worker
    assert worker.hub.has_waiters
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - t0 < 1.0
    assert not worker.hub.has_waiters


# --- another OS process finishes the rollout -----------------------------------------------------


def _finisher_child(url: str, options: dict[str, Any], rollout_ids: list[str], ready, go, times) -> None:
    async def main() -> None:
        store = SqlLightningStore(url, **options)
        try:
            await store.statistics()  # warm up: connect, schema check, run binding
            await store.get_latest_attempt(rollout_ids[0])
            ready.set()
            for rid in rollout_ids:
                while not go.wait(0.05):
                    pass
                go.clear()
                t_before = time.time()
                await store.update_attempt(rid, "latest", status="succeeded")
                times.put((rid, t_before, time.time()))
        finally:
            await store.close()

    asyncio.run(main())


async def test_wakes_when_another_process_finishes(mp_backend, clock):
    store = mp_backend.open(run="xproc", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    ctx = mp.get_context("spawn")
    ready, go, times = ctx.Event(), ctx.Event(), ctx.Queue()
    try:
        rids = [(await store.start_rollout(i)).rollout_id for i in range(3)]
        options = mp_backend.options(run="xproc", clock=clock, clock_sync=False, scan_debounce_seconds=0)
        child = ctx.Process(target=_finisher_child, args=(mp_backend.url, options, rids, ready, go, times))
        child.start()
        try:
            assert await asyncio.to_thread(ready.wait, 60), "child did not start"
            latencies = []
            for rid in rids:
                task = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[rid], timeout=10))
                await asyncio.sleep(0.3)
                assert not task.done()
                go.set()
                got = await task
                t_wake = time.time()
                assert [r.rollout_id for r in got] == [rid]
                child_rid, t_before, t_after = await asyncio.to_thread(times.get, True, 10)
                assert child_rid == rid
                # From the moment the finish was committed and returned in the child; several
                # rounds, so a 1 s polling fallback could not pass by luck (0.8 ** 3).
                latencies.append(t_wake - t_after)
            assert max(latencies) < WAKE_BOUND_S, latencies
        finally:
            await asyncio.to_thread(child.join, 30)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
    finally:
        await store.close()


# --- wait_for_queue -----------------------------------------------------------------------------


async def test_wait_for_queue(store):
    assert await store.wait_for_queue(0) is False
    t0 = time.monotonic()
    assert await store.wait_for_queue(0.1) is False
    assert 0.09 <= time.monotonic() - t0 < 0.8
    r = await store.enqueue_rollout(1)
    t0 = time.monotonic()
    assert await store.wait_for_queue(5) is True
    assert await store.wait_for_queue(0) is True
    assert time.monotonic() - t0 < 1.0
    # Claims nothing, writes nothing.
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "queuing"
    assert (await store.statistics())["queue_depth"] == 1
    with pytest.raises(TypeError, match="timeout"):
        await store.wait_for_queue(None)


async def test_wait_for_queue_wakes_on_enqueue_and_requeue(store):
    task = asyncio.create_task(store.wait_for_queue(10))
    await asyncio.sleep(IDLE_BEFORE_FINISH_S)
    assert not task.done()
    await store.enqueue_rollout(1)
    t0 = time.monotonic()
    assert await task is True
    assert time.monotonic() - t0 < WAKE_BOUND_S
    # Empty the queue, then re-enter it through update_rollout.
    ar = await store.dequeue_rollout()
    assert await store.wait_for_queue(0) is False
    task = asyncio.create_task(store.wait_for_queue(10))
    await asyncio.sleep(IDLE_BEFORE_FINISH_S)
    assert not task.done()
    await store.update_rollout(ar.rollout_id, status="requeuing")
    t0 = time.monotonic()
    assert await task is True
    assert time.monotonic() - t0 < WAKE_BOUND_S


async def test_wait_for_queue_cancel(store):
    task = asyncio.create_task(store.wait_for_queue(30))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not store._worker.hub.has_waiters


async def test_fallback_polls_sweep_expired_leases(store, clock):
    from lightning_sql import RolloutConfig

    ar = await store.start_rollout(1, config=RolloutConfig(timeout_seconds=10))
    task = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[ar.rollout_id], timeout=10))
    await asyncio.sleep(0.2)
    assert not task.done()
    clock.advance(11)  # the runner "died": nobody else calls the store
    t0 = time.monotonic()
    got = await task
    assert [(r.rollout_id, r.status) for r in got] == [(ar.rollout_id, "failed")]
    assert time.monotonic() - t0 < 5.0  # one fallback poll (~1 s), not the 10 s timeout
    assert (await store.get_latest_attempt(ar.rollout_id)).status == "timeout"


async def test_stores_on_other_postgres_schemas_do_not_wake_each_other(pg_backend, clock):
    """PostgreSQL: each schema has a NOTIFY channel of its own.  The payloads name a run by its id,
    which is only unique in its schema: on one shared channel, every event of a store on another
    schema of the database woke this store's waiters of the run with the same id."""
    import asyncpg

    other_schema = f"t_{uuid.uuid4().hex[:12]}"
    here = pg_backend.open(run="wake", clock=clock, clock_sync=False)
    pad = SqlLightningStore(pg_backend.url, schema=other_schema, run="pad", clock=clock, clock_sync=False)
    there = SqlLightningStore(pg_backend.url, schema=other_schema, run="other", clock=clock, clock_sync=False)
    woken: list[int | None] = []
    try:
        await pad.statistics()  # run 1 of the other schema: "other" is run 2, "wake" run 1 here
        await there.statistics()
        await here.statistics()
        worker = here._worker
        real_wake = worker.hub.wake

        def wake(run_id: int | None = None) -> None:
            woken.append(run_id)
            real_wake(run_id)

        worker.hub.wake = wake
        marker = await asyncpg.connect(pg_backend.url.replace("postgresql+asyncpg://", "postgresql://"))
        try:

            async def notify_here() -> None:  # delivered by the listener only (no local wake)
                await marker.execute("SELECT pg_notify($1, '1:marker')", worker.notify_channel)

            # The listener connects in the background: notify until one arrives.
            deadline = time.monotonic() + 10
            while 1 not in woken:
                assert time.monotonic() < deadline, "the listener never heard this schema's channel"
                await notify_here()
                await asyncio.sleep(0.05)
            woken.clear()
            await there.enqueue_rollout(1)  # NOTIFY "2:queued" on the other schema's channel
            await notify_here()  # committed after it: delivered after it to a listener of both
            await _until(lambda: 1 in woken, 10)
        finally:
            await marker.close()
        assert 2 not in woken, woken
    finally:
        for store in (here, pad, there):
            await store.close()
        await pg_execute(pg_backend.url, f'DROP SCHEMA IF EXISTS "{other_schema}" CASCADE')


async def _until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_notify_channels_fit_postgres_identifiers():
    from lightning_sql.store.sql.executor import NOTIFY_CHANNEL, notify_channel

    assert notify_channel(None) == NOTIFY_CHANNEL  # the default schema keeps the channel of old
    assert notify_channel("tenant_a") == f"{NOTIFY_CHANNEL}:tenant_a"
    long_a, long_b = "a" * 63, "a" * 62 + "b"  # the longest schema names PostgreSQL keeps
    channels = {notify_channel(long_a), notify_channel(long_b), notify_channel("é" * 31)}
    assert len(channels) == 3 and all(len(c.encode()) <= 63 for c in channels)
