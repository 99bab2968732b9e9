"""Contract §0.4: what JSON values the store accepts, how it rejects the rest, and how they round-trip."""

from __future__ import annotations

import datetime as dt
import decimal

import pytest
from sqlalchemy import select

from lightning_sql import LLM, MAX_JSON_BYTES, MAX_JSON_DEPTH, EnqueueRolloutRequest
from lightning_sql.store.sql import schema as s
from tests.contract.test_bad_input import snapshot
from tests.contract.test_spans import make_span


def nested(depth: int, leaf=1):
    """A value with ``depth`` levels of containers (lists and dicts alternating)."""
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


# --- rejections -------------------------------------------------------------------------------------


INPUT_REJECTIONS = [
    ({"tags": {1, 2}}, TypeError, "input['tags']: value of type set is not JSON-serialisable"),
    ({"b": b"x"}, TypeError, "input['b']: value of type bytes is not JSON-serialisable"),
    (
        [1, dt.datetime(2020, 1, 1)],
        TypeError,
        "input[1]: value of type datetime is not JSON-serialisable",
    ),
    ({"d": decimal.Decimal(1)}, TypeError, "input['d']"),
    ({"o": object()}, TypeError, "input['o']"),
    ({1: "int key"}, TypeError, "input: dict key 1 of type int"),
    ({"a": {("t",): 1}}, TypeError, "input['a']"),
    ({"x": [1.0, float("nan")]}, ValueError, "input['x'][1]: NaN"),
    ({"x": float("inf")}, ValueError, "input['x']: Infinity"),
    ({"x": float("-inf")}, ValueError, "input['x']: -Infinity"),
    ({"x": "a\x00b"}, ValueError, "input['x']: NUL"),
    ({"x\x00": 1}, ValueError, "input: dict key"),
    ({"x": ["ok", "\udc80"]}, ValueError, "input['x'][1]: lone surrogate"),
    ({"\ud83d": 1}, ValueError, "input: dict key"),
    (LLM(endpoint="e", model="m"), TypeError, "model_dump"),
]


async def test_input_rejections_name_the_path(store):
    before = await snapshot(store)
    for value, error, text in INPUT_REJECTIONS:
        with pytest.raises(error) as e:
            await store.enqueue_rollout(value)
        assert text in str(e.value), (text, str(e.value))
        with pytest.raises(error):
            await store.start_rollout(value)
    assert await snapshot(store) == before


async def test_every_json_field_is_validated(store):
    ar = await store.start_rollout(1)
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    before = await snapshot(store)
    cases = [
        (lambda: store.enqueue_rollout(1, metadata={"m": {1}}), "metadata['m']"),
        (lambda: store.update_rollout(rid, input={"i": {1}}), "input['i']"),
        (lambda: store.update_rollout(rid, metadata={"m": [{1}]}), "metadata['m'][0]"),
        (lambda: store.update_attempt(rid, aid, metadata={"m": {1}}), "metadata['m']"),
        (lambda: store.update_worker("w", heartbeat_stats={"h": {1}}), "heartbeat_stats['h']"),
        (lambda: store.add_span(make_span(rid, aid, 1, extra_field={"e": {1}})), "['extra_field']['e']"),
        (
            lambda: store.add_resources(
                {"llm": LLM(endpoint="e", model="m", sampling_parameters={"p": {1}})}
            ),
            "resources",
        ),
        (
            lambda: store.enqueue_many_rollouts([EnqueueRolloutRequest(input=1, metadata={"m": {1}})]),
            "metadata['m']",
        ),
    ]
    for call, path in cases:
        with pytest.raises(TypeError) as e:
            await call()
        assert path in str(e.value), (path, str(e.value))
    assert await snapshot(store) == before


async def test_run_metadata_is_validated_at_construction(backend, clock):
    with pytest.raises(TypeError, match=r"run_metadata\['x'\]"):
        backend.open(run="r", clock=clock, clock_sync=False, run_metadata={"x": {1}})


async def test_depth_limit(store):
    assert MAX_JSON_DEPTH == 64
    deep_ok = nested(MAX_JSON_DEPTH)
    r = await store.enqueue_rollout(deep_ok)
    assert (await store.get_rollout_by_id(r.rollout_id)).input == deep_ok
    before = await snapshot(store)
    with pytest.raises(ValueError) as e:
        await store.enqueue_rollout(nested(MAX_JSON_DEPTH + 1))
    message = str(e.value)
    assert message.startswith("input[") and "depth" in message and "64" in message
    with pytest.raises(ValueError, match=r"metadata\['m'\]"):
        await store.enqueue_rollout(1, metadata={"m": nested(MAX_JSON_DEPTH)})
    assert await snapshot(store) == before


