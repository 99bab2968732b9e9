"""Contract §0.3: the I/O thread, event loops, threads, processes, pickling, cancellation, unavailability."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import pickle
import threading
import time
from typing import Any

import pytest

from lightning_sql import EnqueueRolloutRequest, SqlLightningStore, StoreUnavailableError
from tests.conftest import PG_URL, require_postgres
from tests.contract.test_spans import make_span


def _opts(clock: Any, **kw: Any) -> dict[str, Any]:
    return {"clock": clock, "clock_sync": False, "scan_debounce_seconds": 0, **kw}


# --- threads and event loops ----------------------------------------------------------------------


async def test_store_used_from_a_second_thread_with_its_own_loop(store):
    ar = await store.start_rollout("shared")
    errors: list[BaseException] = []

    async def thread_work() -> None:
        for i in range(10):
            await store.enqueue_rollout({"from": "thread", "i": i})
            await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 100 + i))
        await asyncio.gather(*(store.get_next_span_sequence_id(ar.rollout_id, "x") for _ in range(10)))

    def thread_main() -> None:
        try:
            asyncio.run(thread_work())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=thread_main)
    thread.start()
    # The main loop keeps using the same instance at the same time.
    for i in range(10):
        await store.enqueue_rollout({"from": "main", "i": i})
        await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, i + 1))
    await asyncio.to_thread(thread.join, 60)
    assert not thread.is_alive() and errors == []
    stats = await store.statistics()
    assert (stats["total_rollouts"], stats["queue_depth"], stats["total_spans"]) == (21, 20, 20)
    # 20 explicit ids up to 109 and 10 reservations after them, none repeated.
    assert await store.get_next_span_sequence_id(ar.rollout_id, "x") == 120


def test_consecutive_asyncio_run_calls(backend, clock):
    store = backend.open(run="loops", **_opts(clock))
    try:
        rid = asyncio.run(store.enqueue_rollout(1)).rollout_id
        asyncio.run(store.enqueue_rollout(2))
        claimed = asyncio.run(store.dequeue_rollout(worker_id="w"))
        assert claimed.rollout_id == rid
        assert asyncio.run(store.statistics())["total_rollouts"] == 2
        # And from a fresh thread with yet another loop.
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(asyncio.run(store.query_rollouts())))
        t.start()
        t.join(30)
        assert len(result[0]) == 2
    finally:
        asyncio.run(store.close())


def test_constructor_does_no_io_and_starts_no_thread():
    before = threading.active_count()
    # Nothing listens on port 1: a constructor that connected would fail or hang.
    store = SqlLightningStore("postgresql://u:secret@127.0.0.1:1/db", run="x")
    assert threading.active_count() == before
    assert "secret" not in repr(store) and "secret" not in store.url


async def test_instances_share_the_io_worker_which_closes_with_the_last(persistent_backend, clock):
    a = persistent_backend.open(run="share", **_opts(clock))
    b = persistent_backend.open(run="share", **_opts(clock))
    await a.enqueue_rollout(1)
    await b.enqueue_rollout(2)
    worker = a._worker
    assert worker is b._worker
    await a.close()
    assert not worker.closed
    assert (await b.statistics())["total_rollouts"] == 2
    await b.close()
    assert worker.closed
    # A closed file/PostgreSQL store reattaches lazily.
    assert (await a.statistics())["total_rollouts"] == 2
    await a.close()
    await a.close()  # idempotent


async def test_closed_memory_store_raises_runtime_error(clock):
    store = SqlLightningStore("sqlite://", run="m", **_opts(clock))
    await store.enqueue_rollout(1)
    await store.close()
    with pytest.raises(RuntimeError):
        await store.statistics()


# --- processes --------------------------------------------------------------------------------------


def _child_use_pickled_store(blob: bytes, out) -> None:
    async def main() -> None:
        store = pickle.loads(blob)
        try:
            r = await store.enqueue_rollout({"from": "child"}, metadata={"pid": "child"})
            seen = (await store.statistics())["total_rollouts"]
            out.put((store.run, r.rollout_id, seen))
        finally:
            await store.close()

    asyncio.run(main())


async def test_pickled_into_a_spawned_child_and_used_there(persistent_backend, clock):
    # run=None: a generated run name, which the copy must carry over.
    store = persistent_backend.open(run=None, **_opts(clock))
    try:
        assert store.run is not None and store.run.startswith("run-")
        parent_rollout = await store.enqueue_rollout({"from": "parent"})
        blob = pickle.dumps(store)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_child_use_pickled_store, args=(blob, out))
        child.start()
        run_name, child_rid, seen = await asyncio.to_thread(out.get, True, 90)
        await asyncio.to_thread(child.join, 30)
        assert child.exitcode == 0
        assert run_name == store.run
        assert seen == 2  # the child saw the parent's rollout: same database, same run
        got = await store.query_rollouts()
        assert [r.rollout_id for r in got] == [parent_rollout.rollout_id, child_rid]
        assert got[1].input == {"from": "child"}
    finally:
        await store.close()


def test_memory_store_is_not_picklable(clock):
    store = SqlLightningStore("sqlite://", run="m", **_opts(clock))
    with pytest.raises(TypeError, match="sqlite://"):
        pickle.dumps(store)


def _child_use_inherited_store(store, out) -> None:
    async def main() -> None:
        r = await store.enqueue_rollout({"from": "forked"})
        out.put(r.rollout_id)

    asyncio.run(main())


async def test_forked_child_starts_fresh(mp_backend, clock):
    store = mp_backend.open(run="fork", **_opts(clock))
    try:
        await store.enqueue_rollout({"from": "parent"})  # the parent's I/O thread is running
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_use_inherited_store, args=(store, out))
        child.start()
        child_rid = await asyncio.to_thread(out.get, True, 60)
        await asyncio.to_thread(child.join, 30)
        assert child.exitcode == 0
        # The parent's store still works after the child used (and dropped) its inherited copy.
        assert child_rid in [r.rollout_id for r in await store.query_rollouts()]
        await store.enqueue_rollout({"from": "parent-again"})
        assert (await store.statistics())["total_rollouts"] == 3
    finally:
        await store.close()


def _child_enqueue_many(url: str, options: dict[str, Any], n: int, out) -> None:
    async def main() -> None:
        store = SqlLightningStore(url, **options)
        errors = 0
        try:
            results = await asyncio.gather(
                *(store.enqueue_rollout({"child": i}) for i in range(n)), return_exceptions=True
            )
            errors = sum(isinstance(r, BaseException) for r in results)
        finally:
            await store.close()
        out.put(errors)

    asyncio.run(main())


async def test_two_processes_write_at_once_without_lock_errors(mp_backend, clock):
    n = 60
    store = mp_backend.open(run="busy", **_opts(clock))
    try:
        await store.statistics()
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        options = mp_backend.options(run="busy", **_opts(clock))
        child = ctx.Process(target=_child_enqueue_many, args=(mp_backend.url, options, n, out))
        child.start()
        results = await asyncio.gather(
            *(store.enqueue_rollout({"parent": i}) for i in range(n)), return_exceptions=True
        )
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert await asyncio.to_thread(out.get, True, 90) == 0
        await asyncio.to_thread(child.join, 30)
        assert (await store.statistics())["total_rollouts"] == 2 * n
    finally:
        await store.close()


# --- cancellation -------------------------------------------------------------------------------------


async def _cancel_mid_flight(tasks: list[asyncio.Task], spacing: float) -> list[Any]:
    """Cancel the tasks one after the other, ``spacing`` seconds apart (0: all at once, right away)."""
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
        if spacing:
            await asyncio.sleep(spacing)
    return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("spacing", [0, 0.002, 0.01])
async def test_cancelled_claims_are_done_or_not_done(store, spacing):
    n = 20
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n)])
    await store.statistics()  # warm
    tasks = [asyncio.create_task(store.dequeue_rollout(worker_id=f"w{i}")) for i in range(n)]
    results = await _cancel_mid_flight(tasks, spacing)
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    seen = {r.rollout_id for r in results if not isinstance(r, BaseException) and r is not None}
    rollouts = await store.query_rollouts()
    queued = 0
    for r in rollouts:
        attempts = await store.query_attempts(r.rollout_id)
        if r.status == "queuing":
            assert len(attempts) == 0, r
            queued += 1
        else:
            # Claimed: exactly one attempt, owned by a worker that is busy with it.
            assert r.status == "preparing" and len(attempts) == 1, r
            worker = await store.get_worker_by_id(attempts[0].worker_id)
            assert worker.status == "busy" and worker.current_attempt_id == attempts[0].attempt_id
    assert seen <= {r.rollout_id for r in rollouts if r.status == "preparing"}
    assert (await store.statistics())["queue_depth"] == queued
    # Every queued rollout is still claimable.
    rest = await store.dequeue_many_rollouts(limit=n)
    assert len(rest) == queued


async def test_cancelled_batch_writes_are_all_or_nothing(store):
    ar = await store.start_rollout(1)
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    batches = [[make_span(rid, aid, 10 * b + i) for i in range(10)] for b in range(6)]
    span_tasks = [asyncio.create_task(store.add_many_spans(batch)) for batch in batches]
    enqueue_tasks = [
        asyncio.create_task(store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(5)]))
        for _ in range(6)
    ]
    await _cancel_mid_flight([*span_tasks, *enqueue_tasks], 0.002)
    stored = {s.span_id for s in await store.query_spans(rid)}
    for batch in batches:
        ids = {s.span_id for s in batch}
        assert ids <= stored or not (ids & stored)
    total = (await store.statistics())["total_rollouts"] - 1
    assert total % 5 == 0


# --- unreachable database -----------------------------------------------------------------------------


async def test_unreachable_postgres_raises_store_unavailable_with_masked_url():
    store = SqlLightningStore(
        "postgresql://u:secret@127.0.0.1:1/db", run="x", connect_deadline_seconds=1, clock_sync=False
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError) as e:
            await store.enqueue_rollout(1)
    finally:
        await store.close()
    assert time.monotonic() - t0 < 20
    assert isinstance(e.value, ConnectionError)
    message = str(e.value)
    assert "secret" not in message
    assert "127.0.0.1:1/db" in message and "u:***@" in message
    assert "secret" not in repr(e.value)


async def test_unknown_postgres_database_fails_at_once():
    require_postgres()
    url = PG_URL.rsplit("/", 1)[0] + "/lightning_sql_no_such_db"
    store = SqlLightningStore(url, run="x", connect_deadline_seconds=30, clock_sync=False)
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError, match="lightning_sql_no_such_db"):
            await store.statistics()
    finally:
        await store.close()
    assert time.monotonic() - t0 < 10  # not retried until the 30 s deadline
