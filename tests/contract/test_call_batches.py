"""Concurrent calls as one call (``engine.BatchUnit``; ADR 0005 decision 7): claims
(``rollouts.claim_batch``), sequence-id reservations (``spans.reserve_sequence_ids_batch``), span
adds of one attempt each (``spans.add_spans_batch``) and attempt updates
(``rollouts.update_attempt_batch``).

The calls of one kind that one event loop issues in the same turn run as ONE unit (the SQLite
writer's group commit; on the I/O loop of PostgreSQL and aiosqlite, one transaction): one claim of
all their rollouts, one statement for all their sequence ids.  Each call must still get what it
would get if the calls ran one after the other in that order: its share of the queue in queue
order, its attempts, its worker's row; its sequence ids.  A batch that fails is rolled back and its
calls run one by one, each with its own outcome.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from typing import Any

import pytest

from lightning_sql.store.sql import rollouts as ro
from lightning_sql.types import EnqueueRolloutRequest
from tests.contract.test_group_commit import held, queued
from tests.contract.test_spans import DUP, make_span

SQLITE = pytest.mark.parametrize("backend", ["sqlite_file", "sqlite_memory"], indirect=True)

# (worker_id, limit): None as limit is dequeue_rollout, an int dequeue_many_rollouts(limit=...).
CALLS: list[tuple[str | None, int | None]] = [
    ("w0", None),
    ("w1", 3),
    ("w0", None),  # the same worker again: its row follows its last claim
    ("w2", 0),  # claims nothing: marked idle
    (None, None),  # no worker row
    ("w3", 4),
    ("w4", None),  # the queue (10 rollouts) is empty by now: marked idle
]
# Each call's rollouts (indexes in enqueue order) when the calls run one after the other.
IN_ORDER = [[0], [1, 2, 3], [4], [], [5], [6, 7, 8, 9], []]


async def _issue(store: Any, calls: list[tuple[str | None, int | None]]) -> list[list[Any]]:
    async def one(worker_id: str | None, limit: int | None) -> list[Any]:
        if limit is None:
            ar = await store.dequeue_rollout(worker_id=worker_id)
            return [] if ar is None else [ar]
        return list(await store.dequeue_many_rollouts(limit=limit, worker_id=worker_id))

    return list(await asyncio.gather(*(one(worker_id, limit) for worker_id, limit in calls)))


async def _ready(store: Any, n: int) -> list[str]:
    """Enqueue ``n`` rollouts (a call that also binds the run and runs the lazy sweep)."""
    requests = [EnqueueRolloutRequest(input={"i": i}) for i in range(n)]
    return [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]


def _shares(ids: list[str], results: list[list[Any]]) -> list[list[int]]:
    return [[ids.index(ar.rollout_id) for ar in got] for got in results]


def _batched(store: Any) -> int:
    return int(getattr(store._worker, "batched_units", 0))


async def _check_invariants(store: Any, ids: list[str], results: list[list[Any]]) -> None:
    """What holds on every backend, in whatever order the calls ran."""
    claimed = [ar.rollout_id for got in results for ar in got]
    assert sorted(claimed) == sorted(ids)  # each rollout once, none left
    for (worker_id, limit), got in zip(CALLS, results, strict=True):
        assert len(got) <= (1 if limit is None else limit)
        for ar in got:
            assert ar.status == "preparing" and ar.attempt.status == "preparing"
            assert ar.attempt.sequence_id == 1 and ar.attempt.worker_id == worker_id
            stored = await store.get_latest_attempt(ar.rollout_id)
            assert stored is not None and stored.attempt_id == ar.attempt.attempt_id
            assert (await store.get_rollout_by_id(ar.rollout_id)).status == "preparing"
    workers = {w.worker_id: w for w in await store.query_workers()}
    assert set(workers) == {"w0", "w1", "w2", "w3", "w4"}
    for worker_id, worker in workers.items():
        theirs = [got for (wid, _limit), got in zip(CALLS, results, strict=True) if wid == worker_id]
        mine = {ar.rollout_id for got in theirs for ar in got}
        if all(theirs):  # every call of this worker claimed something: busy on one of them
            assert worker.status == "busy" and worker.current_rollout_id in mine
        elif not mine:  # none did: idle
            assert worker.status == "idle" and worker.current_rollout_id is None
        # (a worker with calls of both kinds ends as its last call left it: order-dependent)


async def test_concurrent_claims_get_their_share_once(store: Any) -> None:
    ids = await _ready(store, 10)
    results = await _issue(store, CALLS)
    await _check_invariants(store, ids, results)
    assert await store.dequeue_rollout(worker_id="late") is None


async def test_a_batch_gives_each_call_what_calls_in_order_get(store_factory: Any) -> None:
    """One loop turn's claims are one batch, and each call gets exactly its in-order share."""
    store = store_factory(scan_debounce_seconds=3600)  # one sweep (the enqueue's): claims queue in order
    ids = await _ready(store, 10)
    before = _batched(store)
    results = await _issue(store, CALLS)
    assert _batched(store) - before == len(CALLS)  # all seven ran as one claim
    assert _shares(ids, results) == IN_ORDER
    await _check_invariants(store, ids, results)
    workers = {w.worker_id: w for w in await store.query_workers()}
    assert workers["w0"].current_rollout_id == ids[4]  # its later claim
    assert workers["w3"].current_rollout_id == ids[9]  # the last of its four
    assert workers["w0"].current_attempt_id == results[2][0].attempt.attempt_id
    # Workers are created in call order (their base order), as the calls one after the other create them.
    assert [w.worker_id for w in await store.query_workers()] == ["w0", "w1", "w2", "w3", "w4"]


async def test_claims_one_by_one_match_the_batch(store_factory: Any) -> None:
    """The same calls awaited one after the other (no batch) give the same shares and worker rows."""
    sequential = store_factory(scan_debounce_seconds=3600)
    ids = await _ready(sequential, 10)
    results = []
    for call in CALLS:
        results.extend(await _issue(sequential, [call]))
    assert _batched(sequential) == 0
    assert _shares(ids, results) == IN_ORDER
    await _check_invariants(sequential, ids, results)