async def test_size_limit(store):
    assert MAX_JSON_BYTES == 16 * 1024 * 1024
    before = await snapshot(store)
    with pytest.raises(ValueError) as e:
        await store.enqueue_rollout({"blob": "x" * MAX_JSON_BYTES})
    message = str(e.value)
    assert message.startswith("input") and str(MAX_JSON_BYTES) in message
    assert str(MAX_JSON_BYTES + len('{"blob":""}')) in message  # the encoded size
    # Multi-byte characters count in bytes, not characters.
    with pytest.raises(ValueError, match="metadata"):
        await store.enqueue_rollout(1, metadata={"m": "é" * (MAX_JSON_BYTES // 2)})
    assert await snapshot(store) == before


TEXT_FIELD_CALLS = [
    (lambda st: st.update_worker("w\x00"), "worker_id"),
    (lambda st: st.enqueue_rollout(1, idempotency_key="\x00"), "idempotency_key"),
    (lambda st: st.enqueue_rollout(1, resources_id="r\ud800"), "resources_id"),
    (lambda st: st.update_resources("\x00", {}), "resources_id"),
    (lambda st: st.start_rollout(1, worker_id="\udfff"), "worker_id"),
    (lambda st: st.dequeue_rollout(worker_id="a\x00"), "worker_id"),
]


async def test_text_fields_with_nul_or_lone_surrogate(store):
    before = await snapshot(store)
    for call, field in TEXT_FIELD_CALLS:
        with pytest.raises(ValueError, match=field):
            await call(store)
    assert await snapshot(store) == before


async def test_span_text_fields_with_nul(store):
    ar = await store.start_rollout(1)
    with pytest.raises(ValueError, match="name"):
        await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1, name="a\x00"))
    with pytest.raises(ValueError, match="attributes"):
        await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1, attributes={"k": "\x00"}))
    assert (await store.statistics())["total_spans"] == 0


# --- round trips --------------------------------------------------------------------------------------


async def _raw(store, column, rollout_id):
    def unit(ctx, run_id, now):
        R = s.rollouts
        return ctx.conn.execute(
            select(column.is_(None)).where(R.c.run_id == run_id, R.c.rollout_id == rollout_id)
        ).scalar_one()

    return await store._call("test_raw", unit, write=False)


async def test_none_empty_dict_and_empty_string_stay_distinct(store):
    r_none = await store.enqueue_rollout(None)
    r_dict = await store.enqueue_rollout({})
    r_str = await store.enqueue_rollout("")
    r_nested = await store.enqueue_rollout({"a": None, "b": [None]})
    assert (await store.get_rollout_by_id(r_none.rollout_id)).input is None
    assert (await store.get_rollout_by_id(r_dict.rollout_id)).input == {}
    assert (await store.get_rollout_by_id(r_str.rollout_id)).input == ""
    assert (await store.get_rollout_by_id(r_nested.rollout_id)).input == {"a": None, "b": [None]}
    # None is SQL NULL (IS NULL finds it); {} and "" are not.
    assert await _raw(store, s.rollouts.c.input, r_none.rollout_id) is True
    assert await _raw(store, s.rollouts.c.input, r_dict.rollout_id) is False
    assert await _raw(store, s.rollouts.c.input, r_str.rollout_id) is False
    # metadata None -> the store writes {}; update_rollout(metadata=None) clears it to NULL.
    assert r_none.metadata == {}
    cleared = await store.update_rollout(r_none.rollout_id, metadata=None)
    assert cleared.metadata is None
    assert (await store.get_rollout_by_id(r_none.rollout_id)).metadata is None
    assert await _raw(store, s.rollouts.c.metadata, r_none.rollout_id) is True
    await store.update_rollout(r_none.rollout_id, metadata={})
    assert (await store.get_rollout_by_id(r_none.rollout_id)).metadata == {}
    # Attempt metadata: None vs {}.
    ar = await store.start_rollout(1)
    assert (await store.get_latest_attempt(ar.rollout_id)).metadata in (None, {})
    await store.update_attempt(ar.rollout_id, "latest", metadata={})
    assert (await store.get_latest_attempt(ar.rollout_id)).metadata == {}
    await store.update_attempt(ar.rollout_id, "latest", metadata=None)
    assert (await store.get_latest_attempt(ar.rollout_id)).metadata is None
    # Worker heartbeat stats {} vs never given (None).
    assert (await store.update_worker("w")).heartbeat_stats is None
    assert (await store.update_worker("w", heartbeat_stats={})).heartbeat_stats == {}


