"""Contract §0.5 (id formats) and §0.6 (missing ids and errors: the whole table, exact messages)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from lightning_sql import SqlLightningStore, generate_id
from tests.contract.test_bad_input import snapshot
from tests.contract.test_spans import make_span, real_otel_span

# --- §0.5 id formats --------------------------------------------------------------------------------


def test_generate_id():
    for n in (4, 8, 12, 40):
        value = generate_id(n)
        assert re.fullmatch(f"[0-9a-f]{{{n}}}", value)
    assert len({generate_id(12) for _ in range(1000)}) == 1000


async def test_id_formats(store):
    ar = await store.start_rollout(1)
    assert re.fullmatch(r"ro-[0-9a-f]{12}", ar.rollout_id)
    assert re.fullmatch(r"at-[0-9a-f]{8}", ar.attempt.attempt_id)
    r = await store.enqueue_rollout(2)
    assert re.fullmatch(r"ro-[0-9a-f]{12}", r.rollout_id)
    claimed = await store.dequeue_rollout()
    assert re.fullmatch(r"at-[0-9a-f]{8}", claimed.attempt.attempt_id)
    res = await store.add_resources({})
    assert re.fullmatch(r"rs-[0-9a-f]{12}", res.resources_id)
    span = await store.add_otel_span(ar.rollout_id, ar.attempt.attempt_id, real_otel_span())
    assert re.fullmatch(r"[0-9a-f]{32}", span.trace_id)
    assert re.fullmatch(r"[0-9a-f]{16}", span.span_id)
    # Caller-chosen ids are legal.
    for rid in ("v1", "default"):
        assert (await store.update_resources(rid, {})).resources_id == rid
    await store.start_rollout(3, worker_id="Worker-0")
    assert (await store.get_worker_by_id("Worker-0")).status == "busy"


# --- §0.6 the errors table ----------------------------------------------------------------------------


async def test_missing_ids_return_none(store):
    queued = await store.enqueue_rollout(1)
    await store.add_resources({})
    assert await store.get_rollout_by_id("ro-missing") is None
    assert await store.get_latest_attempt("ro-missing") is None
    assert await store.get_latest_attempt(queued.rollout_id) is None
    assert await store.get_resources_by_id("rs-missing") is None
    assert await store.get_resources_by_id("rs-missing", version=1) is None
    res = await store.update_resources("known", {})
    assert await store.get_resources_by_id("known", version=res.version + 1) is None
    assert await store.get_worker_by_id("nobody") is None


async def test_missing_ids_give_empty_paginated_results(store):
    ar = await store.start_rollout(1)
    queued = await store.enqueue_rollout(2)
    cases = [
        store.query_attempts("ro-missing", limit=5, offset=2),
        store.query_spans("ro-missing", limit=5, offset=2),
        store.query_spans(ar.rollout_id, "at-missing", limit=5, offset=2),
        store.query_spans(queued.rollout_id, "latest", limit=5, offset=2),
        store.query_spans("ro-missing", "latest", limit=5, offset=2),
    ]
    for coro in cases:
        result = await coro
        assert (list(result), result.limit, result.offset, result.total) == ([], 5, 2, 0)


async def test_wait_for_rollouts_unknown_ids(store):
    r = await store.enqueue_rollout(1)
    await store.update_rollout(r.rollout_id, status="succeeded")
    got = await store.wait_for_rollouts(rollout_ids=["ro-missing", r.rollout_id, "ro-other"], timeout=None)
    assert [x.rollout_id for x in got] == [r.rollout_id]


async def test_counter_calls_need_a_rollout(store):
    ar = await store.start_rollout(1)
    before = await snapshot(store)
    for call in (
        lambda: store.get_next_span_sequence_id("ro-missing", ar.attempt.attempt_id),
        lambda: store.get_many_span_sequence_ids([(ar.rollout_id, "x"), ("ro-missing", "x")]),
        lambda: store.add_otel_span("ro-missing", ar.attempt.attempt_id, real_otel_span()),
    ):
        with pytest.raises(ValueError) as e:
            await call()
        assert str(e.value) == "Rollout ro-missing not found"
    assert await snapshot(store) == before
    # An unknown attempt of an existing rollout is accepted by the two counter calls.
    assert await store.get_next_span_sequence_id(ar.rollout_id, "at-unknown") == 1
    assert list(await store.get_many_span_sequence_ids([(ar.rollout_id, "at-unknown")])) == [2]


async def test_unknown_resources_id_is_accepted_verbatim(store):
    r = await store.enqueue_rollout(1, resources_id="rs-nope")
    assert (r.resources_id, r.resources_version) == ("rs-nope", None)
    ar = await store.start_rollout(1, resources_id="rs-nope")
    assert (ar.resources_id, ar.resources_version) == ("rs-nope", None)
    (many,) = await store.enqueue_many_rollouts([{"input": 1, "resources_id": "rs-nope"}])
    assert many.resources_id == "rs-nope"


async def test_existing_idempotency_key_returns_the_rollout_unchanged(store):
    first = await store.enqueue_rollout({"v": 1}, idempotency_key="k")
    await store.dequeue_rollout()
    again = await store.enqueue_rollout({"v": 2}, mode="val", idempotency_key="k")
    assert again.rollout_id == first.rollout_id
    assert (again.input, again.status, again.mode) == ({"v": 1}, "preparing", None)
    assert (await store.statistics())["total_rollouts"] == 1


async def test_update_resources_unknown_id_creates_it(store):
    got = await store.update_resources("fresh", {})
    assert (got.resources_id, got.version) == ("fresh", 1)


async def test_update_rollout_unknown(store):
    with pytest.raises(ValueError) as e:
        await store.update_rollout("ro-missing", status="failed")
    assert str(e.value) == "Item does not exist with primary key(s): rollout_id='ro-missing'"


@pytest.mark.parametrize("method", ["update_attempt", "touch_attempt"])
async def test_update_and_touch_attempt_resolution_errors(store, method):
    async def call(rid, aid):
        if method == "update_attempt":
            return await store.update_attempt(rid, aid, status="running")
        return await store.touch_attempt(rid, aid)

    with pytest.raises(ValueError) as e:
        await call("ro-missing", "latest")
    assert str(e.value) == "Rollout ro-missing not found"
    queued = await store.enqueue_rollout(1)
    for aid in ("latest", "at-12345678"):
        with pytest.raises(ValueError) as e:
            await call(queued.rollout_id, aid)
        assert str(e.value) == f"No attempts found for rollout {queued.rollout_id}"
    ar = await store.start_rollout(1)
    with pytest.raises(ValueError) as e:
        await call(ar.rollout_id, "at-missing")
    assert str(e.value) == f"Attempt at-missing not found for rollout {ar.rollout_id}"
    assert (await call(ar.rollout_id, "latest")).attempt_id == ar.attempt.attempt_id


async def test_start_attempt_unknown_rollout(store):
    with pytest.raises(ValueError) as e:
        await store.start_attempt("ro-missing")
    assert str(e.value) == "Rollout ro-missing not found"


async def test_span_adds_missing_rollout_or_attempt(store):
    ar = await store.start_rollout(1)
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    calls = {
        "add_span": lambda r, a: store.add_span(make_span(r, a, 1)),
        "add_many_spans": lambda r, a: store.add_many_spans([make_span(rid, aid, 1), make_span(r, a, 1)]),
        "add_otel_span": lambda r, a: store.add_otel_span(r, a, real_otel_span()),
    }
    before = await snapshot(store)
    for name, call in calls.items():
        with pytest.raises(ValueError) as e:
            await call("ro-missing", aid)
        assert str(e.value) == "Rollout ro-missing not found", name
        with pytest.raises(ValueError) as e:
            await call(rid, "at-missing")
        assert str(e.value) == f"Attempt at-missing not found for rollout {rid}", name
    assert await snapshot(store) == before


async def test_update_worker_heartbeat_stats_none(store):
    with pytest.raises(TypeError, match="heartbeat_stats"):
        await store.update_worker("w", heartbeat_stats=None)


async def test_invalid_literals_are_validation_errors(store):
    ar = await store.start_rollout(1)
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    before = await snapshot(store)
    for call in (
        lambda: store.update_rollout(rid, status="bogus"),
        lambda: store.update_rollout(rid, status=None),
        lambda: store.update_rollout(rid, config=None),
        lambda: store.update_rollout(rid, mode="bogus"),
        lambda: store.update_attempt(rid, aid, status="cancelled"),
        lambda: store.update_attempt(rid, aid, status="queuing"),
        lambda: store.update_attempt(rid, aid, status=None),
        lambda: store.enqueue_rollout(1, mode="training"),
    ):
        with pytest.raises(ValidationError):
            await call()
    assert issubclass(ValidationError, ValueError)
    assert await snapshot(store) == before


async def test_unknown_sort_by_message(store):
    with pytest.raises(ValueError) as e:
        await store.query_rollouts(sort_by="bogus")
    assert str(e.value) == "Failed to sort items by 'bogus': field does not exist on Rollout"


async def test_sort_order_and_filter_logic_name_the_value(store):
    with pytest.raises(ValueError, match="upwards"):
        await store.query_rollouts(sort_order="upwards")
    with pytest.raises(ValueError, match="nand"):
        await store.query_rollouts(filter_logic="nand")
    with pytest.raises(ValueError, match="nand"):
        await store.query_spans("ro-x", filter_logic="nand")
    with pytest.raises(ValueError, match="nand"):
        await store.query_workers(filter_logic="nand")


@pytest.mark.parametrize("flag", ["create_run", "read_only"])
async def test_unknown_run_is_refused_naming_it_and_listing_runs(persistent_backend, clock, flag):
    existing = persistent_backend.open(run="existing-run", clock=clock, clock_sync=False)
    probe = persistent_backend.open(
        run="no-such-run", clock=clock, clock_sync=False, **{flag: flag == "read_only"}
    )
    try:
        await existing.statistics()  # creates "existing-run"
        with pytest.raises(ValueError) as e:
            await probe.query_rollouts()
        assert "no-such-run" in str(e.value) and "existing-run" in str(e.value)
        assert [r.name for r in await probe.list_runs()] == ["existing-run"]  # nothing was created
    finally:
        await probe.close()
        await existing.close()


async def test_read_only_store_refuses_writes_before_io(backend, clock):
    ro = SqlLightningStore(
        "postgresql://u:secret@127.0.0.1:1/db" if backend.is_postgres else "sqlite://",
        run="r",
        read_only=True,
        clock=clock,
        clock_sync=False,
    )
    ar_id = "ro-x"
    calls = {
        "start_rollout": lambda: ro.start_rollout(1),
        "enqueue_rollout": lambda: ro.enqueue_rollout(1),
        "enqueue_many_rollouts": lambda: ro.enqueue_many_rollouts([]),
        "dequeue_rollout": lambda: ro.dequeue_rollout(),
        "dequeue_many_rollouts": lambda: ro.dequeue_many_rollouts(limit=2),
        "start_attempt": lambda: ro.start_attempt(ar_id),
        "update_rollout": lambda: ro.update_rollout(ar_id, status="failed"),
        "update_attempt": lambda: ro.update_attempt(ar_id, "latest", status="failed"),
        "touch_attempt": lambda: ro.touch_attempt(ar_id, "latest"),
        "add_span": lambda: ro.add_span(make_span(ar_id, "at-x", 1)),
        "add_many_spans": lambda: ro.add_many_spans([make_span(ar_id, "at-x", 1)]),
        "add_otel_span": lambda: ro.add_otel_span(ar_id, "at-x", real_otel_span()),
        "get_next_span_sequence_id": lambda: ro.get_next_span_sequence_id(ar_id, "at-x"),
        "get_many_span_sequence_ids": lambda: ro.get_many_span_sequence_ids([(ar_id, "at-x")]),
        "add_resources": lambda: ro.add_resources({}),
        "update_resources": lambda: ro.update_resources("r", {}),
        "update_worker": lambda: ro.update_worker("w"),
        "sweep": lambda: ro.sweep(),
        "mark_run_finished": lambda: ro.mark_run_finished(),
        "delete_run": lambda: ro.delete_run("r"),
    }
    for name, call in calls.items():
        with pytest.raises(PermissionError) as e:
            await call()
        assert name in str(e.value)
    assert ro._worker is None  # no I/O happened
    await ro.close()
