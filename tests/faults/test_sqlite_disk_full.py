"""SQLite on a full disk: a write is retried, then reported as the database's failure; the store (and a
runner on it) goes on once space is freed.

The database lives on a small tmpfs mounted by the test (root only: the test skips, saying so, where
this process may not mount, and fails instead under ``LIGHTNING_SQL_REQUIRE_TMPFS=1``, as in CI).  A file then fills the disk right after a checkpoint emptied the WAL
file, so every write needs new blocks (a WAL file that keeps its size after a checkpoint would take
small writes into its old frames and never meet the full disk).

Guarantees:
* a store write on the full disk is retried until ``connect_deadline_seconds`` and then raises
  StoreUnavailableError naming the cause (the disk is full), having written nothing; once space is
  freed the same store instance writes again and the run is consistent;
* a runner whose agent finished while the disk is full never reports the database's failure as the
  agent's ("returned an unusable value"), never exits, and ends the attempt succeeded once space is
  freed.

Size knob: LIGHTNING_SQL_FAULT_DISK_FULL_SECONDS, how long the disk stays full (CI 4 s, full 20 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import LitAgent, SqlLightningStore, StoreUnavailableError
from lightning_sql.runtime.worker import run_worker_async
from lightning_sql.types import Rollout
from tests.faults.servers import CannotMount, full_disk, small_tmpfs
from tests.faults.support import assert_consistent, sized

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0
DISK_SIZE = "8m"
SETTLE_TIMEOUT_S = 30.0  # generous: how long the work may take once space is freed
# CI (.ci/run) runs as root and must run these tests: there a tmpfs that cannot be mounted fails them.
REQUIRE_TMPFS = os.environ.get("LIGHTNING_SQL_REQUIRE_TMPFS") == "1"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    try:
        with small_tmpfs(tmp_path / "disk", DISK_SIZE) as disk:
            yield disk
    except CannotMount as exc:
        if REQUIRE_TMPFS:
            pytest.fail(f"a full disk needs a tmpfs, required in CI (LIGHTNING_SQL_REQUIRE_TMPFS=1): {exc}", pytrace=False)
        pytest.skip(f"a full disk needs a tmpfs this process may mount (run as root): {exc}")


def seconds_full() -> float:
    return sized("LIGHTNING_SQL_FAULT_DISK_FULL_SECONDS", 4, 20)


async def test_a_write_on_a_full_disk_is_retried_then_reported_and_the_store_goes_on(small_disk: Path) -> None:
    database = small_disk / "store.db"
    store = SqlLightningStore(f"sqlite:///{database}", run="full", connect_deadline_seconds=DEADLINE_S)
    try:
        await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(3)])
        with full_disk(small_disk, database):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                await store.enqueue_rollout({"i": 3, "text": "x" * 20_000})
            elapsed = time.monotonic() - started
            print(f"\n[disk full] raised after {elapsed:.1f}s: {info.value}")
            assert elapsed >= DEADLINE_S * 0.9, f"reported after {elapsed:.1f}s: it was not retried to the deadline"
            assert elapsed < DEADLINE_S + 20, f"the call hung for {elapsed:.1f}s past its deadline"
            assert "full" in str(info.value).lower(), f"the error does not say the disk is full: {info.value}"
        # Space is back: the same instance goes on, and the failed write left nothing behind.
        assert (await store.query_rollouts(limit=0)).total == 3
        await store.enqueue_rollout({"i": 3, "text": "x" * 20_000})
        claimed = await store.dequeue_rollout(worker_id="after")
        assert claimed is not None
        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        assert (await store.query_rollouts(limit=0)).total == 4
        await assert_consistent(store)
    finally:
        await store.close()


class GatedAgent(LitAgent[Any]):
    """Starts, then waits for the test's go before it returns a reward (so the test can fill the disk
    while the agent runs, and the reward and the report meet the full disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def rollout_async(self, task: Any, resources: Any, rollout: Rollout) -> float:
        self.started.set()
        await self.go.wait()
        return 1.0


async def test_a_runner_on_a_full_disk_keeps_its_attempt_and_finishes_it(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database = small_disk / "store.db"
    url = f"sqlite:///{database}"
    store = SqlLightningStore(url, run="full")
    agent = GatedAgent()
    stop = threading.Event()
    caplog.set_level(logging.INFO)
    worker: asyncio.Task[int] | None = None
    try:
        rollout = await store.enqueue_rollout({"i": 0})
        worker = asyncio.create_task(
            run_worker_async(
                url, "full", agent, n=1, stop_event=stop, poll_interval=0.2, heartbeat_interval=0.5,
                connect_deadline_seconds=DEADLINE_S,
            )
        )
        await asyncio.wait_for(agent.started.wait(), 30)
        with full_disk(small_disk, database):
            agent.go.set()  # the reward span and the report now meet the full disk
            await asyncio.sleep(seconds_full())
            assert not worker.done(), f"the worker ended on a full disk: {worker}"
            during = await store.get_rollout_by_id(rollout.rollout_id)
            assert during is not None and during.status in ("preparing", "running"), (
                f"the rollout is {during and during.status} on a full disk: its writes did not meet the full disk"
            )
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while (current := await store.get_rollout_by_id(rollout.rollout_id)) is None or current.status != "succeeded":
            assert not worker.done(), f"the worker ended before the rollout was done: {worker}"
            assert time.monotonic() < deadline, f"the rollout is {current and current.status} after space was freed"
            await asyncio.sleep(0.2)
        stop.set()
        assert await asyncio.wait_for(worker, SETTLE_TIMEOUT_S) == 1
        attempts = list(await store.query_attempts(rollout.rollout_id))
        assert [(a.sequence_id, a.status) for a in attempts] == [(1, "succeeded")]
        assert "unusable value" not in caplog.text, "the database's failure was reported as the agent's"
        await assert_consistent(store)
    finally:
        stop.set()
        agent.go.set()
        if worker is not None:
            if not worker.done():
                worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        await store.close()
