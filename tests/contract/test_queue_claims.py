"""Contract §2.1 (the queue) and §2.4 (claims and their worker effects), concurrency included."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import asyncpg
import pytest

from lightning_sql import AttemptedRollout, EnqueueRolloutRequest, RolloutConfig, Span
from tests.conftest import PG_URL

RETRY = RolloutConfig(max_attempts=3, retry_condition=["failed", "unresponsive", "timeout"])


async def raw_rows(backend: Any, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a plain SQL query straight from the database (not through the store)."""
    if backend.is_postgres:
        conn = await asyncpg.connect(PG_URL)
        try:
            await conn.execute(f'SET search_path TO "{backend.schema}"')
            return [tuple(r) for r in await conn.fetch(sql)]
        finally:
            await conn.close()
    path = backend.url.split("///", 1)[1]
    with sqlite3.connect(path) as conn:
        return list(conn.execute(sql).fetchall())


async def assert_queue_invariant(backend: Any, store: Any) -> None:
    """``queue_seq IS NOT NULL`` ⇔ status ∈ {queuing, requeuing}, for every rollout of the database."""
    if not backend.persistent:
        return
    bad = await raw_rows(
        backend,
        "SELECT rollout_id, status, queue_seq FROM rollouts WHERE "
        "(queue_seq IS NOT NULL) <> (status IN ('queuing', 'requeuing'))",
    )
    assert bad == []


async def drain(store: Any, worker_id: str | None = None) -> list[str]:
    """Claim everything, one at a time; the claimed rollout ids in claim order."""
    out = []
    while (ar := await store.dequeue_rollout(worker_id=worker_id)) is not None:
        out.append(ar.rollout_id)
    return out


def _span(ar: Any, seq: int = 1) -> Span:
    return Span.from_attributes(
        attributes={}, rollout_id=ar.rollout_id, attempt_id=ar.attempt.attempt_id, sequence_id=seq
    )


# --- FIFO, entering and leaving ---------------------------------------------------------------


async def test_fifo_by_enqueue_order_including_batches(backend, store):
    a = await store.enqueue_rollout("a")
    batch = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=x) for x in "bcd"])
    e = await store.enqueue_rollout("e")
    expected = [a.rollout_id, *(r.rollout_id for r in batch), e.rollout_id]
    assert [r.input for r in batch] == ["b", "c", "d"]
    assert (await store.statistics())["queue_depth"] == 5
    await assert_queue_invariant(backend, store)
    assert await drain(store) == expected
    assert (await store.statistics())["queue_depth"] == 0
    await assert_queue_invariant(backend, store)