# Calls of distinct workers: on PostgreSQL their batch is ONE statement without a transaction, the
# claim writing their worker rows too (``dialect.ClaimingCall``); with a worker named twice (CALLS)
# it is the transaction above.
DISTINCT_CALLS: list[tuple[str | None, int | None]] = [
    ("w0", None),
    ("w1", 3),  # busy on the last of its three
    ("", None),  # an empty worker id claims, and has no row
    ("w2", 0),  # claims nothing: idle (it was busy before; it keeps its current rollout)
    (None, None),
    ("w3", 4),  # busy; it keeps its heartbeat and stats
    ("w4", None),  # the queue is empty by now: idle (it was idle already: it keeps last_idle_time)
    ("w5", 2),  # idle, a new row
]
DISTINCT_IN_ORDER = [[0], [1, 2, 3], [4], [], [5], [6, 7, 8, 9], [], []]


async def _distinct_claims(store: Any, clock: Any, *, batch: bool) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The calls of DISTINCT_CALLS on workers found in several states, issued at once (``batch``)
    or one after the other: each call's share and the worker rows (ids as enqueue indexes)."""
    clock.set(1_800_000_000.0)  # the same times for both runs
    await store.update_worker("w3", {"gpu": 1})
    await store.dequeue_rollout(worker_id="w4")  # nothing queued yet: w4 idle
    prior = await store.start_rollout(input={"prior": True}, worker_id="w2")  # w2 busy on it
    clock.advance(5)
    ids = await _ready(store, 10)
    clock.advance(5)
    if batch:
        before = _batched(store)
        results = await _issue(store, DISTINCT_CALLS)
        assert _batched(store) - before == len(DISTINCT_CALLS)
    else:
        results = [got for call in DISTINCT_CALLS for got in await _issue(store, [call])]
    label = {rid: i for i, rid in enumerate(ids)} | {prior.rollout_id: "prior"}
    attempts = {ar.attempt.attempt_id: label[ar.rollout_id] for got in results for ar in got}
    attempts[prior.attempt.attempt_id] = "prior"
    workers = []
    for worker in await store.query_workers():  # in creation order
        row = worker.model_dump()
        row["current_rollout_id"] = label.get(row["current_rollout_id"], row["current_rollout_id"])
        row["current_attempt_id"] = attempts.get(row["current_attempt_id"], row["current_attempt_id"])
        workers.append(row)
    return _shares(ids, results), workers


async def test_a_batch_of_distinct_workers_writes_each_worker_row_as_calls_in_order_do(
    store_factory: Any, clock: Any
) -> None:
    batched, batched_workers = await _distinct_claims(
        store_factory(run="batch", scan_debounce_seconds=3600), clock, batch=True
    )
    sequential, sequential_workers = await _distinct_claims(
        store_factory(run="sequential", scan_debounce_seconds=3600), clock, batch=False
    )
    assert batched == sequential == DISTINCT_IN_ORDER
    assert batched_workers == sequential_workers
    by_id = {row["worker_id"]: row for row in batched_workers}
    assert [row["worker_id"] for row in batched_workers] == ["w3", "w4", "w2", "w0", "w1", "w5"]
    assert by_id["w1"]["status"] == "busy" and by_id["w1"]["current_rollout_id"] == 3
    assert by_id["w2"]["status"] == "idle" and by_id["w2"]["current_rollout_id"] == "prior"
    assert by_id["w3"]["heartbeat_stats"] == {"gpu": 1} and by_id["w3"]["current_attempt_id"] == 9
    assert by_id["w4"]["status"] == "idle" and by_id["w4"]["last_idle_time"] < by_id["w4"]["last_dequeue_time"]
    assert by_id["w5"]["status"] == "idle" and by_id["w5"]["last_idle_time"] == by_id["w5"]["last_dequeue_time"]


class _Boom(Exception):
    pass


