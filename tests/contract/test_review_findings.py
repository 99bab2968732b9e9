"""Findings of an independent review of the store against the contract (every backend).

Each test pins one deviation that the rest of the contract suite did not catch; its docstring names
the rule.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import pytest

from lightning_sql import EnqueueRolloutRequest, RolloutConfig, SqlLightningStore, StoreUnavailableError
from tests.contract.test_spans import real_otel_span

# Ids a read can never match (§0.4: "a read whose id ... contains one matches nothing"): a NUL
# character, a lone surrogate, and an id longer than any stored id may be.
UNSTORABLE_IDS = ["at-\x00x", "at-\ud800", "at-" + "x" * 5000]

# --- §0.6 / §2.7: the resolution order holds for every attempt id ------------------------------


@pytest.mark.parametrize("bad", UNSTORABLE_IDS, ids=["nul", "surrogate", "too-long"])
@pytest.mark.parametrize("method", ["update_attempt", "touch_attempt"])
async def test_resolution_order_holds_for_unstorable_attempt_ids(store, method, bad):
    """§2.7: rollout missing → "Rollout <rid> not found"; no attempts → "No attempts found for rollout
    <rid>" (also for a concrete attempt id); only then "Attempt <aid> not found ...".  An attempt id
    that cannot exist in the database is a concrete id that matches nothing, not a reason to skip the
    first two checks."""

    async def call(rid: str) -> object:
        if method == "update_attempt":
            return await store.update_attempt(rid, bad, status="running")
        return await store.touch_attempt(rid, bad)

    with pytest.raises(ValueError) as e:
        await call("ro-missing")
    assert str(e.value) == "Rollout ro-missing not found"
    queued = await store.enqueue_rollout(1)
    with pytest.raises(ValueError) as e:
        await call(queued.rollout_id)
    assert str(e.value) == f"No attempts found for rollout {queued.rollout_id}"
    ar = await store.start_rollout(1)
    with pytest.raises(ValueError) as e:
        await call(ar.rollout_id)
    assert str(e.value) == f"Attempt {bad} not found for rollout {ar.rollout_id}"
    assert (await store.get_latest_attempt(ar.rollout_id)).status == "preparing"  # nothing written


@pytest.mark.parametrize("bad", UNSTORABLE_IDS, ids=["nul", "surrogate", "too-long"])
async def test_add_otel_span_validates_the_rollout_before_the_attempt(store, bad):
    """§2.9 add_otel_span: "validate rollout and attempt first" in that order (§0.6 messages)."""
    with pytest.raises(ValueError) as e:
        await store.add_otel_span("ro-missing", bad, real_otel_span())
    assert str(e.value) == "Rollout ro-missing not found"
    ar = await store.start_rollout(1)
    with pytest.raises(ValueError) as e:
        await store.add_otel_span(ar.rollout_id, bad, real_otel_span())
    assert str(e.value) == f"Attempt {bad} not found for rollout {ar.rollout_id}"
    # A failure consumes no sequence number.
    assert await store.get_next_span_sequence_id(ar.rollout_id, ar.attempt.attempt_id) == 1


# --- §2.15 / §2 [sweeps]: every listed call sweeps, whatever its arguments ----------------------

TIMEOUT_RETRY = RolloutConfig(timeout_seconds=10, max_attempts=3, retry_condition=["timeout"])

SHORT_CIRCUIT_SWEEPING_CALLS = {
    "enqueue_many_rollouts([])": lambda st: st.enqueue_many_rollouts([]),
    "wait_for_rollouts(rollout_ids=[])": lambda st: st.wait_for_rollouts(rollout_ids=[], timeout=0),
    "wait_for_rollouts(unstorable ids)": lambda st: st.wait_for_rollouts(rollout_ids=["ro-\x00"], timeout=0),
    "get_rollout_by_id(unstorable id)": lambda st: st.get_rollout_by_id("ro-\x00"),
    "get_latest_attempt(unstorable id)": lambda st: st.get_latest_attempt("ro-\x00"),
}


@pytest.mark.parametrize("call", sorted(SHORT_CIRCUIT_SWEEPING_CALLS))
async def test_sweeping_calls_sweep_even_when_they_have_nothing_else_to_do(store, clock, call):
    """[sweeps]: "the debounced sweeper runs at the start of the call, so its result already reflects
    expired leases" -- also for a call whose own work is empty (the way dequeue_many_rollouts(limit=0)
    already does it)."""
    leased = await store.start_rollout("leased", config=TIMEOUT_RETRY)
    clock.advance(11)
    await SHORT_CIRCUIT_SWEEPING_CALLS[call](store)
    assert await store.sweep() == 0  # the call itself swept
    assert (await store.get_rollout_by_id(leased.rollout_id)).status == "requeuing"


# --- §4 close(): "release this instance's waiters" -----------------------------------------------

# Far below the waits' own timeouts (600 s): a released waiter ends within it, a forgotten one never.
RELEASE_BOUND_S = 20.0


def _start_wait(st: SqlLightningStore, rollout_id: str, wait: str) -> asyncio.Task[object]:
    """A task running one long wait of ``st`` (only the coroutine asked for is created)."""
    if wait == "wait_for_rollouts":
        return asyncio.create_task(st.wait_for_rollouts(rollout_ids=[rollout_id], timeout=600))
    return asyncio.create_task(st.wait_for_queue(timeout=600))


@pytest.mark.parametrize("wait", ["wait_for_rollouts", "wait_for_queue"])
async def test_close_releases_this_instances_waiters(backend, store_factory, wait):
    """§4 close: "release this instance's waiters and its hold on its I/O thread".  A wait in progress
    on the closed instance ends (RuntimeError) even while other instances keep the I/O thread alive;
    the other instances' waits go on, and the closed instance reattaches lazily afterwards."""
    st = store_factory()
    ar = await st.start_rollout(1)  # in flight: neither finished nor queued, so both waits block
    others = [store_factory() for _ in range(1 if backend.persistent else 0)]
    other_waits = [_start_wait(o, ar.rollout_id, wait) for o in others]
    for o in others:
        await o.statistics()
    waiter = _start_wait(st, ar.rollout_id, wait)
    await asyncio.sleep(0.3)
    assert not waiter.done()
    t0 = time.monotonic()
    await st.close()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(waiter, timeout=RELEASE_BOUND_S)
    assert time.monotonic() - t0 < RELEASE_BOUND_S
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in other_waits)  # other instances' waiters are not released
    for t in other_waits:
        t.cancel()
    await asyncio.gather(*other_waits, return_exceptions=True)
    if backend.persistent:  # reattaches lazily, and a new wait works again
        await st.update_rollout(ar.rollout_id, status="succeeded")
        assert [r.rollout_id for r in await st.wait_for_rollouts(rollout_ids=[ar.rollout_id], timeout=5)] == [
            ar.rollout_id
        ]


