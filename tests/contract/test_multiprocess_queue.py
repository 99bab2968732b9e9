"""Queue control across OS processes (docs/queue.md): 4 spawned processes x 8 claimers drain a queue of
mixed priorities, and every claim honours the queue order up to the claims running at the same time.

Size knob: ``LIGHTNING_SQL_TEST_MP_QUEUE_ROLLOUTS`` (default 800 queued rollouts).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue as queue_mod
import random
import time
import traceback
from typing import Any

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore

N_PROCESSES = 4
CLAIMERS_PER_PROCESS = 8
N_ROLLOUTS = int(os.environ.get("LIGHTNING_SQL_TEST_MP_QUEUE_ROLLOUTS", "800"))
CHILD_DEADLINE_S = 300.0


def _claim_in_child(index: int, url: str, options: dict[str, Any], barrier: Any, results: Any) -> None:
    try:
        results.put((index, asyncio.run(_claim_all(index, url, options, barrier)), None))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((index, [], traceback.format_exc()))


async def _claim_all(index: int, url: str, options: dict[str, Any], barrier: Any) -> list[tuple[int, float, float]]:
    """The process's claims: (the rollout's input, the call's start and end on the machine's monotonic clock)."""
    store = SqlLightningStore(url, **options)
    try:
        await store.statistics()
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)

        async def claimer(worker: str) -> list[tuple[int, float, float]]:
            mine = []
            while True:
                started = time.monotonic()
                ar = await store.dequeue_rollout(worker_id=worker)
                if ar is None:
                    return mine
                mine.append((ar.input, started, time.monotonic()))

        batches = await asyncio.gather(*(claimer(f"P{index}-W{i}") for i in range(CLAIMERS_PER_PROCESS)))
        return [item for batch in batches for item in batch]
    finally:
        await store.close()


def order_violations(claims: list[tuple[tuple[int, int], float, float]]) -> list[str]:
    """Claims of a later rollout in queue order (``rank``) that ENDED before the claim of an earlier
    one STARTED: that earlier rollout was queued and locked by nobody, so it had to be taken first."""
    ordered = sorted(claims)
    violations, later_min_end, later = [], float("inf"), None
    for rank, started, ended in reversed(ordered):
        if later is not None and started > later_min_end:
            violations.append(f"{rank} claimed from {started:.4f}, after {later} was claimed by {later_min_end:.4f}")
        if ended < later_min_end:
            later_min_end, later = ended, rank
    return violations


def test_order_violations_finds_a_claim_out_of_order() -> None:
    """The checker itself: a lower-priority claim that ended before a higher one began is reported."""
    assert order_violations([((0, 0), 0.0, 1.0), ((1, 1), 0.5, 2.0)]) == []  # overlapping: allowed
    assert len(order_violations([((0, 0), 3.0, 4.0), ((1, 1), 0.5, 2.0)])) == 1


async def test_four_processes_claim_in_priority_order(mp_backend: Any) -> None:
    options = mp_backend.options(run="mp-priorities", clock_sync=False, scan_debounce_seconds=0)
    store = SqlLightningStore(mp_backend.url, **options)
    try:
        rng = random.Random(41)
        priorities = [rng.choice((0, 0, 1, 5, -3)) for _ in range(N_ROLLOUTS)]
        for start in range(0, N_ROLLOUTS, 400):
            await store.enqueue_many_rollouts(
                [EnqueueRolloutRequest(input=i, priority=priorities[i]) for i in range(start, min(start + 400, N_ROLLOUTS))]
            )
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(N_PROCESSES), ctx.Queue()
        procs = [
            ctx.Process(target=_claim_in_child, args=(i, mp_backend.url, options, barrier, results), daemon=True)
            for i in range(N_PROCESSES)
        ]
        started = time.monotonic()
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[list[Any], str | None]] = {}
        try:
            while len(outcomes) < N_PROCESSES:
                index, claimed, error = results.get(timeout=max(CHILD_DEADLINE_S - (time.monotonic() - started), 0.1))
                outcomes[index] = (claimed, error)
        except queue_mod.Empty:
            raise AssertionError(f"only {len(outcomes)} of {N_PROCESSES} processes finished") from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        errors = {i: err for i, (_c, err) in outcomes.items() if err is not None}
        assert errors == {}, "\n".join(f"process {i}:\n{err}" for i, err in errors.items())
        claims = [c for claimed, _err in outcomes.values() for c in claimed]
        assert sorted(i for i, _s, _e in claims) == list(range(N_ROLLOUTS))  # each exactly once
        ranked = [((-priorities[i], i), s, e) for i, s, e in claims]
        violations = order_violations(ranked)
        assert violations == [], violations[:5]
    finally:
        await store.close()


# --- a runner killed (SIGKILL) holding a cancelled, or a backed-off, rollout ---------------------


def _claim_and_hang(url: str, options: dict[str, Any], claimed: Any) -> None:
    async def go() -> None:
        store = SqlLightningStore(url, **options)
        ar = await store.dequeue_rollout(worker_id="doomed")
        claimed.put(None if ar is None else (ar.rollout_id, ar.attempt.attempt_id))
        await asyncio.sleep(3600)

    asyncio.run(go())


def _kill_after_claim(url: str, options: dict[str, Any]) -> tuple[Any, tuple[str, str]]:
    ctx = mp.get_context("spawn")
    claimed = ctx.Queue()
    proc = ctx.Process(target=_claim_and_hang, args=(url, options, claimed), daemon=True)
    proc.start()
    got = claimed.get(timeout=120)
    assert got is not None
    return proc, got


async def test_a_killed_runner_of_a_cancelled_rollout_leaves_nothing_to_run(mp_backend: Any, clock: Any) -> None:
    from lightning_sql import RolloutConfig
    from lightning_sql.checker import check_invariants

    options = mp_backend.options(run="mp-cancel", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    store = SqlLightningStore(mp_backend.url, **options)
    try:
        config = RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive", "failed"])
        rollout = await store.enqueue_rollout("task", config=config)
        proc, (rid, aid) = _kill_after_claim(mp_backend.url, options)
        assert rid == rollout.rollout_id
        await store.cancel_rollout(rid)
        proc.kill()  # SIGKILL: the runner never reports
        proc.join(30)
        clock.advance(60)
        assert await store.sweep() == 0  # a cancelled rollout is not in flight: its lease is not swept
        assert await store.dequeue_rollout() is None
        attempts = list(await store.query_attempts(rid))
        assert [(a.attempt_id, a.status) for a in attempts] == [(aid, "failed")]
        assert (await store.get_rollout_by_id(rid)).status == "cancelled"  # type: ignore[union-attr]
        assert await check_invariants(store) == []
    finally:
        await store.close()


async def test_a_killed_runner_of_a_backed_off_rollout_is_retried_once_after_the_delay(mp_backend: Any, clock: Any) -> None:
    from lightning_sql import RolloutConfig
    from lightning_sql.checker import check_invariants

    options = mp_backend.options(run="mp-backoff", clock=clock, clock_sync=False, scan_debounce_seconds=0)
    store = SqlLightningStore(mp_backend.url, **options)
    try:
        config = RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive"],
                               retry_backoff_seconds=100.0)
        rollout = await store.enqueue_rollout("task", config=config)
        proc, (rid, aid) = _kill_after_claim(mp_backend.url, options)
        proc.kill()
        proc.join(30)
        clock.advance(6)
        swept_at = clock()
        assert await store.sweep() == 1
        read = await store.get_rollout_by_id(rid)
        assert read is not None and read.status == "requeuing" and read.not_before == swept_at + 100.0
        assert await store.dequeue_rollout() is None  # in back-off
        clock.advance(100)
        again = await store.dequeue_rollout(worker_id="survivor")
        assert again is not None and again.rollout_id == rollout.rollout_id and again.attempt.sequence_id == 2
        assert await store.dequeue_rollout() is None  # claimed once
        attempts = list(await store.query_attempts(rid))
        assert [(a.attempt_id, a.status) for a in attempts] == [(aid, "unresponsive"), (again.attempt.attempt_id, "preparing")]
        assert await check_invariants(store) == []
    finally:
        await store.close()


# --- a pause during a multi-process run ----------------------------------------------------------

PAUSE_ROLLOUTS = max(N_ROLLOUTS // 2, 64)


def _claim_until_done(index: int, url: str, options: dict[str, Any], done: Any, results: Any) -> None:
    async def go() -> list[tuple[int, float, float]]:
        store = SqlLightningStore(url, **options)
        try:
            async def claimer(worker: str) -> list[tuple[int, float, float]]:
                mine = []
                while not done.is_set():
                    started = time.monotonic()
                    ar = await store.dequeue_rollout(worker_id=worker)
                    if ar is None:
                        await asyncio.sleep(0.01)
                        continue
                    mine.append((ar.input, started, time.monotonic()))
                    await asyncio.sleep(0.005)  # a little work per rollout
                    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
                return mine

            batches = await asyncio.gather(*(claimer(f"P{index}-W{i}") for i in range(CLAIMERS_PER_PROCESS)))
            return [item for batch in batches for item in batch]
        finally:
            await store.close()

    try:
        results.put((index, asyncio.run(go()), None))
    except BaseException:  # noqa: BLE001
        results.put((index, [], traceback.format_exc()))


async def test_a_pause_stops_every_process_claims_within_one_claim(mp_backend: Any) -> None:
    """No claim that started after ``pause_run`` returned and ended before ``resume_run`` was called
    took a rollout, the queue depth stands still while paused, claims go on after the resume, and
    every rollout is claimed exactly once."""
    options = mp_backend.options(run="mp-pause", clock_sync=False, scan_debounce_seconds=0)
    store = SqlLightningStore(mp_backend.url, **options)
    ctx = mp.get_context("spawn")
    done, results = ctx.Event(), ctx.Queue()
    try:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(PAUSE_ROLLOUTS)])
        procs = [
            ctx.Process(target=_claim_until_done, args=(i, mp_backend.url, options, done, results), daemon=True)
            for i in range(N_PROCESSES)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while (await store.statistics())["queue_depth"] > PAUSE_ROLLOUTS * 3 // 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await store.pause_run()
        paused_at = time.monotonic()
        await asyncio.sleep(0.2)  # claims that started before the pause end
        depth = (await store.statistics())["queue_depth"]
        await asyncio.sleep(1.5)
        assert (await store.statistics())["queue_depth"] == depth > 0  # nothing claimed while paused
        assert await store.wait_for_drain(timeout=30)  # the attempts claimed before the pause finished
        resumed_at = time.monotonic()
        await store.resume_run()
        while (await store.statistics())["queue_depth"] > 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        done.set()
        outcomes: dict[int, tuple[list[Any], str | None]] = {}
        try:
            while len(outcomes) < N_PROCESSES:
                index, claimed, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
                outcomes[index] = (claimed, error)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        errors = {i: err for i, (_c, err) in outcomes.items() if err is not None}
        assert errors == {}, errors
        claims = [c for claimed, _err in outcomes.values() for c in claimed]
        assert sorted(i for i, _s, _e in claims) == list(range(PAUSE_ROLLOUTS))
        # A claim that began after the pause and ended before the resume took nothing (one that began
        # during the pause may run its statement after the resume: that one may take work).
        during = [(i, s - paused_at, e - paused_at) for i, s, e in claims if paused_at < s and e < resumed_at]
        assert during == [], (during[:5], resumed_at - paused_at)
        assert any(s > resumed_at for _i, s, _e in claims)
    finally:
        done.set()  # the children stop even when an assertion failed
        await store.close()
