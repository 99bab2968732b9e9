"""Contract §0.5 (id formats) and §0.6 (missing ids and errors: the whole table, exact messages)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from lightning_sql import generate_id
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


async def test_sort_order_and_filter_logic_name_the_value(store):
    with pytest.raises(ValueError, match="upwards"):
        await store.query_rollouts(sort_order="upwards")
    with pytest.raises(ValueError, match="nand"):
        await store.query_rollouts(filter_logic="nand")
    with pytest.raises(ValueError, match="nand"):
        await store.query_spans("ro-x", filter_logic="nand")
    with pytest.raises(ValueError, match="nand"):
        await store.query_workers(filter_logic="nand")