# --- §0.3 / §4: an unopenable database fails at once with StoreUnavailableError -------------------


@pytest.mark.parametrize(
    "scheme",
    [
        "sqlite",
        "sqlite+aiosqlite",
    ],
)
async def test_unopenable_sqlite_database_raises_store_unavailable_at_once(tmp_path, scheme):
    """§0.3: "at once for a failure that retrying cannot cure (authentication, unknown database), the
    call raises StoreUnavailableError (§4) naming the masked URL and the driver's reason"."""
    url = f"{scheme}:///{tmp_path / 'no' / 'such' / 'dir' / 'store.db'}"
    st = SqlLightningStore(url, run="r", connect_deadline_seconds=30)
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError) as info:
            await st.enqueue_many_rollouts([EnqueueRolloutRequest(input=1)])
        assert "store.db" in str(info.value)
        assert isinstance(info.value, ConnectionError)
    finally:
        await st.close()
    assert time.monotonic() - t0 < 10  # not retried until the 30 s deadline


# --- §2.15: the sweeper re-checks its conditions on the rows it changes -------------------------

# In-flight rollouts (with a lease far from expiring) that every sweep must read: they make the
# sweep's candidate statement last long enough for a heartbeat to commit while it runs.
SWEEP_FILLER = int(os.environ.get("LIGHTNING_SQL_REVIEW_SWEEP_FILLER", "4000"))
SWEEP_ROUNDS = int(os.environ.get("LIGHTNING_SQL_REVIEW_SWEEP_ROUNDS", "20"))