@pytest.mark.parametrize(
    "error",
    [_Boom("after the batch's writes"), sqlite3.OperationalError("database is locked")],
    ids=["error-of-the-batch", "transient-error"],
)
async def test_a_failing_batch_is_rolled_back_and_its_calls_run_alone(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """A batch that raises after all its writes leaves nothing behind: its calls run one by one
    (SQLite: in the same group after a savepoint rollback; the I/O loop: each alone after the
    batch's transaction) or, after a transient error, replayed (each call looking for its own
    attempts first); each rollout is still claimed once, in order."""
    real = ro.claim_batch
    failed: list[int] = []

    def failing(ctx: Any, run_id: int, calls: Any) -> Any:
        result = real(ctx, run_id, calls)
        if len(calls) > 1 and ctx.attempt == 0:  # a batch's first try
            failed.append(len(calls))
            raise error
        return result

    monkeypatch.setattr(ro, "claim_batch", failing)
    store = store_factory(scan_debounce_seconds=3600)
    ids = await _ready(store, 10)
    results = await _issue(store, CALLS)
    if isinstance(error, _Boom):
        assert failed == [len(CALLS)]  # rolled back; the calls then ran alone
        assert _batched(store) == 0
    else:  # given up and replayed (SQLite: the writer thread tries a batch again, then alone)
        assert failed and set(failed) == {len(CALLS)}
    assert _shares(ids, results) == IN_ORDER
    await _check_invariants(store, ids, results)
    attempts = [a for rid in ids for a in await store.query_attempts(rid)]
    assert len(attempts) == 10  # the rolled-back batch's attempts are gone


async def test_a_batch_that_fails_after_its_writes_leaves_each_call_its_share_once(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error after the batch's writes: in a transaction nothing stays and the calls claim again;
    without one (PostgreSQL, distinct workers: one statement, committed) the calls run alone as
    replays and find the attempts the statement made.  Either way every call gets its share once."""
    real = ro.claim_batch
    failed: list[int] = []

    def failing(ctx: Any, run_id: int, calls: Any) -> Any:
        result = real(ctx, run_id, calls)
        if len(calls) > 1 and ctx.attempt == 0:
            failed.append(len(calls))
            raise _Boom("after the batch's writes")
        return result

    monkeypatch.setattr(ro, "claim_batch", failing)
    store = store_factory(scan_debounce_seconds=3600)
    ids = await _ready(store, 10)
    results = await _issue(store, DISTINCT_CALLS)
    assert failed == [len(DISTINCT_CALLS)] and _batched(store) == 0
    assert _shares(ids, results) == DISTINCT_IN_ORDER
    attempts = [a for rid in ids for a in await store.query_attempts(rid)]
    assert len(attempts) == 10 and all(a.sequence_id == 1 for a in attempts)
    assert {a.attempt_id for a in attempts} == {ar.attempt.attempt_id for got in results for ar in got}


@SQLITE
async def test_the_writer_thread_batches_queued_claims(store_factory: Any) -> None:
    """Claims waiting in the writer thread's queue (here: behind a unit that holds the thread) are
    batched there too."""
    store = store_factory(scan_debounce_seconds=3600)
    ids = await _ready(store, 10)
    worker = store._worker
    with held(worker):
        issued = asyncio.ensure_future(_issue(store, CALLS))
        await queued(worker, len(CALLS))
    results = await issued
    assert _batched(store) == len(CALLS)
    assert _shares(ids, results) == IN_ORDER
    await _check_invariants(store, ids, results)


# --- sequence ids -----------------------------------------------------------------------------


async def test_sequence_ids_of_a_batch_are_those_of_calls_in_order(store_factory: Any) -> None:
    """Concurrent ``get_many_span_sequence_ids`` calls, several on one rollout: one batch, and each
    call gets the ids it would get with the calls awaited one after the other."""
    store = store_factory(scan_debounce_seconds=3600)
    started = [await store.start_rollout({"i": i}) for i in range(3)]
    r0, r1, r2 = [(ar.rollout_id, ar.attempt.attempt_id) for ar in started]
    calls = [[r0, r0, r0], [r1, r0], [r2], [r0, r1], [r1]]
    before = _batched(store)
    got = await asyncio.gather(*(store.get_many_span_sequence_ids(pairs) for pairs in calls))
    assert [list(ids) for ids in got] == [[1, 2, 3], [1, 4], [1], [5, 2], [3]]
    assert _batched(store) - before == len(calls)
    # The counters moved by exactly what was handed out: the next calls continue from there.
    assert list(await store.get_many_span_sequence_ids([r0, r1, r2])) == [6, 4, 2]


async def test_an_unknown_rollout_fails_its_own_call_only(store_factory: Any) -> None:
    store = store_factory(scan_debounce_seconds=3600)
    ar = await store.start_rollout({"i": 1})
    pair = (ar.rollout_id, ar.attempt.attempt_id)
    calls = [[pair, pair], [("ro-missing", "at-x"), pair], [pair]]
    got = await asyncio.gather(
        *(store.get_many_span_sequence_ids(pairs) for pairs in calls), return_exceptions=True
    )
    assert list(got[0]) == [1, 2] and list(got[2]) == [3]  # the failed call took no id
    assert isinstance(got[1], ValueError) and str(got[1]) == "Rollout ro-missing not found"
    assert list(await store.get_many_span_sequence_ids([pair])) == [4]
    assert _batched(store) == 0  # the batch failed; its calls ran alone


@SQLITE
async def test_a_sequence_id_batch_finds_its_rollouts_by_key(store_factory: Any) -> None:
    """The batch statement looks each rollout up by its key: SQLite must not plan it as a scan of
    the run's rollouts, whose cost would grow with the run."""

    from lightning_sql.store.sql import spans

    store = store_factory()
    await store.start_rollout({"i": 1})
    stmt = spans._bump_counters_sqlite()

    def plan(ctx: Any, run_id: int, _now: float) -> list[str]:
        sql = str(stmt.compile(dialect=ctx.conn.dialect))
        params = ['{"ro-x": 1}', run_id, '{"ro-x": 1}', run_id, '{"ro-x": 1}', 1]
        return [row[-1] for row in ctx.conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, tuple(params))]

    details = await store._call("test", plan, write=False)
    touching = [line for line in details if " rollouts " in f" {line} " or line.endswith(" rollouts")]
    assert touching and all("(run_id=? AND rollout_id=?)" in line for line in touching), details
    assert not any(line.startswith("SCAN rollouts") for line in details), details


# --- spans ------------------------------------------------------------------------------------


async def _span_calls(store: Any) -> tuple[list[str], list[Any]]:
    """Four rollouts (the last with a second attempt, so that spans of its first do not promote
    it) and the span adds of ``_SPAN_CALLS`` as coroutine factories: (rollout ids, calls)."""
    started = [await store.start_rollout({"i": i}) for i in range(4)]
    ids = [ar.rollout_id for ar in started]
    aids = [ar.attempt.attempt_id for ar in started]
    await store.start_attempt(ids[3])

    def span(r: int, seq: int, sid: str) -> Any:
        return make_span(ids[r], aids[r], seq, span_id=sid, trace_id=f"{r:032x}", attributes={"r": r})

    calls = [
        lambda: store.add_span(span(0, 1, "a1")),
        lambda: store.add_span(span(0, 2, "a1")),  # the key of the first call: a duplicate
        lambda: store.add_span(span(2, 7, "c7")),  # moves the counter to 7
        lambda: store.add_span(span(3, 1, "d1")),  # the rollout's earlier attempt
        lambda: store.add_many_spans([span(0, 3, "a3")]),
        # Several spans of one attempt: in the batch too (a repeat in the call).
        lambda: store.add_many_spans([span(1, 1, "b1"), span(1, 2, "b2"), span(1, 3, "b1")]),
    ]
    return ids, calls


def _span_ids(result: Any) -> Any:
    if result is None:
        return None
    if isinstance(result, (list, tuple)):
        return [sp.span_id for sp in result]
    return result.span_id


async def _span_state(store: Any, ids: list[str]) -> list[Any]:
    """What the calls leave behind, rollout by rollout: its status, its attempts' statuses and
    heartbeats, its spans (attempt number, sequence id, span id) and its next sequence id."""
    state = []
    for rid in ids:
        rollout = await store.get_rollout_by_id(rid)
        attempts = await store.query_attempts(rid)
        number = {a.attempt_id: a.sequence_id for a in attempts}
        spans = await store.query_spans(rid, None)
        latest = attempts[-1].attempt_id
        state.append(
            (
                rollout.status,
                [(a.status, a.last_heartbeat_time) for a in attempts],
                [(number[sp.attempt_id], sp.sequence_id, sp.span_id) for sp in spans],
                await store.get_next_span_sequence_id(rid, latest),
            )
        )
    return state


async def test_concurrent_span_adds_are_one_batch_with_what_calls_in_order_get(
    store_factory: Any, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Adds of spans of one attempt each issued in the same loop turn: one batch (on PostgreSQL one
    statement), and each call returns, and leaves behind, what it does with the calls awaited one
    after the other: its spans, a key repeated across calls or within one skipped (and logged)
    after its first, the counters moved, the latest attempts' rollouts promoted, the attempts
    heartbeaten."""
    start = clock()
    batched = store_factory(run="batched", scan_debounce_seconds=3600)
    ids, calls = await _span_calls(batched)
    clock.set(start + 10.0)
    before = _batched(batched)
    caplog.clear()
    got = await asyncio.gather(*(call() for call in calls))
    assert _batched(batched) - before == 6  # the calls ran as one
    expected = ["a1", None, "c7", "d1", ["a3"], ["b1", "b2"]]
    assert [_span_ids(result) for result in got] == expected
    duplicates = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Duplicated span")]
    assert len(duplicates) == 2 and DUP.format(rid=ids[0], aid=got[0].attempt_id, sid="a1") in duplicates

    clock.set(start)  # the same times as the batched store's
    sequential = store_factory(run="sequential", scan_debounce_seconds=3600)
    seq_ids, seq_calls = await _span_calls(sequential)
    clock.set(start + 10.0)
    in_order = [await call() for call in seq_calls]
    assert [_span_ids(result) for result in in_order] == expected
    state = await _span_state(batched, ids)
    assert state == await _span_state(sequential, seq_ids)
    # What that state is (the sequential store agrees above):
    assert [status for status, *_ in state] == ["running", "running", "running", "preparing"]
    assert state[0][2] == [(1, 1, "a1"), (1, 3, "a3")] and state[0][3] == 4
    assert state[2][2] == [(1, 7, "c7")] and state[2][3] == 8
    assert state[3][2] == [(1, 1, "d1")] and state[3][1][0][1] == clock() and state[3][1][1][0] != "running"


async def test_a_span_batch_with_a_missing_rollout_or_attempt_fails_those_calls_only(
    store_factory: Any,
) -> None:
    """An unknown rollout or attempt fails the batch, which wrote nothing; its calls then run alone
    and only the faulty ones fail, with the errors of a call alone."""
    store = store_factory(scan_debounce_seconds=3600)
    first, second = [await store.start_rollout({"i": i}) for i in range(2)]
    rid, aid = first.rollout_id, first.attempt.attempt_id
    calls = [
        store.add_span(make_span(rid, aid, 1, span_id="s1")),
        store.add_span(make_span("ro-missing", aid, 1)),
        store.add_many_spans([make_span(second.rollout_id, "at-missing", 1)]),
        store.add_span(make_span(second.rollout_id, second.attempt.attempt_id, 1, span_id="s2")),
    ]
    got = await asyncio.gather(*calls, return_exceptions=True)
    assert _span_ids(got[0]) == "s1" and _span_ids(got[3]) == "s2"
    assert isinstance(got[1], ValueError) and str(got[1]) == "Rollout ro-missing not found"
    assert isinstance(got[2], ValueError)
    assert str(got[2]) == f"Attempt at-missing not found for rollout {second.rollout_id}"
    assert _batched(store) == 0  # the batch failed; its calls ran alone
    assert [sp.span_id for sp in await store.query_spans(rid, None)] == ["s1"]
    assert [sp.span_id for sp in await store.query_spans(second.rollout_id, None)] == ["s2"]


async def test_span_batches_switched_off_run_each_call_alone(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LIGHTNING_SQL_SPAN_BATCHES=0``: the same calls, each its own unit, with the same outcome
    (but for which of the two calls adding the same key gets it: unbatched calls run in any order
    on PostgreSQL's connections)."""
    from lightning_sql.store.sql import spans as span_units

    monkeypatch.setattr(span_units, "SPAN_BATCHES", False)
    store = store_factory(scan_debounce_seconds=3600)
    ids, calls = await _span_calls(store)
    got = [_span_ids(result) for result in await asyncio.gather(*(call() for call in calls))]
    assert {got[0], got[1]} == {"a1", None}
    assert got[2:] == ["c7", "d1", ["a3"], ["b1", "b2"]]
    assert _batched(store) == 0
    assert [status for status, *_ in await _span_state(store, ids)] == [
        "running",
        "running",
        "running",
        "preparing",
    ]


async def test_span_adds_past_the_batch_limit_start_another_batch(
    store_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the I/O loop a batch of span adds holds ``BATCH_MAX_SPANS`` calls at most: the calls past
    it form the next batch of the same turn (which PostgreSQL runs on another connection); SQLite's
    writer, one connection anyway, keeps them in one batch.  Every call gets what it gets alone."""
    from lightning_sql.store.sql import spans as span_units
    from lightning_sql.store.sql.engine import AsyncLoopWorker

    monkeypatch.setattr(span_units, "BATCH_MAX_SPANS", 2)
    store = store_factory(scan_debounce_seconds=3600)
    started = [await store.start_rollout({"i": i}) for i in range(5)]
    pairs = [(ar.rollout_id, ar.attempt.attempt_id) for ar in started]
    got = await asyncio.gather(
        *(store.add_span(make_span(rid, aid, 1, span_id=f"s{r}")) for r, (rid, aid) in enumerate(pairs))
    )
    assert [_span_ids(result) for result in got] == [f"s{r}" for r in range(5)]
    io_loop = isinstance(store._worker, AsyncLoopWorker)
    assert _batched(store) == (4 if io_loop else 5)  # I/O loop: 2 + 2 + a call alone (not counted)
    for r, (rid, aid) in enumerate(pairs):
        assert [sp.span_id for sp in await store.query_spans(rid, aid)] == [f"s{r}"]


class _AbandoningLoop(asyncio.SelectorEventLoop):
    """An event loop that never runs the store's flush callbacks (as if it closed before its next
    turn): it keeps them in ``abandoned`` instead."""

    def __init__(self) -> None:
        super().__init__()
        self.abandoned: list[Any] = []

    def call_soon(self, callback: Any, *args: Any, context: Any = None) -> Any:
        if getattr(callback, "__name__", "") in ("_flush_soon", "_flush_batch"):
            self.abandoned.append(callback)
            return None
        return super().call_soon(callback, *args, context=context)


def _queued_for(worker: Any, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``worker`` holds units queued for ``loop``'s next turn (SQLite's inline writes, or the
    call batches of the I/O loop's workers)."""
    soon = getattr(worker, "_soon", {})
    batches = getattr(worker, "batches", {})
    return loop in soon or any(key[0] is loop for key in batches)


# The abandoned call's task is destroyed pending with its loop: that is the scenario.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_loop_closed_before_its_flush_leaves_nothing_queued(store_factory: Any) -> None:
    """Units queued for a loop's next turn whose loop closes first (a hand-run loop closed with calls
    in flight) are forgotten at the next call from another loop: they would keep the closed loop and
    their futures alive for as long as the store."""
    store = store_factory()
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(2)])
    worker = store._worker

    def abandon() -> None:
        loop = _AbandoningLoop()

        async def claim_until_queued() -> None:
            task = asyncio.ensure_future(store.dequeue_rollout(worker_id="gone"))
            for _ in range(1000):
                if _queued_for(worker, loop):
                    break
                await asyncio.sleep(0.001)
            task.cancel()  # the call stays pending: its unit is never run (cancellation is shielded)

        try:
            loop.run_until_complete(claim_until_queued())
        finally:
            loop.close()
        assert loop.abandoned and _queued_for(worker, loop)

    await asyncio.to_thread(abandon)
    claimed = await store.dequeue_rollout(worker_id="w")  # this loop's first call of a turn
    assert claimed is not None
    soon, batches = getattr(worker, "_soon", {}), getattr(worker, "batches", {})
    left = [lp for lp in soon if lp.is_closed()] + [key for key in batches if key[0].is_closed()]
    try:
        assert left == []
    finally:  # the abandoned coroutine ends here, not while pytest reports (whatever the outcome)
        for key in left:
            soon.pop(key, None)
            batches.pop(key, None)
        del left
        gc.collect()


