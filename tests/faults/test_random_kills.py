"""Kill at random points (docs/operations.md, "Crash at any point").

Guarantee: every store call is one transaction, so a process SIGKILLed at any moment — inside a claim,
a span batch, an attempt update, a sweep, a resources update — leaves the run consistent: the
invariant checker passes after every kill, and the next process carries on from there.
Iterations: LIGHTNING_SQL_FAULT_KILLS (CI default 20, the issue's full run 100).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.conftest import BackendSpec
from tests.faults.support import assert_consistent, chaos_main, int_knob, mp_context

pytestmark = pytest.mark.slow

MAX_DELAY_S = 0.6  # the kill lands anywhere in the first MAX_DELAY_S seconds of work


async def test_sigkill_at_random_points_keeps_the_run_consistent(mp_backend: BackendSpec) -> None:
    iterations = int_knob("LIGHTNING_SQL_FAULT_KILLS", 20)
    seed = int(os.environ.get("LIGHTNING_SQL_FAULT_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    opts = {"run": "random-kills", "scan_debounce_seconds": 0, "clock_sync": False}
    store = mp_backend.open(**opts)
    ctx = mp_context()
    try:
        await store.enqueue_rollout({"warm": True})  # creates the schema and the run before the first kill
        started = time.monotonic()
        for i in range(iterations):
            ready = ctx.Event()
            proc = ctx.Process(target=chaos_main, args=(mp_backend.open(**opts), seed + i, ready))
            proc.start()
            assert ready.wait(60), f"iteration {i}: the child never finished its first round (seed {seed})"
            time.sleep(rng.uniform(0, MAX_DELAY_S))
            alive = proc.is_alive()
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(30)
            assert alive and proc.exitcode == -signal.SIGKILL, (
                f"iteration {i}: the child died on its own (exit {proc.exitcode}, seed {seed})"
            )
            await assert_consistent(store, when=f"after kill {i + 1}/{iterations} (seed {seed})")
        stats = await store.statistics()
        print(
            f"\n[random kills/{mp_backend.name}] {iterations} kills in {time.monotonic() - started:.1f}s, "
            f"seed {seed}: {stats['total_rollouts']} rollouts, {stats['total_attempts']} attempts, "
            f"{stats['total_spans']} spans"
        )
        assert stats["total_attempts"] > 0 and stats["total_spans"] > 0
        # After the dust settles the sweeper recovers every lease the dead children held.
        await store.sweep()
        await assert_consistent(store, when="after the final sweep")
    finally:
        await store.close()
