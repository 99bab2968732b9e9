"""Kill a run's trainer and runner processes with SIGKILL half-way, start it again: it finishes exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_sql import FINISHED_STATUSES
from lightning_sql.runtime.algorithm import sample_keys

N_SAMPLES = int(os.environ.get("LIGHTNING_SQL_TEST_RESUME_SAMPLES", "40"))
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 120  # generous: spawn start-up on a busy 2-core machine


def _start(url: str, run: str, schema: str | None) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.runtime.resume_driver", url, run, str(N_SAMPLES)]
    if schema:
        args.append(schema)
    # Own session: SIGKILL to the group kills the trainer and its spawned runners at once.
    return subprocess.Popen(args, cwd=ROOT, start_new_session=True)


def _counts(store: Any) -> tuple[int, int]:
    async def read() -> tuple[int, int]:
        finished = await store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)
        everything = await store.query_rollouts(limit=0)
        return finished.total, everything.total

    return asyncio.run(read())


def test_sigkill_then_resume_finishes_every_sample_once(mp_backend: Any) -> None:
    run = "resume-me"
    observer = mp_backend.open(run=run)
    try:
        first = _start(mp_backend.url, run, mp_backend.schema)
        deadline = time.monotonic() + DEADLINE_S
        while _counts(observer)[0] < N_SAMPLES // 2:
            assert first.poll() is None, "the first trainer exited before it was killed"
            assert time.monotonic() < deadline, "the first half did not finish in time"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        finished_at_kill, enqueued_at_kill = _counts(observer)
        assert finished_at_kill < N_SAMPLES  # it really was killed half-way

        second = _start(mp_backend.url, run, mp_backend.schema)
        try:
            assert second.wait(DEADLINE_S) == 0
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)

        async def check() -> None:
            rollouts = list(await observer.query_rollouts())
            keys = Counter(r.idempotency_key for r in rollouts)
            assert sorted(keys) == sorted(sample_keys(0, [("train", {"x": i}) for i in range(N_SAMPLES)]))
            assert set(keys.values()) == {1}  # no sample enqueued twice
            assert {r.status for r in rollouts} == {"succeeded"}
            retried = 0
            for r in rollouts:
                attempts = list(await observer.query_attempts(r.rollout_id))
                assert attempts[-1].status == "succeeded"
                assert all(a.status in ("unresponsive", "succeeded") for a in attempts)
                retried += len(attempts) > 1
            # The rollouts in flight at the kill were recovered by their lease and redone.
            assert retried >= 1
            run_row = await observer.get_run(run)
            assert run_row is not None and run_row.status == "finished"

        asyncio.run(check())
    finally:
        asyncio.run(observer.close())