async def test_sweep_never_expires_an_attempt_whose_heartbeat_committed_before_its_verdict(store, clock):
    """§2.15: "a few set-based statements in one transaction, each re-checking its conditions on the
    rows it changes (rollout still in flight, attempt still latest, limit still exceeded)"; D13: a
    heartbeat (touch_attempt) keeps a lease alive.

    A sweep races a touch_attempt on an attempt whose lease expired.  Either order is legal, but the
    outcome must match one: touch first → the sweep sees the fresh heartbeat and leaves the attempt
    alone; sweep first → touch_attempt returns the attempt already ``unresponsive``.  A touch that
    returned a live attempt followed by an ``unresponsive`` verdict at the same store time means the
    sweep judged a heartbeat older than one that had committed before it locked the row (PostgreSQL:
    its candidate SELECT's snapshot predates the heartbeat and the UPDATE did not re-check)."""
    far = RolloutConfig(timeout_seconds=1e9)
    for start in range(0, SWEEP_FILLER, 1000):
        count = min(1000, SWEEP_FILLER - start)
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i, config=far) for i in range(count)])
        assert len(await store.dequeue_many_rollouts(limit=count)) == count
    t0 = time.monotonic()
    await store.sweep()
    sweep_s = time.monotonic() - t0
    rng = random.Random(1234)
    contradictions = []
    for i in range(SWEEP_ROUNDS):
        ar = await store.start_rollout(i, config=RolloutConfig(unresponsive_seconds=10))
        clock.advance(11)  # expired: no heartbeat for 11 s > 10 s

        async def touch(rollout_id: str = ar.rollout_id) -> Any:
            await asyncio.sleep(rng.uniform(0, sweep_s))  # land anywhere inside the sweep
            return await store.touch_attempt(rollout_id, "latest")

        _, touched = await asyncio.gather(store.sweep(), touch())
        final = await store.get_latest_attempt(ar.rollout_id)
        assert final.last_heartbeat_time == clock()
        if touched.status != "unresponsive" and final.status == "unresponsive":
            contradictions.append(i)
        # Whatever happened, the rollout follows its latest attempt's verdict.
        rollout = await store.get_rollout_by_id(ar.rollout_id)
        assert rollout.status == ("failed" if final.status == "unresponsive" else "preparing")
        await store.update_rollout(ar.rollout_id, status="cancelled")
    assert contradictions == []


# --- §0.3 processes: a forked child starts fresh, even when forked in the middle of a sweep -------


def _child_sweeps_lazily(store: SqlLightningStore, clock: Any, out: Any) -> None:
    async def main() -> None:
        ar = await store.start_rollout("child", config=RolloutConfig(timeout_seconds=10))
        clock.advance(11)
        got = await store.get_rollout_by_id(ar.rollout_id)  # [sweeps]: debounce 0, so it sweeps
        out.put(got.status)

    asyncio.run(main())


async def _hold_write_lock(backend: Any) -> Any:
    """Block the store's writers from outside it; returns a release coroutine function."""
    if backend.is_postgres:
        import asyncpg

        from tests.helpers import _dsn

        conn = await asyncpg.connect(_dsn(backend.url))
        tx = conn.transaction()
        await tx.start()
        await conn.execute(f'LOCK TABLE "{backend.schema}".rollouts IN ACCESS EXCLUSIVE MODE')

        async def release() -> None:
            await tx.rollback()
            await conn.close()

        return release
    # Another process holds the lock: a connection of this process would be inherited by the fork
    # with its lock (SQLite's in-process lock table), which is a hazard of the test, not the store.
    import subprocess
    import sys

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE')\n"
            "print('locked', flush=True)\n"
            "sys.stdin.readline()\n",
            backend.url.split("///", 1)[1],
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    assert (await asyncio.to_thread(holder.stdout.readline)).strip() == "locked"

    async def release_sqlite() -> None:
        assert holder.stdin is not None
        holder.stdin.write("release\n")  # not EOF: the forked child holds the pipe open too
        holder.stdin.flush()
        await asyncio.to_thread(holder.wait, 30)
        holder.stdin.close()

    return release_sqlite


async def test_child_forked_during_a_sweep_still_sweeps(mp_backend, clock):
    """§0.3: "in a forked child its first call discards the inherited thread and connections ... and
    starts fresh"; §2.15: [sweeps] calls sweep (debounce 0: every call).  A fork taken while the
    parent's instance is inside a lazy sweep (its task awaiting the unit) must not leave the child's
    copy believing a sweep is still running: the child's own calls must keep sweeping."""
    import multiprocessing as mp

    store = mp_backend.open(run="fork-sweep", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    release = None
    try:
        leased = await store.start_rollout("parent", config=RolloutConfig(timeout_seconds=10))
        clock.advance(11)
        release = await _hold_write_lock(mp_backend)
        parent_call = asyncio.create_task(store.get_rollout_by_id(leased.rollout_id))  # sweeps: blocked
        await asyncio.sleep(0.5)
        assert not parent_call.done()
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_sweeps_lazily, args=(store, clock, out))
        child.start()
        await release()
        release = None
        assert (await asyncio.wait_for(parent_call, 60)).status == "failed"  # the parent's sweep ran
        status = await asyncio.to_thread(out.get, True, 90)
        await asyncio.to_thread(child.join, 30)
        assert child.exitcode == 0
        assert status == "failed"  # the child's own call swept its expired lease
    finally:
        if release is not None:
            await release()
        await store.close()