async def test_reentry_goes_to_the_tail_by_every_path(backend, store, clock):
    """Propagation, update_rollout and the sweeper all put a re-entering rollout behind the queue."""
    lease = RolloutConfig(timeout_seconds=5, max_attempts=3, retry_condition=["timeout", "failed"])
    ra = await store.enqueue_rollout("a", config=lease)
    rb = await store.enqueue_rollout("b", config=lease)
    rc = await store.enqueue_rollout("c", config=lease)

    # 1. a failed attempt with retry → requeuing at the tail (propagation, §2.7).
    claim_a = await store.dequeue_rollout()
    assert claim_a is not None and claim_a.rollout_id == ra.rollout_id
    await store.update_attempt(ra.rollout_id, claim_a.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(ra.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    # queue: b, c, a
    claim_b = await store.dequeue_rollout()
    assert claim_b is not None and claim_b.rollout_id == rb.rollout_id
    # 2. update_rollout back into the queue → tail. queue: c, a, b
    await store.update_rollout(rb.rollout_id, status="queuing")
    claim_c = await store.dequeue_rollout()
    assert claim_c is not None and claim_c.rollout_id == rc.rollout_id
    # 3. the sweeper requeues c → tail. queue: a, b, c
    clock.advance(6)
    assert await store.sweep() == 1
    await assert_queue_invariant(backend, store)
    assert await drain(store) == [ra.rollout_id, rb.rollout_id, rc.rollout_id]


async def test_moving_inside_the_queue_keeps_the_place(backend, store):
    ids = [(await store.enqueue_rollout(i)).rollout_id for i in range(4)]
    # queuing -> requeuing, the same status again, and non-status edits keep the position.
    await store.update_rollout(ids[0], status="requeuing")
    await store.update_rollout(ids[1], status="queuing")
    await store.update_rollout(ids[2], metadata={"edited": True}, input="new")
    await store.update_rollout(ids[0], status="queuing")
    assert (await store.statistics())["queue_depth"] == 4
    await assert_queue_invariant(backend, store)
    assert await drain(store) == ids


async def test_every_way_of_leaving_the_queue(backend, store):
    """A claim, start_attempt, update_rollout, propagation and span promotion all clear queue_seq."""
    r_claim, r_start, r_update, r_prop, r_span, r_stay = [
        await store.enqueue_rollout(i, config=RETRY) for i in range(6)
    ]
    assert (await store.statistics())["queue_depth"] == 6

    first = await store.dequeue_rollout()
    assert first is not None and first.rollout_id == r_claim.rollout_id
    assert (await store.statistics())["queue_depth"] == 5

    started = await store.start_attempt(r_start.rollout_id)
    assert started.status == "preparing"
    assert (await store.statistics())["queue_depth"] == 4

    await store.update_rollout(r_update.rollout_id, status="running")
    assert (await store.statistics())["queue_depth"] == 3

    # propagation: a requeuing rollout whose latest attempt is set running leaves the queue.
    ar = await store.start_attempt(r_prop.rollout_id)
    assert (await store.statistics())["queue_depth"] == 2
    await store.update_attempt(r_prop.rollout_id, ar.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r_prop.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    assert (await store.statistics())["queue_depth"] == 3
    await store.update_attempt(r_prop.rollout_id, ar.attempt.attempt_id, status="running")
    assert (await store.get_rollout_by_id(r_prop.rollout_id)).status == "running"  # type: ignore[union-attr]
    assert (await store.statistics())["queue_depth"] == 2

    # span promotion (D3): a queuing rollout whose latest attempt sends a span becomes running.
    sp = await store.start_attempt(r_span.rollout_id)
    assert (await store.statistics())["queue_depth"] == 1
    await store.update_rollout(r_span.rollout_id, status="queuing")
    assert (await store.statistics())["queue_depth"] == 2
    await store.add_span(_span(sp))
    assert (await store.get_rollout_by_id(r_span.rollout_id)).status == "running"  # type: ignore[union-attr]
    assert (await store.statistics())["queue_depth"] == 1
    await assert_queue_invariant(backend, store)

    # Only the untouched rollout is still claimable.
    remaining = await drain(store)
    assert remaining == [r_stay.rollout_id]


async def test_finished_and_cancelled_rollouts_leave_and_reenter_at_the_tail(backend, store):
    r1 = await store.enqueue_rollout(1)
    r2 = await store.enqueue_rollout(2)
    await store.update_rollout(r1.rollout_id, status="cancelled")
    assert (await store.statistics())["queue_depth"] == 1
    await store.update_rollout(r1.rollout_id, status="requeuing")
    await assert_queue_invariant(backend, store)
    assert await drain(store) == [r2.rollout_id, r1.rollout_id]


# --- dequeue_rollout --------------------------------------------------------------------------


async def test_dequeue_creates_attempt_and_updates_rollout(store, clock):
    queued = await store.enqueue_rollout({"q": 1}, mode="train", metadata={"m": 1})
    clock.advance(3)
    ar = await store.dequeue_rollout(worker_id="Worker-0")
    assert type(ar) is AttemptedRollout
    assert ar.rollout_id == queued.rollout_id and ar.status == "preparing"
    assert (ar.input, ar.mode, ar.metadata, ar.start_time, ar.end_time) == (
        {"q": 1},
        "train",
        {"m": 1},
        queued.start_time,
        None,
    )
    att = ar.attempt
    assert att.attempt_id.startswith("at-") and len(att.attempt_id) == 11
    assert (att.rollout_id, att.sequence_id, att.status, att.start_time, att.worker_id) == (
        queued.rollout_id,
        1,
        "preparing",
        clock(),
        "Worker-0",
    )
    assert (att.end_time, att.last_heartbeat_time, att.metadata) == (None, None, None)
    assert await store.get_latest_attempt(queued.rollout_id) == att
    stored = await store.get_rollout_by_id(queued.rollout_id)
    assert stored is not None and stored.status == "preparing"


async def test_dequeue_sequence_ids_count_existing_attempts_and_keep_end_time(store, clock):
    r = await store.enqueue_rollout(1)
    first = await store.dequeue_rollout()
    assert first is not None and first.attempt.sequence_id == 1
    finished = await store.update_rollout(r.rollout_id, status="failed")
    end = finished.end_time
    assert end == clock()
    await store.start_attempt(r.rollout_id)  # attempt 2, outside the queue
    clock.advance(1)
    await store.update_rollout(r.rollout_id, status="queuing")
    clock.advance(1)
    again = await store.dequeue_rollout(worker_id=None)
    assert again is not None
    assert again.attempt.sequence_id == 3 and again.attempt.worker_id is None
    assert again.end_time == end  # untouched by the claim
    assert [a.sequence_id for a in await store.query_attempts(r.rollout_id)] == [1, 2, 3]


async def test_dequeue_on_empty_queue_returns_none(store):
    assert await store.dequeue_rollout() is None
    assert await store.dequeue_many_rollouts(limit=5) == []
    assert (await store.statistics())["total_workers"] == 0  # no worker_id, no worker row


async def test_claim_worker_effects(store, clock):
    await store.update_worker("Worker-0", heartbeat_stats={"gpu": 0.5})
    hb = clock()
    await store.enqueue_rollout(1)
    clock.advance(2)
    ar = await store.dequeue_rollout(worker_id="Worker-0")
    assert ar is not None
    w = await store.get_worker_by_id("Worker-0")
    assert w is not None
    assert (w.status, w.last_dequeue_time, w.last_busy_time) == ("busy", clock(), clock())
    assert (w.current_rollout_id, w.current_attempt_id) == (ar.rollout_id, ar.attempt.attempt_id)
    # Worker sync writes only its fields: the heartbeat survives.
    assert (w.heartbeat_stats, w.last_heartbeat_time, w.last_idle_time) == ({"gpu": 0.5}, hb, None)


async def test_empty_queue_marks_unknown_worker_idle(store, clock):
    assert await store.dequeue_rollout(worker_id="new") is None
    w = await store.get_worker_by_id("new")
    assert w is not None
    assert (w.status, w.last_idle_time, w.last_dequeue_time, w.last_busy_time) == (
        "idle",
        clock(),
        clock(),
        None,
    )
    assert (w.current_rollout_id, w.current_attempt_id, w.last_heartbeat_time) == (None, None, None)


async def test_empty_queue_turns_busy_or_unknown_worker_idle(store, clock):
    ar = await store.start_rollout(1, worker_id="busy-one")
    await store.update_worker("unknown-one")
    assert (await store.get_worker_by_id("busy-one")).status == "busy"  # type: ignore[union-attr]
    assert (await store.get_worker_by_id("unknown-one")).status == "unknown"  # type: ignore[union-attr]
    clock.advance(4)
    for wid in ("busy-one", "unknown-one"):
        assert await store.dequeue_rollout(worker_id=wid) is None
        w = await store.get_worker_by_id(wid)
        assert w is not None
        assert (w.status, w.last_idle_time, w.last_dequeue_time) == ("idle", clock(), clock())
    busy = await store.get_worker_by_id("busy-one")
    # The idle marking writes status and times only (the assignment is left as it was).
    assert busy is not None and busy.last_busy_time == ar.start_time


async def test_empty_queue_already_idle_worker_only_moves_last_dequeue_time(store, clock):
    assert await store.dequeue_rollout(worker_id="w") is None
    t_idle = clock()
    clock.advance(7)
    assert await store.dequeue_rollout(worker_id="w") is None
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.last_idle_time, w.last_dequeue_time) == ("idle", t_idle, clock())


# --- dequeue_many_rollouts --------------------------------------------------------------------


async def test_dequeue_many_claims_in_queue_order(store, clock):
    ids = [
        r.rollout_id
        for r in await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(5)])
    ]
    clock.advance(1)
    got = await store.dequeue_many_rollouts(limit=3, worker_id="Worker-3")
    assert isinstance(got, list)
    assert [g.rollout_id for g in got] == ids[:3]
    assert all(type(g) is AttemptedRollout and g.attempt.worker_id == "Worker-3" for g in got)
    assert all(g.status == "preparing" and g.attempt.sequence_id == 1 for g in got)
    w = await store.get_worker_by_id("Worker-3")
    assert w is not None and w.status == "busy"
    assert (w.current_rollout_id, w.current_attempt_id, w.last_dequeue_time) == (
        ids[2],
        got[2].attempt.attempt_id,
        clock(),
    )
    rest = await store.dequeue_many_rollouts(limit=10)
    assert [g.rollout_id for g in rest] == ids[3:]
    assert await store.dequeue_many_rollouts(limit=10) == []


