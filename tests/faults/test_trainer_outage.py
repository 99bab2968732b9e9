"""A Trainer waits a database outage out, as its runners and workers do.

The decision is docs/adr/0013-the-trainer-waits-outages-out.md.

A trainer process (tests/faults/trainer_outage_driver.py: two in-process runners, an RL-shaped
algorithm) runs half its samples; the test then makes the database unavailable and lets the
algorithm make its next store call, a training step (``update_resources``), which meets the outage.
On SQLite the disk is full (a small tmpfs, root only); on PostgreSQL the private cluster is stopped
(``pg_ctl stop -m fast``).  Time is controlled through the trainer store's
``connect_deadline_seconds`` (1 s): each outage lasts several deadlines, where the Trainer used to
give up after one (30 s by default), without the test sleeping 30 s.

Guarantees:
* with ``outage_timeout=None`` (the default) the trainer process stays up through the outage,
  logs that the algorithm waits for the store and since when (again once per deadline, with the
  same start), says when the store answers again, and finishes: exit code 0, every rollout succeeded
  with exactly one attempt, the training step recorded once, the run finished;
* a patient call (``outage_patience``) that is cancelled during the outage returns within about one
  deadline instead of waiting for the database;
* with ``outage_timeout=6`` it waits the 6 s (not the 1 s deadline), then exits 1 with one line
  naming the run, saying it is resumable and giving the call that resumes it, no traceback; the run
  stays active, and the call it gives (the same fit) then finishes every rollout exactly once.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO

import pytest

from lightning_sql import SqlLightningStore
from lightning_sql.store import outage_patience
from tests.faults.servers import ROOT, CannotMount, ThrowawayPostgres, full_disk, small_tmpfs

pytestmark = pytest.mark.slow

N_SAMPLES = 8
DEADLINE_S = 1.0  # the trainer store's connect_deadline_seconds
OUTAGE_S = 5 * DEADLINE_S  # each outage outlasts several deadlines
BOUND_S = 6.0  # outage_timeout of the bounded trainer: far more than one deadline (a call waits up to a few
# deadlines for the SQLite writer, busy with the runners' failing writes, before its first try)
RUN_TIMEOUT_S = 180.0  # generous: a trainer on a busy 2-core machine
WAITING = "the algorithm waits for it"
CANCEL_BOUND_S = 15.0  # generous: a cancelled call returns within one deadline (1 s) plus the writer's queue


class Outage:
    """A database the test can take away: ``with outage.down(): ...``."""

    def __init__(self, url: str, down: Callable[[], AbstractContextManager[None]]) -> None:
        self.url = url
        self.down = down


@pytest.fixture(params=["sqlite", "postgresql"])
def outage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outage]:
    if request.param == "sqlite":
        try:
            with small_tmpfs(tmp_path / "disk", "8m") as disk:
                database = disk / "store.db"
                yield Outage(f"sqlite:///{database}", lambda: full_disk(disk, database))
        except CannotMount as exc:
            if os.environ.get("LIGHTNING_SQL_REQUIRE_TMPFS") == "1":
                pytest.fail(f"a full disk needs a tmpfs, required in CI (LIGHTNING_SQL_REQUIRE_TMPFS=1): {exc}", pytrace=False)
            pytest.skip(f"a full disk needs a tmpfs this process may mount (run as root): {exc}")
        return
    pg: ThrowawayPostgres = request.getfixturevalue("throwaway_pg")

    class Stopped:
        def __enter__(self) -> None:
            pg.stop("fast")

        def __exit__(self, *exc: object) -> None:
            pg.start()

    yield Outage(pg.url(), Stopped)


class TrainerProcess:
    def __init__(self, url: str, run: str, gate: Path, directory: Path, outage_timeout: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.stderr_path = directory / "stderr.txt"
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in wait()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SLOW_AGENT_SECONDS": "0.2", "COLUMNS": "400"}
        args = [url, run, str(N_SAMPLES), str(gate), str(DEADLINE_S), outage_timeout]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.trainer_outage_driver", *args],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=self._stderr,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def lines(self) -> list[str]:
        return [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]

    def describe(self) -> str:
        return f"trainer exit code {self.proc.poll()}; stderr:\n" + "\n".join(self.lines()[-40:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._stderr.close()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)
        self._stderr.close()


async def _observer(url: str, run: str, trainer: TrainerProcess) -> SqlLightningStore:
    """A read-only store on the trainer's run (it neither creates the run nor sweeps), once the
    trainer has created it."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        store = SqlLightningStore(url, run=run, read_only=True, connect_deadline_seconds=30)
        try:
            await store.query_rollouts(limit=0)
            return store
        except Exception as exc:  # noqa: BLE001 - no database, schema or run yet: the trainer creates them
            await store.close()
            error = exc
        assert trainer.alive(), trainer.describe()
        assert time.monotonic() < deadline, f"the trainer never created its run: {error!r}"
        await asyncio.sleep(0.1)