# --- attempt updates ----------------------------------------------------------------------------


async def _attempt_calls(store: Any) -> tuple[list[str], list[Any]]:
    """Four started rollouts (the second allows a retry) and the updates a turn of runners issues:
    two on one rollout (running, then succeeded), a failure that requeues, a worker change, one
    through "latest"."""
    from lightning_sql.types import RolloutConfig

    started = [
        await store.start_rollout({"i": 0}),
        await store.start_rollout({"i": 1}, config=RolloutConfig(max_attempts=2, retry_condition=["failed"])),
        await store.start_rollout({"i": 2}),
        await store.start_rollout({"i": 3}),
    ]
    ids = [ar.rollout_id for ar in started]
    aids = [ar.attempt.attempt_id for ar in started]
    calls = [
        lambda: store.update_attempt(ids[0], aids[0], status="running", worker_id="w0"),
        lambda: store.update_attempt(ids[1], aids[1], status="failed", worker_id="w1"),
        lambda: store.update_attempt(ids[0], aids[0], status="succeeded"),
        lambda: store.update_attempt(ids[2], "latest", worker_id="w2", metadata={"k": 1}),
        lambda: store.update_attempt(ids[3], aids[3], status="succeeded", worker_id="w0"),
    ]
    return ids, calls


async def _attempt_state(store: Any, ids: list[str]) -> list[Any]:
    state = []
    for rid in ids:
        rollout = await store.get_rollout_by_id(rid)
        attempts = [(a.sequence_id, a.status, a.worker_id, a.metadata, a.end_time) for a in await store.query_attempts(rid)]
        state.append((rollout.status, rollout.end_time, attempts))
    workers = sorted(
        (w.worker_id, w.status, None if w.current_rollout_id is None else ids.index(w.current_rollout_id))
        for w in await store.query_workers()
    )
    return [state, workers]