@pytest.mark.parametrize("limit", [0, -1])
async def test_dequeue_many_non_positive_limit(store, clock, limit):
    await store.enqueue_rollout(1)
    assert await store.dequeue_many_rollouts(limit=limit) == []
    assert await store.dequeue_many_rollouts(limit=limit, worker_id="w") == []
    assert (await store.statistics())["queue_depth"] == 1
    w = await store.get_worker_by_id("w")
    assert w is not None and (w.status, w.last_idle_time, w.last_dequeue_time) == ("idle", clock(), clock())


async def test_dequeue_many_empty_queue_marks_worker_idle(store, clock):
    await store.start_rollout(1, worker_id="w")
    clock.advance(1)
    assert await store.dequeue_many_rollouts(limit=4, worker_id="w") == []
    w = await store.get_worker_by_id("w")
    assert w is not None and (w.status, w.last_idle_time, w.last_dequeue_time) == ("idle", clock(), clock())


# --- concurrency ------------------------------------------------------------------------------


async def test_50_concurrent_enqueues(backend, store):
    rollouts = await asyncio.gather(*(store.enqueue_rollout({"i": i}) for i in range(50)))
    ids = [r.rollout_id for r in rollouts]
    assert len(set(ids)) == 50
    assert (await store.statistics())["queue_depth"] == 50
    listed = [r.rollout_id for r in await store.query_rollouts()]
    assert sorted(listed) == sorted(ids)
    claimed = await drain(store)
    # The queue order is one consistent total order: the same as the creation order.
    assert claimed == listed
    await assert_queue_invariant(backend, store)


