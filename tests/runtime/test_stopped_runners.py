"""After SIGKILL of a trainer and its runners, the rerun hands their rollouts back at once (no lease wait)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import FINISHED_STATUSES, RolloutConfig
from lightning_sql.runtime.recovery import process_gone, process_identity, release_stopped_local_workers
from tests.runtime.stopped_runner_driver import LEASE_S

ROOT = Path(__file__).resolve().parents[2]
N_SAMPLES = 12
DEADLINE_S = 150  # generous for spawn on a busy machine, far below the driver's lease


def _start(url: str, run: str, strategy: str, schema: str | None, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.runtime.stopped_runner_driver", url, run, str(N_SAMPLES), strategy]
    if schema:
        args.append(schema)
    env = {**os.environ, "SLOW_AGENT_SECONDS": "0.6"}
    with open(log, "wb") as out:
        # Own session: SIGKILL to the group kills the trainer and its spawned runners at once.
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _in_flight(store: Any) -> tuple[int, list[str]]:
    async def read() -> tuple[int, list[str]]:
        finished = await store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)
        running = await store.query_rollouts(status_in=["preparing", "running"])
        return finished.total, [r.rollout_id for r in running]

    return asyncio.run(read())


@pytest.mark.parametrize("strategy", ["processes", "inprocess"])
def test_rerun_after_sigkill_hands_back_the_killed_runners_rollouts(
    mp_backend: Any, strategy: str, tmp_path: Path
) -> None:
    if strategy == "inprocess" and mp_backend.is_postgres:
        pytest.skip("the in-process strategy is covered on SQLite; the hand-back goes through the same store API")
    run = f"killed-{strategy}"
    observer = mp_backend.open(run=run)
    try:
        first = _start(mp_backend.url, run, strategy, mp_backend.schema, tmp_path / "first.log")
        deadline = time.monotonic() + DEADLINE_S
        while True:
            finished, running = _in_flight(observer)
            if finished >= 2 and running:
                break
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the first trainer did not get going in time"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        _, held = _in_flight(observer)
        assert held, "nothing was in flight at the kill"

        started = time.monotonic()
        second = _start(mp_backend.url, run, strategy, mp_backend.schema, tmp_path / "second.log")
        try:
            assert second.wait(DEADLINE_S) == 0, (tmp_path / "second.log").read_text()
        finally:
            if second.poll() is None:
                os.killpg(second.pid, signal.SIGKILL)
        assert time.monotonic() - started < LEASE_S
        out = (tmp_path / "second.log").read_text()
        assert f"{len(held)} rollouts held by stopped runner processes of this machine were handed back" in out

        async def check() -> None:
            rollouts = list(await observer.query_rollouts())
            assert len(rollouts) == N_SAMPLES and {r.status for r in rollouts} == {"succeeded"}
            for rollout_id in held:
                attempts = list(await observer.query_attempts(rollout_id))
                assert attempts[0].status == "unresponsive"
                assert (attempts[0].metadata or {})["error"]["type"] == "lightning_sql.RunnerProcessGone"
                assert attempts[-1].status == "succeeded"

        asyncio.run(check())
    finally:
        asyncio.run(observer.close())


def test_process_gone_only_for_dead_processes_of_this_machine() -> None:
    here = process_identity()
    assert not process_gone(here)  # this process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        alive = {**here, "pid": child.pid, "process_started": psutil.Process(child.pid).create_time()}
        assert not process_gone(alive)
        assert process_gone({**alive, "process_started": alive["process_started"] - 3600})  # the pid was reused
        child.kill()
        child.wait(10)
        assert process_gone(alive)
        assert not process_gone({**alive, "host": here["host"] + "-elsewhere"})
        assert not process_gone({**alive, "boot_id": "another-boot"})
        assert not process_gone({**alive, "pid_namespace": "pid:[1]"})
        assert not process_gone({"host": here["host"]})  # no identity recorded
        assert not process_gone(None)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_rollouts_held_elsewhere_are_announced_with_their_lease(backend: Any, clock: Any) -> None:
    async def go() -> None:
        store = backend.open(run="elsewhere", clock=clock, clock_sync=False)
        try:
            lease = RolloutConfig(unresponsive_seconds=60, max_attempts=2, retry_condition=["unresponsive"])
            for i in range(4):
                await store.enqueue_rollout({"x": i}, config=lease)
            for i in range(4):
                await store.dequeue_rollout(worker_id=f"remote-{i % 2}")
            for i in range(2):
                await store.update_worker(f"remote-{i}", {**process_identity(), "host": "another-host", "pid": 1})
            clock.advance(15)
            recovery = await release_stopped_local_workers(store)
            assert recovery.released == [] and len(recovery.waiting) == 4
            assert recovery.describe() == [
                "4 rollouts wait for the lease of a worker that may have stopped (remote-0, remote-1), up to 45 s"
            ]
            # Nothing was changed: the rollouts are still in flight.
            assert (await store.query_rollouts(status_in=["preparing", "running"], limit=0)).total == 4
        finally:
            await store.close()

    asyncio.run(go())
