"""Runner death: SIGKILL two of four runner processes mid-attempt (docs/operations.md, "Runner death").

Guarantee: the killed runners' attempts become ``unresponsive`` once their lease expires (real time,
``unresponsive_seconds`` = LEASE_S), the survivors retry them, every rollout ends ``succeeded``, no
rollout has two succeeded attempts, and the whole run finishes within lease + work (+ generous slack).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.conftest import BackendSpec
from tests.faults.support import assert_consistent, int_knob, lease_config, mp_context, runner_main

pytestmark = pytest.mark.slow

LEASE_S = 2.0
STEPS = 3  # spans per attempt
STEP_S = 0.1  # work between spans; heartbeats every step, far inside the lease
N_RUNNERS = 4
N_KILLED = 2


async def test_killed_runners_attempts_are_retried_by_survivors(mp_backend: BackendSpec) -> None:
    n_rollouts = int_knob("LIGHTNING_SQL_FAULT_ROLLOUTS", 24)
    opts = {"run": "runner-death", "scan_debounce_seconds": 0.2, "clock_sync": False}
    store = mp_backend.open(**opts)
    try:
        rollouts = await store.enqueue_many_rollouts(
            [{"input": {"i": i}, "config": lease_config(LEASE_S)} for i in range(n_rollouts)]
        )
        ids = [r.rollout_id for r in rollouts]
        ctx = mp_context()
        errors = ctx.Queue()
        started = time.monotonic()
        procs = {
            f"runner-{n}": ctx.Process(
                target=runner_main, args=(mp_backend.open(**opts), f"runner-{n}", STEPS, STEP_S, errors)
            )
            for n in range(N_RUNNERS)
        }
        for proc in procs.values():
            proc.start()

        # Kill runner-0 and runner-1 while each is mid-attempt: its attempt is running (has a span).
        killed: dict[str, tuple[str, str]] = {}
        killed_at: dict[str, float] = {}  # store clock (time.time: clock_sync off, one host)
        deadline = time.monotonic() + 60
        while len(killed) < N_KILLED:
            assert time.monotonic() < deadline, "victims never got mid-attempt"
            for name in [f"runner-{n}" for n in range(N_KILLED)]:
                if name in killed:
                    continue
                worker = await store.get_worker_by_id(name)
                if worker is None or worker.status != "busy" or worker.current_attempt_id is None:
                    continue
                rid, aid = worker.current_rollout_id, worker.current_attempt_id
                assert rid is not None
                attempt = (await store.query_attempts(rid)).items[-1]
                if attempt.attempt_id == aid and attempt.status == "running":
                    killed_at[name] = time.time()
                    os.kill(procs[name].pid, signal.SIGKILL)  # type: ignore[arg-type]
                    killed[name] = (rid, aid)
            await asyncio.sleep(0.02)

        finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=120)
        elapsed = time.monotonic() - started
        for proc in procs.values():
            proc.join(timeout=30)
        assert errors.empty(), errors.get()
        for name, proc in procs.items():
            expected = -signal.SIGKILL if name in killed else 0
            assert proc.exitcode == expected, (name, proc.exitcode)

        assert len(finished) == n_rollouts
        for rollout in finished:
            assert rollout.status == "succeeded", rollout
        for rid in ids:
            attempts = (await store.query_attempts(rid)).items
            succeeded = [a for a in attempts if a.status == "succeeded"]
            assert len(succeeded) == 1, (rid, attempts)
            # A victim may have finished rollouts before the poll above caught it mid-attempt (a
            # starved poll on a loaded machine); nothing it did after its kill can have succeeded.
            winner = succeeded[0]
            assert winner.worker_id not in killed or (winner.end_time or 0) < killed_at[winner.worker_id], winner
        for name, (rid, aid) in killed.items():
            attempts = (await store.query_attempts(rid)).items
            dead = next(a for a in attempts if a.attempt_id == aid)
            assert dead.status == "unresponsive", (name, dead)
            assert dead.worker_id == name
            assert attempts[-1].status == "succeeded" and attempts[-1].sequence_id > dead.sequence_id

        # Work spread over the survivors, plus one lease for the orphaned attempts; slack for 2 busy cores.
        work_s = n_rollouts * STEPS * STEP_S / (N_RUNNERS - N_KILLED)
        bound = LEASE_S + work_s + 45
        print(f"\n[runner death/{mp_backend.name}] {n_rollouts} rollouts in {elapsed:.1f}s (bound {bound:.0f}s)")
        assert elapsed < bound
        await assert_consistent(store)
    finally:
        await store.close()
