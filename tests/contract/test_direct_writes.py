"""ADR 0005 decision 15: on PostgreSQL a batch of the home loop that is one prebuilt statement,
atomic on its own (claims, sequence ids, spans, attempt updates: ``BatchUnit.plan``), runs as a
coroutine on connections the home engine keeps for it: no greenlet, no pool checkout.  Whatever
keeps it from running so sends the batch through its unit, whose outcome is the calls': every kept
connection busy (the unit then checks one out), a statement that fails once sent (the unit replays
it: it may have committed), a statement that found nothing to write (the unit runs in a
transaction).  These tests pin down each of those paths, that both give the same outcome, and that
the kept connections are closed with the store.  (The whole contract suite's lifecycle writes on
PostgreSQL run on the home loop, through it.)"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from lightning_sql.store.sql import engine as engine_module
from lightning_sql.store.sql import fastexec
from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql import spans as span_units
from lightning_sql.types import EnqueueRolloutRequest
from tests.contract.test_spans import make_span

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


@pytest.fixture
async def store(store_factory: Callable[..., Any]) -> Any:
    """The contract suite's store without lazy sweeps: a sweep is a write unit of its own."""
    return store_factory(scan_debounce_seconds=3600)


def _count_units(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The batch units that ran (the path through a greenlet and a pool checkout), by name."""
    ran: list[str] = []
    for module, name in (
        (ro, "claim_batch"),
        (ro, "update_attempt_batch"),
        (span_units, "reserve_sequence_ids_batch"),
        (span_units, "add_spans_batch"),
    ):
        unit = getattr(module, name)

        def counted(*args: Any, _unit: Any = unit, _name: str = name, **kwargs: Any) -> Any:
            ran.append(_name)
            return _unit(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return ran


def _count_checkouts(store: Any) -> list[int]:
    checkouts: list[int] = []
    event.listen(store._worker._home.engine.sync_engine, "checkout", lambda *_args: checkouts.append(1))
    return checkouts


async def _lifecycles(store: Any, runners: int, tag: str, *counters: list[Any]) -> list[Any]:
    """``runners`` concurrent lifecycles (claim, sequence ids, spans, succeed) on a queue of as many
    rollouts: one batch of each kind; what each call gave, in a comparable form.  ``counters`` are
    emptied once the queue is filled (an enqueue is a unit of its own)."""
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"tag": tag, "i": i}) for i in range(runners)])
    for counter in counters:
        counter.clear()

    async def one(index: int) -> Any:
        claimed = await store.dequeue_rollout(worker_id=f"{tag}-w{index}")
        assert claimed is not None
        rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
        seqs = await store.get_many_span_sequence_ids([(rid, aid)] * 3)
        added = await store.add_many_spans([make_span(rid, aid, seq, name=f"s{seq}") for seq in seqs])
        attempt = await store.update_attempt(rid, aid, status="succeeded")
        return (
            claimed.input["i"],
            claimed.status,
            claimed.attempt.sequence_id,
            seqs,
            [span.sequence_id for span in added],
            (attempt.status, attempt.end_time is not None),
        )

    return sorted(await asyncio.gather(*(one(i) for i in range(runners))))


async def test_lifecycle_writes_run_on_the_kept_connections_and_give_what_their_units_give(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _lifecycles(store, 1, "warm")  # the home engine and its first kept connection
    home = store._worker._home
    assert home is not None and home.writer is not None
    units = _count_units(monkeypatch)
    checkouts = _count_checkouts(store)
    for runners in (1, 4):
        direct = await _lifecycles(store, runners, f"direct{runners}", units, checkouts)
        assert units == [] and checkouts == [], (runners, units)
        writer, home.writer = home.writer, None  # as LIGHTNING_SQL_PG_DIRECT_WRITES=0
        try:
            via_units = await _lifecycles(store, runners, f"units{runners}", units, checkouts)
        finally:
            home.writer = writer
        assert sorted(set(units)) == ["add_spans_batch", "claim_batch", "reserve_sequence_ids_batch", "update_attempt_batch"]
        assert len(checkouts) == len(units)
        assert direct == via_units, runners
    rollouts = await store.query_rollouts()
    assert len(rollouts) == 11 and all(r.status == "succeeded" for r in rollouts)
    workers = {w.worker_id: w for w in await store.query_workers()}
    assert all(w.status == "idle" for w in workers.values())  # update_attempt's worker sync


async def test_an_empty_queue_marks_the_worker_idle_in_the_claim_statement(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim alone runs as the batch statement, which writes the worker row either way: busy on
    what it claimed, or idle on an empty queue (what ``claim``'s two statements do)."""
    await store.enqueue_rollout({"i": 0})
    units = _count_units(monkeypatch)
    claimed = await store.dequeue_rollout(worker_id="w1")
    assert claimed is not None
    busy = await store.get_worker_by_id("w1")
    assert busy.status == "busy" and busy.current_rollout_id == claimed.rollout_id
    assert await store.dequeue_rollout(worker_id="w1") is None
    idle = await store.get_worker_by_id("w1")
    assert idle.status == "idle" and idle.last_idle_time is not None
    assert await store.dequeue_rollout(worker_id=None) is None  # no worker: nothing to write
    assert units == []


async def test_a_direct_write_that_fails_once_sent_is_replayed_by_its_unit(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement commits, then its connection fails before the rows come back: the unit runs
    the batch again as a replay, which finds what the statement did instead of doing it twice (a
    claim finds its own attempts; a finished attempt stays finished)."""
    await _lifecycles(store, 1, "warm")
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(3)])
    fetch = fastexec.fetch_prebuilt
    failures: list[int] = []

    async def lost_after_commit(conn: Any, stmt: Any, params: Any) -> Any:
        await fetch(conn, stmt, params)
        failures.append(1)
        raise ConnectionResetError("lost after the statement ran")

    units = _count_units(monkeypatch)
    monkeypatch.setattr(fastexec, "fetch_prebuilt", lost_after_commit)
    claims = await asyncio.gather(*(store.dequeue_rollout(worker_id=f"w{i}") for i in range(2)))
    alone = await store.dequeue_rollout(worker_id="w9")
    monkeypatch.setattr(fastexec, "fetch_prebuilt", fetch)
    assert len(failures) == 2 and units == ["claim_batch", "claim_batch"]
    got = [c for c in [*claims, alone] if c is not None]
    assert sorted(c.input["i"] for c in got) == [0, 1, 2]  # each claimed once, none lost
    for claimed in got:
        attempts = await store.query_attempts(claimed.rollout_id)
        assert [a.attempt_id for a in attempts] == [claimed.attempt.attempt_id]
        assert (await store.get_rollout_by_id(claimed.rollout_id)).status == "preparing"
    assert await store.dequeue_rollout(worker_id="w1") is None

    units.clear()
    monkeypatch.setattr(fastexec, "fetch_prebuilt", lost_after_commit)
    updated = await asyncio.gather(
        *(store.update_attempt(c.rollout_id, c.attempt.attempt_id, status="succeeded") for c in got)
    )
    monkeypatch.setattr(fastexec, "fetch_prebuilt", fetch)
    assert units == ["update_attempt_batch"]
    assert all(a.status == "succeeded" for a in updated)
    for claimed in got:
        assert (await store.get_rollout_by_id(claimed.rollout_id)).status == "succeeded"
        assert len(await store.query_attempts(claimed.rollout_id)) == 1


async def test_a_batch_that_finds_nothing_to_write_runs_in_a_transaction(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of updates with an unknown attempt: the statement writes nothing and the batch runs
    in a transaction, where the unknown call fails alone and the others succeed."""
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(2)])
    claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(2)]
    units = _count_units(monkeypatch)
    good, other = claimed
    outcomes = await asyncio.gather(
        store.update_attempt(good.rollout_id, good.attempt.attempt_id, status="succeeded"),
        store.update_attempt(other.rollout_id, "no-such-attempt", status="succeeded"),
        return_exceptions=True,
    )
    assert outcomes[0].status == "succeeded"
    assert isinstance(outcomes[1], ValueError) and "no-such-attempt" in str(outcomes[1])
    assert "update_attempt_batch" in units
    assert (await store.get_rollout_by_id(other.rollout_id)).status == "preparing"
    with pytest.raises(ValueError, match="no-such-attempt"):  # alone: the same error
        await store.update_attempt(other.rollout_id, "no-such-attempt", status="succeeded")