def _attempt_view(attempts: list[Any]) -> list[Any]:
    return [(a.status, a.worker_id, a.metadata, a.end_time) for a in attempts]


async def test_concurrent_attempt_updates_are_one_batch_with_what_calls_in_order_get(
    store_factory: Any, clock: Any
) -> None:
    """``update_attempt`` calls issued in the same loop turn run as one unit (one transaction), and
    each call returns, and leaves behind, what it does with the calls awaited one after the other:
    the rollouts' statuses (a retry requeues), two updates of one attempt in call order, the
    workers' rows as their last call left them."""
    start = clock()
    batched = store_factory(run="batched", scan_debounce_seconds=3600)
    ids, calls = await _attempt_calls(batched)
    clock.set(start + 10.0)
    before = _batched(batched)
    got = await asyncio.gather(*(call() for call in calls))
    assert _batched(batched) - before == len(calls)  # the five ran as one

    clock.set(start)
    sequential = store_factory(run="sequential", scan_debounce_seconds=3600)
    seq_ids, seq_calls = await _attempt_calls(sequential)
    clock.set(start + 10.0)
    before = _batched(sequential)
    in_order = [await call() for call in seq_calls]
    assert _batched(sequential) == before  # awaited one by one: no batch
    assert _attempt_view(got) == _attempt_view(in_order)
    state = await _attempt_state(batched, ids)
    assert state == await _attempt_state(sequential, seq_ids)
    # What that state is (the sequential store agrees above):
    rollouts, workers = state
    assert [status for status, *_ in rollouts] == ["succeeded", "requeuing", "preparing", "succeeded"]
    assert rollouts[0][2] == [(1, "succeeded", "w0", None, start + 10.0)]
    assert rollouts[2][2][0][2:4] == ("w2", {"k": 1})
    assert [(s, status) for s, status, *_ in rollouts[1][2]] == [(1, "failed")]
    assert dict((w, status) for w, status, _r in workers) == {"w0": "idle", "w1": "idle", "w2": "busy"}