async def _claimers_over_queue(store: Any, n_claimers: int, n_rollouts: int, *, worker: bool) -> None:
    queued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n_rollouts)])
    results = await asyncio.gather(
        *(store.dequeue_rollout(worker_id=f"Worker-{i}" if worker else None) for i in range(n_claimers))
    )
    claims = [r for r in results if r is not None]
    assert len(claims) == n_rollouts
    assert results.count(None) == n_claimers - n_rollouts
    assert sorted(c.rollout_id for c in claims) == sorted(r.rollout_id for r in queued)
    assert len({c.attempt.attempt_id for c in claims}) == n_rollouts
    for r in queued:
        attempts = await store.query_attempts(r.rollout_id)
        assert [a.sequence_id for a in attempts] == [1]
    stats = await store.statistics()
    assert (stats["queue_depth"], stats["total_attempts"]) == (0, n_rollouts)


async def test_60_concurrent_claimers_over_20_rollouts(backend, store):
    await _claimers_over_queue(store, 60, 20, worker=True)
    busy = await store.query_workers(status_in=["busy"])
    idle = await store.query_workers(status_in=["idle"])
    assert (len(busy), len(idle)) == (20, 40)


async def test_30_concurrent_dequeues_over_20_rollouts(backend, store):
    await _claimers_over_queue(store, 30, 20, worker=False)


async def test_concurrent_dequeue_many_never_double_claims(backend, store):
    queued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(20)])
    batches = await asyncio.gather(
        *(store.dequeue_many_rollouts(limit=3, worker_id=f"w{i}") for i in range(12))
    )
    claimed = [ar.rollout_id for batch in batches for ar in batch]
    assert sorted(claimed) == sorted(r.rollout_id for r in queued)
    assert all(len(b) <= 3 for b in batches)
    if not backend.is_postgres:
        # SQLite claims one batch at a time, so every batch but the last is full: 3 x 6 + 2.
        assert sorted(len(b) for b in batches) == [0] * 5 + [2] + [3] * 6
    # On PostgreSQL concurrent claims skip each other's locked rows (SKIP LOCKED), so batches may
    # interleave and come back partly filled ("up to limit"); what must hold is that none overlaps.


async def test_concurrent_claimers_on_several_instances(backend, store_factory):
    if not backend.persistent:
        pytest.skip("an in-memory database belongs to one instance")
    stores = [store_factory() for _ in range(3)]
    queued = await stores[0].enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(20)])
    results = await asyncio.gather(*(stores[i % 3].dequeue_rollout(worker_id=f"w{i}") for i in range(45)))
    claims = [r.rollout_id for r in results if r is not None]
    assert sorted(claims) == sorted(r.rollout_id for r in queued)
    assert results.count(None) == 25
