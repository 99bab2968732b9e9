"""docs/store-contract.md §2.4 / docs/architecture.md §4 (claiming) across OS processes: 4 spawned processes x 8 concurrent claimers against one
database (SQLite file; PostgreSQL) claim every queued rollout exactly once, and no error surfaces (no
"database is locked").

Size knob: ``LIGHTNING_SQL_TEST_MP_ROLLOUTS`` (default 2000 queued rollouts).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from typing import Any

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore
from tests.contract.test_queue_claims import raw_rows

N_PROCESSES = 4
CLAIMERS_PER_PROCESS = 8
N_ROLLOUTS = int(os.environ.get("LIGHTNING_SQL_TEST_MP_ROLLOUTS", "2000"))
# Generous: spawning 4 interpreters and 2000 claims on a busy 2-core machine; a hang fails, it does not block CI.
CHILD_DEADLINE_S = 300.0
ENQUEUE_BATCH = 500


def _claim_in_child(index: int, url: str, options: dict[str, Any], barrier: Any, results: Any) -> None:
    """Child process: open the store from its URL, wait for the others, claim until the queue is empty."""
    try:
        claimed = asyncio.run(_claim_all(index, url, options, barrier))
        results.put((index, claimed, None))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((index, [], traceback.format_exc()))


async def _claim_all(
    index: int, url: str, options: dict[str, Any], barrier: Any
) -> list[tuple[str, str, str]]:
    """The process's claims."""
    store = SqlLightningStore(url, **options)
    try:
        await store.statistics()  # connect and check the schema before the race starts
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait, 120)

        async def claimer(worker: str) -> list[tuple[str, str, str]]:
            mine = []
            while (ar := await store.dequeue_rollout(worker_id=worker)) is not None:
                mine.append((ar.rollout_id, ar.attempt.attempt_id, worker))
            return mine

        batches = await asyncio.gather(*(claimer(f"P{index}-W{i}") for i in range(CLAIMERS_PER_PROCESS)))
        return [item for batch in batches for item in batch]
    finally:
        await store.close()


async def test_four_processes_claim_every_rollout_exactly_once(mp_backend):
    # scan_debounce_seconds=0: every claim also sweeps, so sweeps race claims across processes too.
    options = mp_backend.options(run="mp-claims", clock_sync=False, scan_debounce_seconds=0)
    store = SqlLightningStore(mp_backend.url, **options)
    try:
        enqueued: list[str] = []
        for start in range(0, N_ROLLOUTS, ENQUEUE_BATCH):
            batch = [
                EnqueueRolloutRequest(input={"i": i})
                for i in range(start, min(start + ENQUEUE_BATCH, N_ROLLOUTS))
            ]
            enqueued += [r.rollout_id for r in await store.enqueue_many_rollouts(batch)]
        assert (await store.statistics())["queue_depth"] == N_ROLLOUTS

        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(N_PROCESSES)
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_claim_in_child, args=(i, mp_backend.url, options, barrier, results), daemon=True
            )
            for i in range(N_PROCESSES)
        ]
        started = time.monotonic()
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[list[tuple[str, str, str]], str | None]] = {}
        try:
            while len(outcomes) < N_PROCESSES:
                remaining = CHILD_DEADLINE_S - (time.monotonic() - started)
                index, claimed, error = results.get(timeout=max(remaining, 0.1))
                outcomes[index] = (claimed, error)
        except queue_mod.Empty:
            raise AssertionError(
                f"only {len(outcomes)} of {N_PROCESSES} processes finished in {CHILD_DEADLINE_S}s"
            ) from None
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        elapsed = time.monotonic() - started

        errors = {i: err for i, (_c, err) in outcomes.items() if err is not None}
        assert errors == {}, "\n".join(f"process {i}:\n{err}" for i, err in errors.items())
        assert [p.exitcode for p in procs] == [0] * N_PROCESSES

        claims = [c for claimed, _err in outcomes.values() for c in claimed]
        claimed_ids = [rid for rid, _aid, _w in claims]
        assert len(claimed_ids) == N_ROLLOUTS, f"{len(claimed_ids)} claims for {N_ROLLOUTS} rollouts"
        assert sorted(claimed_ids) == sorted(enqueued)  # each exactly once
        per_process = {i: len(c) for i, (c, _e) in outcomes.items()}
        print(
            f"\n{mp_backend.name}: {N_ROLLOUTS} claims by {N_PROCESSES}x{CLAIMERS_PER_PROCESS} in {elapsed:.1f}s; "
            f"{per_process}"
        )

        # The database agrees: one attempt per rollout, the one its claimer saw, nothing left queued.
        stats = await store.statistics()
        assert (stats["total_rollouts"], stats["total_attempts"], stats["queue_depth"]) == (
            N_ROLLOUTS,
            N_ROLLOUTS,
            0,
        )
        rows = await raw_rows(
            mp_backend,
            "SELECT a.rollout_id, a.attempt_id, a.worker_id, a.sequence_id FROM attempts a "
            "JOIN runs r ON r.run_id = a.run_id WHERE r.name = 'mp-claims'",
        )
        assert len(rows) == N_ROLLOUTS
        assert {(rid, aid, w) for rid, aid, w, _seq in rows} == set(claims)
        assert {seq for *_rest, seq in rows} == {1}
        not_preparing = await raw_rows(
            mp_backend,
            "SELECT count(*) FROM rollouts o JOIN runs r ON r.run_id = o.run_id "
            "WHERE r.name = 'mp-claims' AND (o.status <> 'preparing' OR o.queue_seq IS NOT NULL)",
        )
        assert not_preparing[0][0] == 0
    finally:
        await store.close()