async def _distinct_attempt_calls(store: Any, *, one_worker: bool) -> tuple[list[str], list[Any]]:
    """Five started rollouts and one update of each (PostgreSQL writes them all in one statement): a
    success, a failure that requeues, a new worker and metadata through "latest", a heartbeat, an
    update that changes nothing; with ``one_worker``, the heartbeat's call also moves its attempt
    to the first call's worker (two calls write one worker's row)."""
    from lightning_sql.types import RolloutConfig

    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    started = [await store.start_rollout({"i": i}, config=retry if i == 1 else None) for i in range(5)]
    ids = [ar.rollout_id for ar in started]
    aids = [ar.attempt.attempt_id for ar in started]
    beat: dict[str, Any] = {"status": "running", "worker_id": "w0"} if one_worker else {}
    calls = [
        lambda: store.update_attempt(ids[0], aids[0], status="succeeded", worker_id="w0"),
        lambda: store.update_attempt(ids[1], aids[1], status="failed", worker_id="w1"),
        lambda: store.update_attempt(ids[2], "latest", worker_id="w2", metadata={"k": 1}),
        lambda: store.update_attempt(ids[3], aids[3], last_heartbeat_time=1234.5, **beat),
        lambda: store.update_attempt(ids[4], aids[4]),
    ]
    return ids, calls


@pytest.mark.parametrize("one_worker", [False, True], ids=["distinct_workers", "one_worker"])
async def test_concurrent_attempt_updates_of_distinct_rollouts_get_what_calls_in_order_get(
    store_factory: Any, clock: Any, one_worker: bool
) -> None:
    """One ``update_attempt`` of each of five rollouts in one loop turn: one unit, and each call
    returns, and leaves behind, what it does with the calls awaited one after the other (rollout
    statuses, attempts, worker rows); also when two of them write one worker's row."""
    start = clock()
    batched = store_factory(run="batched", scan_debounce_seconds=3600)
    ids, calls = await _distinct_attempt_calls(batched, one_worker=one_worker)
    clock.set(start + 10.0)
    before = _batched(batched)
    got = await asyncio.gather(*(call() for call in calls))
    assert _batched(batched) - before == len(calls)

    clock.set(start)
    sequential = store_factory(run="sequential", scan_debounce_seconds=3600)
    seq_ids, seq_calls = await _distinct_attempt_calls(sequential, one_worker=one_worker)
    clock.set(start + 10.0)
    in_order = [await call() for call in seq_calls]
    assert [a.rollout_id for a in got] == ids
    assert _attempt_view(got) == _attempt_view(in_order)
    assert [a.last_heartbeat_time for a in got] == [a.last_heartbeat_time for a in in_order]
    state = await _attempt_state(batched, ids)
    assert state == await _attempt_state(sequential, seq_ids)
    rollouts, workers = state
    assert [status for status, *_ in rollouts] == [
        "succeeded", "requeuing", "preparing", "running" if one_worker else "preparing", "preparing"
    ]
    assert rollouts[0][1] == start + 10.0 and rollouts[0][2] == [(1, "succeeded", "w0", None, start + 10.0)]
    assert rollouts[2][2] == [(1, "preparing", "w2", {"k": 1}, None)]
    assert got[3].last_heartbeat_time == 1234.5
    expected = {"w0": ("busy", 3) if one_worker else ("idle", None), "w1": ("idle", None), "w2": ("busy", 2)}
    assert {w: (status, r) for w, status, r in workers} == expected
    requeued = await batched.dequeue_rollout(worker_id="w9")
    assert requeued is not None and requeued.rollout_id == ids[1]  # the requeued rollout is in the queue


@pytest.mark.parametrize("distinct", [False, True], ids=["one_rollout_twice", "distinct_rollouts"])
async def test_an_attempt_update_batch_with_unknown_ids_fails_those_calls_only(store_factory: Any, distinct: bool) -> None:
    """A batch whose calls name a rollout or an attempt that does not exist: those calls fail with
    their own error, the others are applied once (the batch ran again call by call); with
    ``distinct``, no rollout is named twice (PostgreSQL's one-statement path)."""
    store = store_factory(scan_debounce_seconds=3600)
    first = await store.start_rollout({"i": 0})
    second = await store.start_rollout({"i": 1})
    third = await store.start_rollout({"i": 2}) if distinct else second
    got = await asyncio.gather(
        store.update_attempt(first.rollout_id, first.attempt.attempt_id, status="running"),
        store.update_attempt("ro-missing", "latest", status="succeeded"),
        store.update_attempt(third.rollout_id, "at-missing", status="succeeded"),
        store.update_attempt(second.rollout_id, second.attempt.attempt_id, status="succeeded"),
        return_exceptions=True,
    )
    assert isinstance(got[1], ValueError) and str(got[1]) == "Rollout ro-missing not found"
    assert isinstance(got[2], ValueError) and str(got[2]) == f"Attempt at-missing not found for rollout {third.rollout_id}"
    assert got[0].status == "running" and got[3].status == "succeeded"
    assert _batched(store) == 0  # the batch failed; its calls ran alone
    assert (await store.get_rollout_by_id(first.rollout_id)).status == "running"
    assert (await store.get_rollout_by_id(second.rollout_id)).status == "succeeded"
    assert [a.status for a in await store.query_attempts(third.rollout_id)] == ["preparing" if distinct else "succeeded"]
    assert [a.status for a in await store.query_attempts(second.rollout_id)] == ["succeeded"]