async def test_unknown_rollouts_fail_only_their_own_call(store: Any) -> None:
    """Sequence ids and spans for an unknown rollout, batched with good calls: the statement changes
    nothing, its calls run alone, only the bad one fails."""
    await store.enqueue_rollout({"i": 0})
    claimed = await store.dequeue_rollout(worker_id="w1")
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    outcomes = await asyncio.gather(
        store.get_many_span_sequence_ids([(rid, aid)]),
        store.get_many_span_sequence_ids([("no-such-rollout", aid)]),
        return_exceptions=True,
    )
    assert outcomes[0] == [1] and isinstance(outcomes[1], ValueError)
    outcomes = await asyncio.gather(
        store.add_many_spans([make_span(rid, aid, 2)]),
        store.add_many_spans([make_span("no-such-rollout", aid, 1)]),
        store.add_many_spans([make_span(rid, "no-such-attempt", 1)]),
        return_exceptions=True,
    )
    assert [s.sequence_id for s in outcomes[0]] == [2]
    assert isinstance(outcomes[1], ValueError) and "no-such-rollout" in str(outcomes[1])
    assert isinstance(outcomes[2], ValueError) and "no-such-attempt" in str(outcomes[2])
    assert [s.sequence_id for s in await store.query_spans(rid)] == [2]