async def test_tuples_come_back_as_lists(store):
    r = await store.enqueue_rollout((1, (2, 3), {"t": ("a",)}), metadata={"m": (1, 2)})
    assert r.input == [1, [2, 3], {"t": ["a"]}]  # the returned object already reads as stored
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.input == [1, [2, 3], {"t": ["a"]}]
    assert got.metadata == {"m": [1, 2]}


async def test_numbers_round_trip(store, backend):
    value = {
        "i": 1,
        "big": 2**53 + 1,
        "neg": -7,
        "f": 1.5,
        "whole": 2.0,
        "tiny": 1e-300,
        "t": True,
        "n": None,
    }
    r = await store.enqueue_rollout(value)
    got = (await store.get_rollout_by_id(r.rollout_id)).input
    assert got == value  # by value
    assert type(got["i"]) is int and type(got["big"]) is int and got["big"] == 2**53 + 1
    assert type(got["f"]) is float and type(got["t"]) is bool and got["n"] is None
    if not backend.is_postgres:
        assert type(got["whole"]) is float  # JSONB may return a whole-valued float as int (documented)


async def test_unicode_and_key_order(store):
    value = {"z": 1, "a": 2, "é": "ünïcödé 😀", "emoji 🚀": ["\u2028", "\t\n"]}
    r = await store.enqueue_rollout(value)
    assert (await store.get_rollout_by_id(r.rollout_id)).input == value


# Integers beyond 64 bits and floats at the edges of the double range: what a fast JSON parser can
# get wrong (orjson reads such integers as floats without an error), read back through every read
# path that decodes JSON (a rollout's input, a span's attributes and extra fields).
EXACT_NUMBERS = {
    "i64_max": 2**63 - 1,
    "i64_min": -(2**63),
    "min_normal": 2.2250738585072014e-308,
    "subnormal": 5e-324,
    "tenth": 0.1,
    "digits": 0.30000000000000004,
    "nested": [{"deep": -(2**62), "f": 1.0000000000000002}],
}


async def test_64_bit_integers_and_edge_floats_round_trip_exactly(store, backend):
    numbers = dict(EXACT_NUMBERS)
    if not backend.is_postgres:  # JSONB gives a whole-valued float back as an int (documented)
        numbers["max"] = 1.7976931348623157e308
    r = await store.start_rollout(numbers)
    got = (await store.get_rollout_by_id(r.rollout_id)).input
    assert got == numbers
    assert type(got["i64_max"]) is int and type(got["nested"][0]["deep"]) is int
    flat = {k: v for k, v in numbers.items() if k != "nested"}  # attribute values are flat
    flat["ints"], flat["floats"] = [2**62, -(2**63)], [5e-324, 0.1]
    span = make_span(r.rollout_id, r.attempt.attempt_id, attributes=flat, numbers=numbers)
    await store.add_span(span)
    (read,) = await store.query_spans(r.rollout_id, "latest")
    assert read.attributes == flat and read.model_extra["numbers"] == numbers
    assert type(read.attributes["i64_min"]) is int and type(read.model_extra["numbers"]["i64_max"]) is int


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**70, 10**40])
async def test_integers_past_64_bits_are_refused_and_nothing_is_written(store, value):
    """Not every reader of the store keeps them (SQLite gives a top-level one back as a float, most
    SQL and DataFrame tools have no such integers): refused with the path, before any I/O."""
    with pytest.raises(ValueError, match=r"input\['n'\]\[0\]: integer .* is outside the signed 64-bit range"):
        await store.enqueue_rollout({"n": [value]})
    r = await store.start_rollout(1)
    with pytest.raises(ValueError, match="outside the signed 64-bit range"):
        await store.add_span(make_span(r.rollout_id, r.attempt.attempt_id, attributes={"k": value}))
    assert len(await store.query_rollouts()) == 1 and len(await store.query_spans(r.rollout_id)) == 0