async def _until_succeeded(store: SqlLightningStore, count: int, trainer: TrainerProcess) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (await store.query_rollouts(status_in=["succeeded"], limit=0)).total < count:
        assert trainer.alive(), trainer.describe()
        assert time.monotonic() < deadline, f"{count} rollouts did not succeed in time:\n{trainer.describe()}"
        await asyncio.sleep(0.1)


async def _assert_every_rollout_done_once(url: str, run: str) -> None:
    store = SqlLightningStore(url, run=run, read_only=True)
    try:
        rollouts = list(await store.query_rollouts())
        assert len(rollouts) == N_SAMPLES, [r.input for r in rollouts]
        assert sorted(r.input["x"] for r in rollouts) == list(range(N_SAMPLES))  # type: ignore[index]
        assert {r.status for r in rollouts} == {"succeeded"}, [(r.rollout_id, r.status) for r in rollouts]
        for rollout in rollouts:
            attempts = list(await store.query_attempts(rollout.rollout_id))
            assert [(a.sequence_id, a.status) for a in attempts] == [(1, "succeeded")], (rollout, attempts)
        step = await store.get_resources_by_id("policy")
        assert step is not None and step.version == 1, step  # the training step was recorded once
        second_half = [r for r in rollouts if r.input["x"] >= N_SAMPLES // 2]  # type: ignore[index]
        assert {r.resources_id for r in second_half} == {"policy"}
        finished = await store.get_run(run)
        assert finished is not None and finished.status == "finished", finished
    finally:
        await store.close()


async def test_the_trainer_waits_an_outage_out_and_finishes_every_rollout_once(outage: Outage, tmp_path: Path) -> None:
    run, gate = "wait-it-out", tmp_path / "gate"
    trainer = TrainerProcess(outage.url, run, gate, tmp_path / "trainer", "none")
    try:
        observer = await _observer(outage.url, run, trainer)
        await _until_succeeded(observer, N_SAMPLES // 2, trainer)
        await observer.close()  # its connections would see the outage too
        before = len(trainer.lines())
        with outage.down():
            gate.touch()  # the algorithm's next store call, the training step, meets the outage
            started = time.monotonic()
            while time.monotonic() - started < OUTAGE_S:
                assert trainer.alive(), f"the trainer gave up during the outage:\n{trainer.describe()}"
                await asyncio.sleep(0.1)
            during = trainer.lines()[before:]
        assert trainer.wait(RUN_TIMEOUT_S) == 0, trainer.describe()
        waiting = [line for line in during if WAITING in line]
        print(f"\n[trainer outage] {len(waiting)} waiting lines in {OUTAGE_S:.0f}s; first: {waiting[:1]}")
        # Said when the outage began, then again once per deadline, with the same start.
        assert len(waiting) >= 2, trainer.describe()
        starts = {re.search(r"is unavailable since (\S+ \S+ UTC)", line).group(1) for line in waiting}  # type: ignore[union-attr]
        assert len(starts) == 1, waiting
        assert all(f"run '{run}'" in line.lower() and "as long as it takes" in line for line in waiting), waiting
        after = trainer.lines()[before:]
        assert any("the store answers again" in line for line in after), trainer.describe()
        assert not any("Traceback" in line or "StoreUnavailableError" in line for line in after), trainer.describe()
        await _assert_every_rollout_done_once(outage.url, run)
    finally:
        trainer.kill()


async def test_a_bounded_trainer_stops_saying_the_run_is_resumable_and_how(outage: Outage, tmp_path: Path) -> None:
    run, gate = "bounded", tmp_path / "gate"
    trainer = TrainerProcess(outage.url, run, gate, tmp_path / "trainer", str(BOUND_S))
    resumed: TrainerProcess | None = None
    try:
        observer = await _observer(outage.url, run, trainer)
        await _until_succeeded(observer, N_SAMPLES // 2, trainer)
        await observer.close()
        with outage.down():
            gate.touch()
            started = time.monotonic()
            code = await asyncio.to_thread(trainer.wait, RUN_TIMEOUT_S)
            elapsed = time.monotonic() - started
        lines = trainer.lines()
        print(f"\n[bounded trainer] exit {code} after {elapsed:.1f}s: {lines[-1:]}")
        assert code == 1, trainer.describe()
        # It waited outage_timeout, not one connect deadline, then stopped waiting: its waiting lines
        # (one a deadline, each with the seconds since the outage began) go on to the bound, no further.
        waited = [int(m.group(1)) for line in lines if (m := re.search(r"is unavailable since .* UTC \((\d+) s\)", line))]
        assert waited and BOUND_S - 1 <= max(waited) <= BOUND_S + 4, (waited, trainer.describe())
        assert elapsed < BOUND_S + 60, f"stopped {elapsed:.1f}s after the outage began"
        assert not any("Traceback" in line for line in lines), trainer.describe()
        message = lines[-1]
        assert message.startswith(f"lightning_sql: run '{run}' stopped, the store is unavailable"), message
        for says in (f"outage_timeout={BOUND_S:g} s", "The run is resumable", "resume it by running the same fit again",
                     f"run='{run}'", "Trainer(store="):
            assert says in message, (says, message)
        meta = SqlLightningStore(outage.url, read_only=True)
        try:
            stopped = await meta.get_run(run)
        finally:
            await meta.close()
        assert stopped is not None and stopped.status == "active", stopped
        # What the message says works: the same fit again, once the database answers.
        resumed = TrainerProcess(outage.url, run, gate, tmp_path / "resumed", "none")
        assert await asyncio.to_thread(resumed.wait, RUN_TIMEOUT_S) == 0, resumed.describe()
        await _assert_every_rollout_done_once(outage.url, run)
    finally:
        trainer.kill()
        if resumed is not None:
            resumed.kill()


async def test_a_patient_call_that_is_cancelled_returns_within_one_deadline(outage: Outage) -> None:
    """Under ``outage_patience(math.inf)`` a call waits the outage out, but a cancelled one (Ctrl-C,
    the Trainer stopping its algorithm) still returns within about ``connect_deadline_seconds`` (plus a
    back-off), as any call did before: cancelling never hangs for as long as the outage lasts."""
    store = SqlLightningStore(outage.url, run="cancelled", connect_deadline_seconds=DEADLINE_S)
    call: asyncio.Future[object] | None = None
    try:
        await store.enqueue_rollout({"x": 0})
        with outage.down():
            with outage_patience(math.inf):
                call = asyncio.ensure_future(store.update_resources("policy", {}))
            await asyncio.sleep(3 * DEADLINE_S)
            assert not call.done(), f"the patient call gave up within its patience: {call}"
            assert store.unavailable_since is not None, "the store does not report the outage in progress"
            call.cancel()
            cancelled_at = time.monotonic()
            done, _ = await asyncio.wait({call}, timeout=CANCEL_BOUND_S)
            returned_s = time.monotonic() - cancelled_at
            assert done, f"a cancelled call still waited for the outage after {CANCEL_BOUND_S:.0f}s"
        assert call.cancelled(), call
        print(f"\n[patience] the cancelled call returned {returned_s:.1f}s after its cancellation")
        assert (await store.query_rollouts(limit=0)).total == 1  # the same store goes on after the outage
    finally:
        if call is not None:  # the database answers again: a call still waiting ends before close()
            await asyncio.wait({call}, timeout=RUN_TIMEOUT_S)
        await store.close()
