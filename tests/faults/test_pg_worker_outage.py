"""A ``lightning-sql worker`` never exits because of a database error.

Two worker processes (4 runners each, ``--connect-timeout 2``) work through a run on a private cluster
(tests/faults/servers.py).  Twice mid-run the cluster stops (``pg_ctl stop -m fast``) for longer than
the workers' connect deadline, then starts again.

Guarantees:
* no worker process exits: a store call that raises StoreUnavailableError past its deadline is the
  runner's cue to wait and try again, not to stop;
* each worker writes exactly one line to its log (stderr) per outage: no traceback, no line per
  failed call or heartbeat;
* the attempts in flight keep going once the database answers again: every rollout ends succeeded
  with exactly one attempt, and SIGTERM then stops each worker with exit code 0.

Size knobs: LIGHTNING_SQL_FAULT_OUTAGE_ROLLOUTS (CI 160, full 1000) and
LIGHTNING_SQL_FAULT_OUTAGE_SECONDS, how long each outage lasts (CI 3 s, full 15 s);
LIGHTNING_SQL_FAULT_SIZE=full selects the full sizes.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from lightning_sql import SqlLightningStore
from tests.faults.servers import ThrowawayPostgres, WorkerProcess
from tests.faults.support import sized

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

N_WORKERS = 2
RUNNERS_PER_WORKER = 4
WORKER_DEADLINE_S = 2.0  # the workers' --connect-timeout: each outage lasts longer
AGENT_SECONDS = "0.3"  # tests.runtime.agents:slow_agent sleeps this long per rollout: both outages come
# while every worker still has rollouts to run
OUTAGES_AT = (0.25, 0.6)  # fractions of the run done when the cluster stops
SETTLE_S = 2.0  # after work resumes, how long a worker has to finish logging the outage
RUN_TIMEOUT_S = 240.0  # generous


async def _succeeded(store: SqlLightningStore) -> int:
    return (await store.query_rollouts(status_in=["succeeded"], limit=0)).total


def _log_lines(workers: list[WorkerProcess]) -> list[int]:
    return [len(w.stderr_lines()) for w in workers]


async def test_workers_survive_database_outages_and_log_one_line_each(
    throwaway_pg: ThrowawayPostgres, tmp_path: Path
) -> None:
    n_rollouts = int(sized("LIGHTNING_SQL_FAULT_OUTAGE_ROLLOUTS", 160, 1000))
    outage_s = sized("LIGHTNING_SQL_FAULT_OUTAGE_SECONDS", 3, 15)
    assert outage_s > WORKER_DEADLINE_S, "an outage must outlast the workers' connect deadline"
    url = throwaway_pg.url()
    run = "outage"
    observer = SqlLightningStore(url, run=run, connect_deadline_seconds=60)
    workers: list[WorkerProcess] = []
    started = time.monotonic()

    def check_alive(progress: str = "") -> None:
        dead = [w for w in workers if not w.alive()]
        assert dead == [], "a worker exited:\n" + "\n\n".join(w.describe() for w in dead)
        assert time.monotonic() - started < RUN_TIMEOUT_S, (
            f"the run took more than {RUN_TIMEOUT_S:.0f}s ({progress}):\n" + "\n\n".join(w.describe() for w in workers)
        )

    async def until_succeeded(count: int) -> None:
        while (done := await _succeeded(observer)) < count:
            check_alive(f"{done} of {n_rollouts} succeeded, waiting for {count}")
            await asyncio.sleep(0.1)

    try:
        await observer.enqueue_many_rollouts([{"input": {"i": i}} for i in range(n_rollouts)])
        workers = [
            WorkerProcess(
                url, run, "tests.runtime.agents:slow_agent", RUNNERS_PER_WORKER, tmp_path / f"worker-{k}",
                "--connect-timeout", str(WORKER_DEADLINE_S), env={"SLOW_AGENT_SECONDS": AGENT_SECONDS},
            )
            for k in range(N_WORKERS)
        ]
        lines_per_outage: list[list[int]] = []
        done_at_outage: list[int] = []
        for fraction in OUTAGES_AT:
            await until_succeeded(int(fraction * n_rollouts))
            before = _log_lines(workers)
            done_at_outage.append(await _succeeded(observer))
            await asyncio.to_thread(throwaway_pg.stop, "fast")
            await asyncio.sleep(outage_s)
            check_alive()
            await asyncio.to_thread(throwaway_pg.start)
            await until_succeeded(done_at_outage[-1] + 1)  # work goes on
            await asyncio.sleep(SETTLE_S)
            check_alive()
            lines_per_outage.append([after - b for after, b in zip(_log_lines(workers), before, strict=True)])
        await until_succeeded(n_rollouts)
        wall = time.monotonic() - started
        print(f"\n[worker outages] {len(OUTAGES_AT)} outages of {outage_s:.0f}s at {done_at_outage} of "
              f"{n_rollouts} rollouts; log lines per outage and worker {lines_per_outage}; run took {wall:.1f}s")

        assert all(done < n_rollouts for done in done_at_outage), "an outage came after the work: raise the size"
        for outage, counts in enumerate(lines_per_outage, start=1):
            assert counts == [1] * N_WORKERS, (
                f"outage {outage}: each worker must log exactly one line, got {counts}:\n"
                + "\n\n".join(w.describe() for w in workers)
            )
        for w in workers:
            w.terminate()
        codes = [await asyncio.to_thread(w.wait, 60) for w in workers]
        assert codes == [0] * N_WORKERS, "\n\n".join(w.describe() for w in workers)

        rollouts = list(await observer.query_rollouts())
        assert len(rollouts) == n_rollouts and {r.status for r in rollouts} == {"succeeded"}
        for r in rollouts:  # the attempts in flight at each outage went on: one attempt per rollout
            assert r.attempt is not None and r.attempt.sequence_id == 1, r
    finally:
        for w in workers:
            w.kill()
        await observer.close()
