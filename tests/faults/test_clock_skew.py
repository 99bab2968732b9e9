"""Clock skew between hosts (docs/operations.md, "Clocks").

Two store instances on one PostgreSQL database whose local clocks differ by 120 s, ``clock_sync`` on:
their store clocks agree (each corrects itself by its measured offset to the server), so neither
sees the other's fresh attempts as expired, and a lease that really lapses expires on time whoever
sweeps.  The control case shows the same setup without ``clock_sync`` would expire live work at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import BackendSpec
from tests.faults.support import assert_consistent, lease_config

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SKEW_S = 120.0
LEASE_S = 3.0


def fast_clock() -> float:
    return time.time() + SKEW_S


async def test_skewed_hosts_agree_on_leases(pg_backend: BackendSpec) -> None:
    slow = pg_backend.open(run="skew", clock=time.time, clock_sync=True, scan_debounce_seconds=0)
    fast = pg_backend.open(run="skew", clock=fast_clock, clock_sync=True, scan_debounce_seconds=0)
    try:
        r1, r2 = await slow.enqueue_many_rollouts([{"input": 1, "config": lease_config(LEASE_S)}] * 2)
        a1 = await slow.dequeue_rollout(worker_id="slow-host")
        a2 = await fast.dequeue_rollout(worker_id="fast-host")
        assert a1 is not None and a2 is not None
        assert abs(slow.now() - fast.now()) < 1.0, "store clocks disagree despite clock_sync"
        assert abs(a1.attempt.start_time - a2.attempt.start_time) < 1.0

        # Live work: heartbeats from each host, sweeps from both: nothing expires.
        beat_at: dict[str, float] = {}
        for i in range(4):
            if i:
                await asyncio.sleep(LEASE_S / 4)
            await slow.touch_attempt(a1.rollout_id, a1.attempt.attempt_id)
            beat_at[a1.rollout_id] = time.monotonic()
            await fast.touch_attempt(a2.rollout_id, a2.attempt.attempt_id)
            beat_at[a2.rollout_id] = time.monotonic()
            assert await fast.sweep() == 0
            assert await slow.sweep() == 0
        statuses = {r.rollout_id: r.status for r in (await fast.query_rollouts()).items}
        assert statuses == {a1.rollout_id: "preparing", a2.rollout_id: "preparing"}

        # Heartbeats stop: each lease lapses LEASE_S after its last heartbeat, whichever host sweeps.
        last_beat = min(beat_at.values())
        hits: dict[str, float] = {}
        sweepers = [fast, slow]
        while len(hits) < 2:
            elapsed = time.monotonic() - last_beat
            assert elapsed < LEASE_S + 10, f"leases never expired ({hits})"
            sweeper = sweepers[len(hits) % 2]
            if await sweeper.sweep():
                for rollout in (await sweeper.query_rollouts(status_in=["requeuing"])).items:
                    hits.setdefault(rollout.rollout_id, time.monotonic() - beat_at[rollout.rollout_id])
            await asyncio.sleep(0.1)
        print(f"\n[clock skew] leases expired after {hits} s (lease {LEASE_S}s, skew {SKEW_S}s)")
        # On time: not early by more than the clocks' agreement (a round trip; 120 s without
        # clock_sync would expire it at once), not late by more than a few of the 0.1 s sweeps.
        for rid, after in hits.items():
            assert LEASE_S - 1.5 <= after <= LEASE_S + 5.0, (rid, after)
        for rid in (r1.rollout_id, r2.rollout_id):
            latest = await slow.get_latest_attempt(rid)
            assert latest is not None and latest.status == "unresponsive"
        await assert_consistent(slow)
    finally:
        await slow.close()
        await fast.close()


async def test_control_without_clock_sync_the_fast_host_expires_live_work(pg_backend: BackendSpec) -> None:
    slow = pg_backend.open(run="skew-control", clock=time.time, clock_sync=False, scan_debounce_seconds=0)
    fast = pg_backend.open(run="skew-control", clock=fast_clock, clock_sync=False, scan_debounce_seconds=0)
    try:
        await slow.enqueue_rollout({"x": 1}, config=lease_config(LEASE_S))
        claimed = await slow.dequeue_rollout(worker_id="slow-host")
        assert claimed is not None
        await slow.touch_attempt(claimed.rollout_id, claimed.attempt.attempt_id)
        assert await fast.sweep() == 1  # a fresh heartbeat looks 120 s old to the unsynchronised host
        await assert_consistent(slow)
    finally:
        await slow.close()
        await fast.close()
