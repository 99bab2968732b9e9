"""Dropped connections and database restarts (docs/operations.md, "Database restarts").

Runs against a private PostgreSQL cluster (initdb/pg_ctl in a temp dir, another port): the shared
server is never stopped or its backends killed.

Guarantees:
* while runners work, ``pg_terminate_backend`` on every other backend, then on all of them, then a
  server restart: the store reconnects and replays what is safe, no caller sees an error, every
  rollout succeeds with exactly one attempt (no claim ran twice) and every span is there (nothing lost);
* with the server down longer than ``connect_deadline_seconds`` a call raises StoreUnavailableError
  (naming the URL with its password masked) instead of hanging, and the store recovers when the server
  is back.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from lightning_sql import SqlLightningStore, StoreUnavailableError
from tests.faults.support import ThrowawayPostgres, assert_consistent, int_knob, make_span, terminate_backends

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SPANS_PER_ROLLOUT = 3
N_RUNNERS = 8


async def test_run_survives_terminated_backends_and_a_restart(throwaway_pg: ThrowawayPostgres) -> None:
    n_rollouts = int_knob("LIGHTNING_SQL_FAULT_RESTART_ROLLOUTS", 240)
    store = SqlLightningStore(
        throwaway_pg.url(), run="restarts", connect_deadline_seconds=60, scan_debounce_seconds=1
    )
    errors: list[str] = []
    done = 0
    try:
        ids = [r.rollout_id for r in await store.enqueue_many_rollouts([{"input": i} for i in range(n_rollouts)])]

        async def runner(n: int) -> None:
            nonlocal done
            while True:
                try:
                    claimed = await store.dequeue_rollout(worker_id=f"runner-{n}")
                    if claimed is None:
                        return
                    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
                    for k in range(1, SPANS_PER_ROLLOUT + 1):
                        await store.add_span(make_span(rid, aid, k))
                        await asyncio.sleep(0.005)
                    await store.update_attempt(rid, aid, status="succeeded")
                    done += 1
                except Exception as exc:  # noqa: BLE001 - any error reaching a caller is a failure
                    errors.append(f"runner-{n}: {type(exc).__name__}: {exc}")
                    return

        async def until(fraction: float) -> None:
            while done < fraction * n_rollouts and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(runner(n)) for n in range(N_RUNNERS)]
        events = []
        await until(0.2)
        events.append(("terminate every other backend", await terminate_backends(throwaway_pg.url(), every_other=True)))
        await until(0.4)
        events.append(("terminate every backend", await terminate_backends(throwaway_pg.url())))
        await until(0.6)
        t0 = time.monotonic()
        await asyncio.to_thread(throwaway_pg.restart)
        events.append(("restart (s)", round(time.monotonic() - t0, 2)))
        progress_at_restart = done
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
        print(f"\n[pg restarts] {events}; {done}/{n_rollouts} done (restart at {progress_at_restart})")

        assert errors == []
        assert progress_at_restart < n_rollouts, "the restart happened after the work: increase the size knob"
        rollouts = (await store.query_rollouts()).items
        assert sorted(r.rollout_id for r in rollouts) == sorted(ids)
        assert {r.status for r in rollouts} == {"succeeded"}
        for rid in ids:
            attempts = (await store.query_attempts(rid)).items
            assert [a.sequence_id for a in attempts] == [1], (rid, attempts)  # no claim ran twice
            spans = await store.query_spans(rid)
            assert sorted(s.sequence_id for s in spans) == list(range(1, SPANS_PER_ROLLOUT + 1)), rid
        await assert_consistent(store)
    finally:
        await store.close()


async def test_server_down_past_the_deadline_raises_then_recovers(
    throwaway_pg: ThrowawayPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    deadline_s = 2.0
    url = throwaway_pg.url(password="s3cret")  # trust auth ignores it; it must never be shown
    store = SqlLightningStore(url, run="down", connect_deadline_seconds=deadline_s, clock_sync=False)
    try:
        rollout = await store.enqueue_rollout({"x": 1})
        throwaway_pg.stop()
        try:
            caplog.set_level(logging.DEBUG)
            for call in (store.query_rollouts, lambda: store.enqueue_rollout({"x": 2})):
                t0 = time.monotonic()
                with pytest.raises(StoreUnavailableError) as info:
                    await call()
                elapsed = time.monotonic() - t0
                message = str(info.value)
                print(f"\n[pg down] raised after {elapsed:.1f}s: {message}")
                # It waited the outage out until its deadline (a store that gave up at once would
                # raise at the first refused connection), and did not hang past it.
                assert elapsed >= deadline_s, f"raised after {elapsed:.2f}s, before the {deadline_s}s deadline"
                assert elapsed < deadline_s + 20, "the call hung instead of failing at the deadline"
                assert f"127.0.0.1:{throwaway_pg.port}" in message and "***" in message
                assert "s3cret" not in message and "s3cret" not in repr(info.value)
            assert "s3cret" not in caplog.text
            # The replays failed and were logged as an outage, with the masked URL.
            outage = [r for r in caplog.records if "retrying each call until it answers" in r.getMessage()]
            assert outage and f"127.0.0.1:{throwaway_pg.port}" in outage[0].getMessage(), caplog.text
        finally:
            throwaway_pg.start()
        # Back up: the same store instance carries on.
        assert (await store.get_rollout_by_id(rollout.rollout_id)) is not None
        await store.enqueue_rollout({"x": 3})
        await assert_consistent(store)
    finally:
        await store.close()