async def test_writes_beyond_the_kept_connections_run_their_units(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every kept connection busy, a batch runs as its unit, on a connection of the units' pool."""
    monkeypatch.setattr(engine_module, "PG_DIRECT_WRITERS", 1)
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(4)])
    claimed = [await store.dequeue_rollout(worker_id=f"w{i}") for i in range(4)]
    home = store._worker._home
    units = _count_units(monkeypatch)
    # Two batches of one turn (sequence ids and spans): one direct, one through its unit.
    seqs, added = await asyncio.gather(
        store.get_many_span_sequence_ids([(claimed[0].rollout_id, claimed[0].attempt.attempt_id)]),
        store.add_many_spans([make_span(claimed[1].rollout_id, claimed[1].attempt.attempt_id, 1)]),
    )
    assert seqs == [1] and len(added) == 1
    assert len(units) == 1, units
    assert len(home._writers) + len(home._writing) == 1 and home.writer.sync_engine.pool.checkedout() == 1


async def test_a_finished_rollout_wakes_a_waiter_of_this_process(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The statement notifies the other processes (LISTEN/NOTIFY); the direct write itself wakes a
    waiter of this one (as a unit's commit does), without waiting for its own notification."""
    await store.enqueue_rollout({"i": 0})
    claimed = await store.dequeue_rollout(worker_id="w1")
    hub = store._worker.hub
    woken_here: list[int] = []
    wake = hub.wake

    def recorded(run_id: int | None = None) -> None:
        if any(frame.function == "settle_direct" for frame in inspect.stack(0)):
            woken_here.append(run_id)
        wake(run_id)

    monkeypatch.setattr(hub, "wake", recorded)
    waiter = asyncio.ensure_future(store.wait_for_rollouts(rollout_ids=[claimed.rollout_id], timeout=60))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
    assert woken_here == [store._run_id]
    done = await asyncio.wait_for(waiter, 20)  # generous: it separates a wake-up from the timeout
    assert [r.status for r in done] == ["succeeded"]


async def test_closing_the_store_closes_the_kept_write_connections(backend: Any, clock: Any) -> None:
    store = backend.open(run="close-direct-writes", clock=clock, clock_sync=False)
    await _lifecycles(store, 4, "close")
    home = store._worker._home
    writer_pool = home.writer.sync_engine.pool
    kept = [conn.connection._connection_record for conn, _used in home._writers]
    assert kept and not home._writing and writer_pool.checkedout() == len(kept)
    records = list(home.opened)
    await store.close()
    assert all(record in records for record in kept)
    assert all(r.dbapi_connection is None or r.dbapi_connection._connection.is_closed() for r in records)