async def _alone_updates(store: Any, clock: Any) -> tuple[list[Any], list[Any]]:
    """``update_attempt`` calls awaited alone, of every case that PostgreSQL's one-statement path
    (``rollouts.fits_one_statement``) takes: what they returned (or raised), and the state left."""
    from lightning_sql.types import RolloutConfig

    start = clock()
    retry = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}, config=retry) for i in range(6)])
    claimed = [await store.dequeue_rollout(worker_id=w) for w in ("w0", "w1", "w2", "w3", "", None)]
    ids = [ar.rollout_id for ar in claimed]
    aids = [ar.attempt.attempt_id for ar in claimed]
    got: list[Any] = []

    async def call(rollout_id: str, attempt_id: str, **changes: Any) -> None:
        clock.set(clock() + 1.0)
        try:
            got.append(await store.update_attempt(rollout_id, attempt_id, **changes))
        except ValueError as exc:
            got.append(str(exc))

    await call(ids[0], aids[0], status="running", last_heartbeat_time=start + 0.5, metadata={"k": 1})
    await call(ids[0], aids[0], status="succeeded")
    await call(ids[0], aids[0], status="succeeded")  # again: the rollout is succeeded already
    # A requeued rollout whose latest attempt succeeds leaves the queue; then runs, then prepares.
    await call(ids[1], aids[1], status="failed")
    await call(ids[1], aids[1], status="succeeded")
    await call(ids[1], aids[1], status="running")
    await call(ids[1], aids[1], status="preparing")
    await store.update_rollout(ids[2], status="cancelled")
    await call(ids[2], aids[2], status="succeeded")  # a cancelled rollout stays cancelled
    # A retried rollout: its first attempt is no longer the latest, and its rollout does not follow it.
    await call(ids[3], aids[3], status="failed")
    second = await store.dequeue_rollout(worker_id="w3")
    assert second is not None and second.rollout_id == ids[3]
    aids.append(second.attempt.attempt_id)
    await call(ids[3], aids[3], status="succeeded")
    await call(ids[3], aids[6], status="running", metadata=None)
    await call(ids[4], aids[4], status="succeeded")  # upstream's falsy worker id: no worker row
    await call(ids[5], aids[5], status="succeeded")  # no worker
    await call(ids[3], "at-missing", status="succeeded")
    await call("ro-missing", aids[3], status="succeeded")
    return await _left_behind(store, ids, aids, got)


async def _left_behind(store: Any, ids: list[str], aids: list[str], got: list[Any]) -> tuple[list[Any], list[Any]]:
    """What ``update_attempt`` calls returned (an attempt, or the message of the error raised; the
    ids as indexes into ``ids`` and ``aids``, ``ids[3]`` as <ro-3>) and what they left behind: each
    rollout's status, end and attempts, the worker rows in creation order, and the rollout at the
    head of the queue (claimed to see it)."""

    def view(g: Any) -> Any:
        if isinstance(g, str):
            return g.replace(ids[3], "<ro-3>")
        return (ids.index(g.rollout_id), aids.index(g.attempt_id), g.status, g.end_time, g.last_heartbeat_time, g.metadata)

    state = []
    for rid in ids:
        rollout = await store.get_rollout_by_id(rid)
        attempts = [
            (a.sequence_id, a.status, a.worker_id, a.metadata, a.end_time, a.last_heartbeat_time)
            for a in await store.query_attempts(rid)
        ]
        state.append((ids.index(rid), rollout.status, rollout.end_time, attempts))
    workers = [
        (w.worker_id, w.status, w.last_idle_time, w.last_busy_time, w.current_rollout_id and ids.index(w.current_rollout_id))
        for w in await store.query_workers()
    ]
    queued = await store.dequeue_rollout(worker_id="w9")
    state.append(None if queued is None else ids.index(queued.rollout_id))
    return [view(g) for g in got], [state, workers]


async def _both_ways(
    store_factory: Any, clock: Any, monkeypatch: Any, scenario: Any
) -> tuple[tuple[list[Any], list[Any]], Any]:
    """``scenario(store, clock)`` on PostgreSQL with the one-statement paths, then again with every
    call taken through the transaction (``fits_one_statement`` says no), from the same time: its
    result (asserted equal both ways) and the first store."""
    start = clock()
    fast = store_factory(run="one-statement", scan_debounce_seconds=3600)
    one_statement = await scenario(fast, clock)
    monkeypatch.setattr(ro, "fits_one_statement", lambda _attempt_id, _changes: False)
    clock.set(start)
    slow = store_factory(run="transaction", scan_debounce_seconds=3600)
    assert await scenario(slow, clock) == one_statement
    return one_statement, fast


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_an_attempt_update_alone_in_one_statement_does_what_its_transaction_does(
    store_factory: Any, clock: Any, monkeypatch: Any
) -> None:
    """PostgreSQL runs an ``update_attempt`` awaited alone that fits one statement without a
    transaction: each call returns, raises and leaves behind what the transaction path does (the
    rollout follows only its latest attempt, never a cancelled rollout, leaves the queue; the
    worker's row, none for no worker or a falsy one)."""
    assert ro._ONE_STATEMENT_STATUSES == {"preparing", "running", "succeeded"}
    (views, (state, workers)), _fast = await _both_ways(store_factory, clock, monkeypatch, _alone_updates)
    assert views[-2:] == ["Attempt at-missing not found for rollout <ro-3>", "Rollout ro-missing not found"]
    assert [status for _i, status, *_rest in state[:6]] == ["succeeded", "preparing", "cancelled", "running", "succeeded", "succeeded"]
    assert [a[:2] for a in state[3][3]] == [(1, "succeeded"), (2, "running")]
    assert [w[0] for w in workers] == ["w0", "w1", "w2", "w3"]
    assert state[6] is None  # the queued rollout left the queue when its latest attempt ran


