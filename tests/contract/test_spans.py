"""Contract §2.9: span writes, sequence counters, heartbeats and promotion (every backend).

``make_span`` and ``real_otel_span`` are shared with the other contract modules.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from lightning_sql import Event, Link, OtelResource, Span, SpanContext, TraceStatus

DUP = "Duplicated span added for rollout={rid}, attempt={aid}, span={sid}. Skipping."


def make_span(
    rollout_id: str,
    attempt_id: str,
    sequence_id: int = 1,
    *,
    span_id: str | None = None,
    trace_id: str | None = None,
    parent_id: str | None = None,
    name: str = "step",
    start_time: float | None = 1.0,
    end_time: float | None = 2.0,
    attributes: dict[str, Any] | None = None,
    **extra: Any,
) -> Span:
    """A fully specified span (random OTel-formatted ids unless given); extras become extra fields."""
    trace_id = trace_id or secrets.token_hex(16)
    span_id = span_id or secrets.token_hex(8)
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=name,
        status=TraceStatus(status_code="OK"),
        attributes=attributes if attributes is not None else {"k": "v"},
        events=[],
        links=[],
        start_time=start_time,
        end_time=end_time,
        context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
        parent=None,
        resource=OtelResource(attributes={"service.name": "test"}, schema_url=""),
        **extra,
    )


_PROVIDER = TracerProvider()


def real_otel_span(name: str = "otel-op", **attributes: Any) -> ReadableSpan:
    """A real, ended opentelemetry-sdk span (a ``ReadableSpan``)."""
    tracer = _PROVIDER.get_tracer("lightning_sql.tests")
    with tracer.start_as_current_span("parent"):
        span = tracer.start_span(name, attributes=attributes or {"gen_ai.system": "test"})
        span.add_event("ev", {"n": 1})
        span.end()
    assert isinstance(span, ReadableSpan)
    return span


async def _started(store: Any) -> tuple[str, str]:
    ar = await store.start_rollout({"q": 1})
    return ar.rollout_id, ar.attempt.attempt_id


# --- add_span ---------------------------------------------------------------------------------


async def test_add_span_returns_the_same_object_and_round_trips(store):
    rid, aid = await _started(store)
    span = make_span(rid, aid, 1, extra_field={"nested": [1, {"x": "y"}]}, flag=True)
    assert await store.add_span(span) is span
    (got,) = await store.query_spans(rid)
    assert got == span
    assert got.model_extra == {"extra_field": {"nested": [1, {"x": "y"}]}, "flag": True}


async def test_read_back_status_context_and_resource_are_the_written_ones(store):
    """The sub-models of a span read back equal the written ones, extras included, and belong to
    that span alone (the read path adopts a decoded dict as a model's own state when its keys are
    the model's fields in order, and copies it otherwise)."""
    rid, aid = await _started(store)
    plain = make_span(rid, aid, 1)
    context = SpanContext(
        trace_id=plain.trace_id, span_id="00f067aa0ba902b7", is_remote=True, trace_state={"a": "b"}
    )
    odd = make_span(rid, aid, 2).model_copy(
        update={
            "status": TraceStatus(status_code="ERROR", description="boom", detail=7),  # an extra field
            "context": context,
            "parent": SpanContext.model_validate({**context.model_dump(), "flags": 1}),  # another one
        }
    )
    await store.add_many_spans([plain, odd])
    first, second = await store.query_spans(rid)
    assert [first, second] == [plain, odd]
    for got, written in ((first, plain), (second, odd)):
        # Fields in definition order, as written, on every backend (JSONB returns keys in its own order).
        parts = ("status", "context", "parent", "resource")
        assert [None if getattr(got, p) is None else getattr(got, p).model_dump_json() for p in parts] == [
            None if getattr(written, p) is None else getattr(written, p).model_dump_json() for p in parts
        ]
    assert first.status.model_extra == {} and second.status.model_extra == {"detail": 7}
    assert second.parent is not None and second.parent.model_extra == {"flags": 1}
    assert first.context is not None and first.context.model_extra == {}
    first.status.description = "changed here"
    first.resource.attributes["added"] = "here"
    again, _ = await store.query_spans(rid)
    assert again == plain and second.status.description == "boom"


async def test_duplicate_span_returns_none_logs_error_and_gives_no_heartbeat(store, clock, caplog):
    rid, aid = await _started(store)
    span = make_span(rid, aid, 1)
    assert await store.add_span(span) is span
    before = await store.get_latest_attempt(rid)
    clock.advance(30)
    dup = make_span(rid, aid, 5, span_id=span.span_id, name="other")
    with caplog.at_level(logging.ERROR):
        assert await store.add_span(dup) is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [DUP.format(rid=rid, aid=aid, sid=span.span_id)]
    after = await store.get_latest_attempt(rid)
    assert after.last_heartbeat_time == before.last_heartbeat_time  # no heartbeat for a duplicate
    spans = await store.query_spans(rid)
    assert [s.name for s in spans] == ["step"]  # the original is kept
    # The same span id under another attempt is a different span.
    ar2 = await store.start_attempt(rid)
    assert await store.add_span(make_span(rid, ar2.attempt.attempt_id, 1, span_id=span.span_id)) is not None


async def test_sequence_counter_is_the_max_of_explicit_ids(store):
    rid, aid = await _started(store)
    await store.add_span(make_span(rid, aid, 7))
    assert await store.get_next_span_sequence_id(rid, aid) == 8
    await store.add_span(make_span(rid, aid, 3))  # lower: counter unchanged
    assert await store.get_next_span_sequence_id(rid, aid) == 9
    # sequence_id is not unique: many spans may share one.
    await store.add_span(make_span(rid, aid, 9))
    await store.add_span(make_span(rid, aid, 9))
    assert [s.sequence_id for s in await store.query_spans(rid)] == [3, 7, 9, 9]


async def test_span_heartbeat_and_attempt_status(store, clock):
    rid, aid = await _started(store)
    clock.advance(5)
    await store.add_span(make_span(rid, aid, 1))
    att = await store.get_latest_attempt(rid)
    assert att.status == "running" and att.last_heartbeat_time == clock()
    # unresponsive -> running
    await store.update_attempt(rid, aid, status="unresponsive")
    clock.advance(5)
    await store.add_span(make_span(rid, aid, 2))
    att = await store.get_latest_attempt(rid)
    assert att.status == "running" and att.last_heartbeat_time == clock()
    # timeout / failed / succeeded keep their status but still get the heartbeat.
    for status in ("timeout", "failed", "succeeded"):
        await store.update_attempt(rid, aid, status=status)
        clock.advance(5)
        await store.add_span(make_span(rid, aid, 3))
        att = await store.get_latest_attempt(rid)
        assert att.status == status and att.last_heartbeat_time == clock()


async def test_span_heartbeat_writes_only_its_columns(store, clock):
    rid, aid = await _started(store)
    await store.update_attempt(rid, aid, metadata={"keep": 1}, worker_id="w-keep")
    await store.add_span(make_span(rid, aid, 1))
    att = await store.get_latest_attempt(rid)
    assert att.metadata == {"keep": 1} and att.worker_id == "w-keep"
    # Span arrival does not sync workers.
    assert (await store.get_worker_by_id("w-keep")).status == "busy"
    w = await store.get_worker_by_id("w-keep")
    await store.add_span(make_span(rid, aid, 2))
    assert await store.get_worker_by_id("w-keep") == w


@pytest.mark.parametrize("queued_status", ["queuing", "requeuing"])
async def test_span_promotes_queued_rollout_and_removes_it_from_queue(store, clock, queued_status):
    r = await store.enqueue_rollout({"q": 1})
    ar = await store.dequeue_rollout()
    aid = ar.attempt.attempt_id
    await store.update_rollout(r.rollout_id, status=queued_status)
    assert (await store.statistics())["queue_depth"] == 1
    clock.advance(3)
    await store.add_span(make_span(r.rollout_id, aid, 1))
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.status == "running" and got.end_time is None
    assert (await store.statistics())["queue_depth"] == 0
    assert await store.dequeue_rollout() is None


async def test_span_promotes_preparing_rollout_but_not_from_old_attempt_or_finished(store):
    rid, aid1 = await _started(store)
    await store.add_span(make_span(rid, aid1, 1))
    assert (await store.get_rollout_by_id(rid)).status == "running"
    ar2 = await store.start_attempt(rid)
    assert (await store.get_rollout_by_id(rid)).status == "preparing"
    # A span of the older attempt makes that attempt running but leaves the rollout alone.
    await store.update_attempt(rid, aid1, status="unresponsive")
    assert (await store.get_rollout_by_id(rid)).status == "preparing"
    await store.add_span(make_span(rid, aid1, 2))
    assert (await store.query_attempts(rid))[0].status == "running"
    assert (await store.get_rollout_by_id(rid)).status == "preparing"
    # A finished rollout is not promoted; end_time untouched.
    await store.update_rollout(rid, status="succeeded")
    before = await store.get_rollout_by_id(rid)
    await store.add_span(make_span(rid, ar2.attempt.attempt_id, 3))
    after = await store.get_rollout_by_id(rid)
    assert after.status == "succeeded" and after.end_time == before.end_time


# --- add_many_spans ---------------------------------------------------------------------------


async def test_add_many_spans_groups_counters_and_heartbeats(store, clock):
    rid1, a1 = await _started(store)
    rid2, a2 = await _started(store)
    a1b = (await store.start_attempt(rid1)).attempt.attempt_id
    clock.advance(10)
    batch = [
        make_span(rid2, a2, 4, name="r2-a"),
        make_span(rid1, a1, 9, name="r1a1-a"),
        make_span(rid2, a2, 2, name="r2-b"),
        make_span(rid1, a1b, 3, name="r1a1b-a"),
        make_span(rid1, a1, 1, name="r1a1-b"),
    ]
    out = await store.add_many_spans(batch)
    # Group order (first seen), input order inside a group; the very input objects.
    assert [s.name for s in out] == ["r2-a", "r2-b", "r1a1-a", "r1a1-b", "r1a1b-a"]
    assert all(any(o is b for b in batch) for o in out)
    assert await store.get_next_span_sequence_id(rid1, a1) == 10  # max over both attempts of rid1
    assert await store.get_next_span_sequence_id(rid2, a2) == 5
    for rid in (rid1, rid2):
        for att in await store.query_attempts(rid):
            assert att.status == "running" and att.last_heartbeat_time == clock()
    assert await store.add_many_spans([]) == []


async def test_every_span_write_path_stores_the_json_columns_as_written(store):
    """Spans of one attempt (the one-statement path on PostgreSQL), of several attempts in one call
    and of three or more (the look-up and ``executemany`` path on SQLite) read back equal to the
    written ones: each path encodes every JSON column once (a text encoded twice reads back as a
    JSON string)."""
    rid1, a1 = await _started(store)
    rid2, a2 = await _started(store)

    def rich(rid: str, aid: str, seq: int) -> Span:
        span = make_span(
            rid,
            aid,
            seq,
            attributes={"k": ["a", "b"], "n": 3, "s": "t"},
            extra_field={"n": [seq, {"x": "y"}]},
        )
        return span.model_copy(
            update={
                "status": TraceStatus(status_code="ERROR", description="boom"),
                "events": [Event(name="e", attributes={"a": 1}, timestamp=1.5)],
                "links": [Link(context=span.context, attributes={"b": "c"})],
            }
        )

    one = [rich(rid1, a1, 1)]
    several = [rich(rid1, a1, 2), rich(rid2, a2, 1), rich(rid1, a1, 3), rich(rid2, a2, 2)]
    assert await store.add_span(one[0]) is one[0]
    assert len(await store.add_many_spans(several)) == 4
    assert list(await store.query_spans(rid1)) == [one[0], several[0], several[2]]
    assert list(await store.query_spans(rid2)) == [several[1], several[3]]
    for got in (*await store.query_spans(rid1), *await store.query_spans(rid2)):
        assert isinstance(got.attributes, dict) and isinstance(got.events[0].attributes, dict)


async def test_add_many_spans_is_all_or_nothing(store):
    rid, aid = await _started(store)
    good = [make_span(rid, aid, 5), make_span(rid, aid, 6)]
    for bad in (make_span(rid, "at-nope", 50), make_span("ro-nope", aid, 50)):
        with pytest.raises(ValueError):
            await store.add_many_spans([*good, bad])
    # A JSON problem in a later span also rejects the whole batch.
    with pytest.raises(TypeError, match=r"span\.extra\['blob'\]"):
        await store.add_many_spans([*good, make_span(rid, aid, 50, blob={1, 2})])
    assert (await store.statistics())["total_spans"] == 0
    assert (await store.get_latest_attempt(rid)).status == "preparing"
    assert await store.get_next_span_sequence_id(rid, aid) == 1


async def test_add_many_spans_skips_duplicates(store, clock, caplog):
    rid, aid = await _started(store)
    first = make_span(rid, aid, 1)
    await store.add_span(first)
    clock.advance(1)
    dup_existing = make_span(rid, aid, 2, span_id=first.span_id)
    new = make_span(rid, aid, 3)
    dup_in_batch = make_span(rid, aid, 4, span_id=new.span_id)
    with caplog.at_level(logging.ERROR):
        out = await store.add_many_spans([dup_existing, new, dup_in_batch])
    assert out == [new] and out[0] is new
    messages = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert messages == sorted(
        [DUP.format(rid=rid, aid=aid, sid=first.span_id), DUP.format(rid=rid, aid=aid, sid=new.span_id)]
    )
    assert len(await store.query_spans(rid)) == 2
    # A batch made only of duplicates inserts nothing and gives no heartbeat.
    hb = (await store.get_latest_attempt(rid)).last_heartbeat_time
    clock.advance(1)
    assert await store.add_many_spans([make_span(rid, aid, 9, span_id=first.span_id)]) == []
    assert (await store.get_latest_attempt(rid)).last_heartbeat_time == hb


async def test_a_large_batch_over_two_attempts_skips_stored_duplicates_per_attempt(store, clock, caplog):
    """Batches of more than two spans take SQLite's look-up + executemany path: a span id stored under
    one attempt is a duplicate there only; the other attempt's span with the same id is new."""
    rid, aid = await _started(store)
    other_rid, other_aid = await _started(store)
    stored = [make_span(rid, aid, i) for i in range(1, 4)]
    await store.add_many_spans(stored)
    hb_other = (await store.get_latest_attempt(other_rid)).last_heartbeat_time
    clock.advance(1)
    batch = [
        make_span(rid, aid, 10, span_id=stored[0].span_id),  # stored: duplicate
        make_span(other_rid, other_aid, 1, span_id=stored[0].span_id),  # same id, other attempt: new
        make_span(rid, aid, 11),
        make_span(rid, aid, 12, span_id=stored[2].span_id),  # stored: duplicate
        make_span(rid, aid, 13),
        make_span(other_rid, other_aid, 2),
    ]
    with caplog.at_level(logging.ERROR):
        out = await store.add_many_spans(batch)
    assert out == [batch[2], batch[4], batch[1], batch[5]]  # group order, input order inside a group
    messages = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert messages == sorted(DUP.format(rid=rid, aid=aid, sid=sp.span_id) for sp in (stored[0], stored[2]))
    assert [sp.sequence_id for sp in await store.query_spans(rid)] == [1, 2, 3, 11, 13]
    assert [sp.sequence_id for sp in await store.query_spans(other_rid)] == [1, 2]
    assert (await store.get_latest_attempt(other_rid)).last_heartbeat_time != hb_other
    # Only duplicates, more than two of them: nothing inserted, no heartbeat.
    hb = (await store.get_latest_attempt(rid)).last_heartbeat_time
    clock.advance(1)
    again = [make_span(rid, aid, 20 + i, span_id=sp.span_id) for i, sp in enumerate(stored)]
    assert await store.add_many_spans(again) == []
    assert (await store.get_latest_attempt(rid)).last_heartbeat_time == hb


# --- add_otel_span ------------------------------------------------------------------------------


async def test_add_otel_span_with_a_real_sdk_span(store):
    rid, aid = await _started(store)
    otel = real_otel_span("llm-call", **{"gen_ai.model": "m", "n": 3})
    got = await store.add_otel_span(rid, aid, otel)
    assert isinstance(got, Span)
    assert got.sequence_id == 1
    assert got.name == "llm-call"
    assert got.trace_id == format(otel.context.trace_id, "032x")
    assert got.span_id == format(otel.context.span_id, "016x")
    assert got.parent_id == format(otel.parent.span_id, "016x")
    assert got.attributes == {"gen_ai.model": "m", "n": 3}
    assert [e.name for e in got.events] == ["ev"]
    assert {"kind", "instrumentation_scope"} <= set(got.model_extra or {})
    (stored,) = await store.query_spans(rid)
    assert stored == got
    assert (await store.add_otel_span(rid, aid, real_otel_span())).sequence_id == 2
    assert (await store.add_otel_span(rid, aid, real_otel_span(), sequence_id=10)).sequence_id == 10
    assert await store.get_next_span_sequence_id(rid, aid) == 11
    # Duplicate -> None.
    assert await store.add_otel_span(rid, aid, otel) is None


async def test_add_otel_span_failure_consumes_no_sequence_number(store):
    rid, aid = await _started(store)
    with pytest.raises(ValueError) as e:
        await store.add_otel_span("ro-missing", aid, real_otel_span())
    assert str(e.value) == "Rollout ro-missing not found"
    with pytest.raises(ValueError) as e:
        await store.add_otel_span(rid, "at-missing", real_otel_span())
    assert str(e.value) == f"Attempt at-missing not found for rollout {rid}"
    with pytest.raises(ValueError):
        await store.add_otel_span(rid, "at-missing", real_otel_span(), sequence_id=50)
    assert await store.get_next_span_sequence_id(rid, aid) == 1
    assert (await store.statistics())["total_spans"] == 0


# --- sequence ids -------------------------------------------------------------------------------


async def test_get_next_span_sequence_id_interleaves_with_explicit_ids(store):
    rid, aid = await _started(store)
    assert await store.get_next_span_sequence_id(rid, aid) == 1
    await store.add_otel_span(rid, aid, real_otel_span(), sequence_id=2)
    assert await store.get_next_span_sequence_id(rid, aid) == 3
    await store.add_otel_span(rid, aid, real_otel_span(), sequence_id=4)
    aid2 = (await store.start_attempt(rid)).attempt.attempt_id
    assert await store.get_next_span_sequence_id(rid, aid2) == 5
    await store.add_otel_span(rid, aid2, real_otel_span(), sequence_id=100)
    assert await store.get_next_span_sequence_id(rid, aid) == 101
    # The attempt id is neither used nor validated by the counter calls.
    assert await store.get_next_span_sequence_id(rid, "at-whatever") == 102
    with pytest.raises(ValueError) as e:
        await store.get_next_span_sequence_id("ro-missing", aid)
    assert str(e.value) == "Rollout ro-missing not found"


async def test_get_many_span_sequence_ids(store):
    a, a1 = await _started(store)
    b, b1 = await _started(store)
    a2 = (await store.start_attempt(a)).attempt.attempt_id
    assert list(await store.get_many_span_sequence_ids([(a, a1), (b, b1), (a, a2), (a, a1)])) == [1, 1, 2, 3]
    assert await store.get_next_span_sequence_id(a, a1) == 4
    assert await store.get_next_span_sequence_id(b, b1) == 2
    assert list(await store.get_many_span_sequence_ids([])) == []
    with pytest.raises(ValueError) as e:
        await store.get_many_span_sequence_ids([(a, a1), ("ro-missing", "x"), (b, b1)])
    assert str(e.value) == "Rollout ro-missing not found"
    assert await store.get_next_span_sequence_id(a, a1) == 5  # nothing reserved by the failed call
    assert await store.get_next_span_sequence_id(b, b1) == 3


async def test_30_concurrent_otel_span_writers_get_exactly_1_to_30(store):
    rid, aid = await _started(store)
    spans = [real_otel_span(f"op-{i}") for i in range(30)]
    results = await asyncio.gather(*(store.add_otel_span(rid, aid, sp) for sp in spans))
    assert sorted(r.sequence_id for r in results) == list(range(1, 31))
    stored = await store.query_spans(rid)
    assert [s.sequence_id for s in stored] == list(range(1, 31))
    assert {s.name for s in stored} == {f"op-{i}" for i in range(30)}
    assert await store.get_next_span_sequence_id(rid, aid) == 31


async def test_concurrent_sequence_reservations_never_repeat(store):
    rid, aid = await _started(store)
    singles = [store.get_next_span_sequence_id(rid, aid) for _ in range(10)]
    batches = [store.get_many_span_sequence_ids([(rid, aid)] * 3) for _ in range(5)]
    results = await asyncio.gather(*singles, *batches)
    values = [v for r in results for v in (r if isinstance(r, list | tuple) else [r])]
    assert sorted(values) == list(range(1, 26))