async def _batched_updates(store: Any, clock: Any) -> tuple[list[Any], list[Any]]:
    """Rounds of concurrent ``update_attempt`` calls of distinct rollouts, of every case that
    PostgreSQL's one-statement batch (``rollouts._update_attempts_in_one_statement``) takes, and
    the cases it leaves to the transaction (a missing rollout or attempt, two attempts of one
    worker): what the calls returned (or raised), and the state left."""
    from lightning_sql.types import RolloutConfig

    start = clock()
    retry = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}, config=retry) for i in range(8)])
    claimed = [await store.dequeue_rollout(worker_id=w) for w in ("w0", "w1", "w2", "w3", "", None, "w6", "w6")]
    ids = [ar.rollout_id for ar in claimed]
    aids = [ar.attempt.attempt_id for ar in claimed]
    await store.update_attempt(ids[3], aids[3], status="failed")  # requeued, then its second attempt
    second = await store.dequeue_rollout(worker_id="w3")
    assert second is not None and second.rollout_id == ids[3]
    aids.append(second.attempt.attempt_id)
    await store.update_attempt(ids[1], aids[1], status="failed")  # requeued: in the queue
    await store.update_rollout(ids[2], status="cancelled")
    got: list[Any] = []

    async def round_(*calls: tuple[str, str, dict[str, Any]]) -> None:
        clock.set(clock() + 1.0)
        results = await asyncio.gather(
            *(store.update_attempt(rid, aid, **changes) for rid, aid, changes in calls), return_exceptions=True
        )
        got.extend(str(r) if isinstance(r, ValueError) else r for r in results)

    await round_(
        (ids[0], aids[0], {"status": "running", "last_heartbeat_time": start + 0.5, "metadata": {"k": 1}}),
        (ids[1], aids[1], {"status": "succeeded"}),  # a queued rollout whose latest attempt succeeds
        (ids[2], aids[2], {"status": "succeeded"}),  # a cancelled rollout stays cancelled
        (ids[3], aids[3], {"status": "succeeded"}),  # not the latest attempt: the rollout does not follow
        (ids[4], aids[4], {"status": "succeeded"}),  # upstream's falsy worker id: no worker row
        (ids[5], aids[5], {"status": "succeeded"}),  # no worker
    )
    await round_(
        (ids[0], aids[0], {"status": "succeeded"}),
        (ids[1], aids[1], {"status": "running"}),
        (ids[3], aids[8], {"status": "running", "metadata": None}),
        (ids[4], aids[4], {"status": "running", "last_heartbeat_time": None}),
    )
    await round_(
        (ids[0], aids[0], {"status": "succeeded"}),  # again: the rollout is succeeded already
        (ids[1], aids[1], {"status": "preparing"}),
    )
    await round_(  # a missing attempt, a missing rollout: the transaction decides, the calls run alone
        (ids[0], aids[0], {"status": "running"}),
        (ids[3], "at-missing", {"status": "succeeded"}),
        ("ro-missing", aids[3], {"status": "succeeded"}),
    )
    await round_((ids[6], aids[6], {"status": "succeeded"}), (ids[7], aids[7], {"status": "running"}))  # one worker
    return await _left_behind(store, ids, aids, got)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_attempt_update_batches_in_one_statement_do_what_their_transaction_does(
    store_factory: Any, clock: Any, monkeypatch: Any
) -> None:
    """PostgreSQL runs a batch of ``update_attempt`` calls of distinct rollouts that each fit one
    statement as ONE statement without a transaction: each call returns, raises and leaves behind
    what the transaction path does; a batch that finds a rollout or attempt missing, or two attempts
    of one worker, runs in the transaction."""
    (views, (state, workers)), fast = await _both_ways(store_factory, clock, monkeypatch, _batched_updates)
    assert _batched(fast) >= 6 + 4 + 2 + 2  # the rounds ran as batches (the fourth's calls alone)
    assert views[13:15] == ["Attempt at-missing not found for rollout <ro-3>", "Rollout ro-missing not found"]
    assert [status for _i, status, *_rest in state[:8]] == [
        "running", "preparing", "cancelled", "running", "running", "succeeded", "succeeded", "running"
    ]
    assert [a[:2] for a in state[3][3]] == [(1, "succeeded"), (2, "running")]
    assert state[3][2] is None  # its first attempt's success did not end it
    assert [w[0] for w in workers] == ["w0", "w1", "w2", "w3", "w6"]
    w6 = workers[-1]
    assert w6[1] == "busy" and w6[2] is not None and w6[4] == 7  # the later call's row, the earlier's idle time
    assert state[8] is None  # the queued rollout left the queue when its latest attempt succeeded


async def test_calls_of_a_kind_share_their_units_batch_function_and_plan(store: Any) -> None:
    """A batchable call's unit takes its batch function and plan bound to the run once per (kind,
    run) and kept by the instance (``StoreInstance._call_batchable``): a call in flight holds no
    closures of its own, fewer objects for the collector's young collections to walk."""
    await _ready(store, 4)

    async def lifecycle() -> None:
        ar = await store.dequeue_rollout(worker_id="w")
        rid, aid = ar.rollout_id, ar.attempt.attempt_id
        seqs = await store.get_many_span_sequence_ids([(rid, aid)] * 2)
        await store.add_many_spans([make_span(rid, aid, seq) for seq in seqs])
        await store.update_attempt(rid, aid, status="succeeded")

    await lifecycle()
    kept = dict(store._batch_calls)
    assert sorted(run_batch.__name__ for run_batch, _run_id, _plan in kept) == [
        "add_spans_batch",
        "claim_batch",
        "reserve_sequence_ids_batch",
        "update_attempt_batch",
    ]
    for _ in range(3):
        await lifecycle()
    assert store._batch_calls.keys() == kept.keys()
    assert all(store._batch_calls[key] is bound for key, bound in kept.items())
