"""Issue #2 bad input: a clear error naming the field, and nothing changed (every table compared before/after).

Also: filter values full of SQL metacharacters match literally.  ``snapshot`` and ``table_rows`` are
shared with the other contract modules (direct SQL through the store's own connection, so it works
on every backend, in-memory SQLite included).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from lightning_sql import LLM, EnqueueRolloutRequest
from lightning_sql.store.sql import schema as s
from lightning_sql.types import Span, SpanContext, TraceStatus
from tests.contract.test_spans import make_span

TABLES = [s.runs, s.rollouts, s.attempts, s.spans, s.resources, s.resource_versions, s.workers]


async def table_rows(store, table) -> list[tuple]:
    """Every row of ``table`` (all runs), sorted, read with direct SQL on the store's connection."""

    def unit(ctx, run_id, now):
        return sorted(tuple(repr(v) for v in row) for row in ctx.conn.execute(select(table)).all())

    return await store._call("test_table_rows", unit, write=False)


async def table_counts(store) -> dict[str, int]:
    def unit(ctx, run_id, now):
        return {t.name: ctx.conn.execute(select(func.count()).select_from(t)).scalar_one() for t in TABLES}

    return await store._call("test_table_counts", unit, write=False)


async def snapshot(store) -> dict[str, Any]:
    """Row counts (statistics() and direct SQL) and the full content of every table."""
    stats = dict(await store.statistics())
    stats.pop("uptime")
    return {
        "statistics": stats,
        "counts": await table_counts(store),
        "rows": {t.name: await table_rows(store, t) for t in TABLES},
    }


async def _populated(store):
    """A run with something in every table, so that 'nothing changed' is meaningful."""
    ar = await store.start_rollout({"q": 1}, worker_id="w0")
    await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    queued = await store.enqueue_rollout({"q": 2}, idempotency_key="k")
    await store.update_resources("res", {"llm": LLM(endpoint="http://x", model="m")})
    await store.update_worker("w1", heartbeat_stats={"ok": True})
    return ar, queued


def _context(*, raw: bool = False, **fields: Any) -> SpanContext:
    """A span context with ``fields`` over plain ones; ``raw``: set after validation (as a caller
    that changes a model's field does)."""
    values = {"trace_id": "0" * 32, "span_id": "1" * 16, "is_remote": False, "trace_state": {}}
    if not raw:
        return SpanContext(**{**values, **fields})
    context = SpanContext(**values)
    for name, value in fields.items():
        setattr(context, name, value)
    return context


def _with(span: Span, **fields: Any) -> Span:
    for name, value in fields.items():
        setattr(span, name, value)
    return span


def _bad_calls(store, ar, queued) -> list[tuple[str, Callable[[], Awaitable[Any]], type[Exception], str]]:
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    qid = queued.rollout_id
    return [
        # non-JSON input / metadata
        ("enqueue input", lambda: store.enqueue_rollout({"tags": {1, 2}}), TypeError, "input['tags']"),
        (
            "enqueue metadata",
            lambda: store.enqueue_rollout(1, metadata={"m": object()}),
            TypeError,
            "metadata['m']",
        ),
        ("start input", lambda: store.start_rollout(b"bytes"), TypeError, "input"),
        (
            "start metadata",
            lambda: store.start_rollout(1, metadata={"x": float("nan")}),
            ValueError,
            "metadata['x']",
        ),
        (
            "enqueue_many one bad",
            lambda: store.enqueue_many_rollouts(
                [EnqueueRolloutRequest(input=1), EnqueueRolloutRequest(input={"s": {3}})]
            ),
            TypeError,
            "requests[1].input['s']",
        ),
        ("update_rollout input", lambda: store.update_rollout(qid, input={1: "x"}), TypeError, "input"),
        (
            "update_rollout metadata with a valid status",
            lambda: store.update_rollout(qid, status="succeeded", metadata={"a": [1, {2, 3}]}),
            TypeError,
            "metadata['a'][1]",
        ),
        (
            "update_attempt metadata",
            lambda: store.update_attempt(rid, aid, status="succeeded", metadata={"e": Exception()}),
            TypeError,
            "metadata['e']",
        ),
        (
            "heartbeat stats",
            lambda: store.update_worker("w1", heartbeat_stats={"t": (1, {2})}),
            TypeError,
            "heartbeat_stats['t'][1]",
        ),
        ("span extra", lambda: store.add_span(make_span(rid, aid, 2, blob={1})), TypeError, "blob"),
        (
            "span batch",
            lambda: store.add_many_spans([make_span(rid, aid, 2), make_span(rid, aid, 3, x=float("inf"))]),
            ValueError,
            "x",
        ),
        # the span's status, context and parent (the extra column: every leaf checked)
        (
            "span status description",
            lambda: store.add_many_spans([_with(make_span(rid, aid, 2), status=TraceStatus(status_code="ERROR", description="a\x00b"))]),
            ValueError,
            "span.extra['status']['description']",
        ),
        (
            "span trace state",
            lambda: store.add_many_spans([_with(make_span(rid, aid, 2), context=_context(trace_state={"k": "\ud800"}))]),
            ValueError,
            "span.extra['context']['trace_state']['k']",
        ),
        (
            "span trace state changed after validation",
            lambda: store.add_many_spans([_with(make_span(rid, aid, 2), context=_context(trace_state={"k": {1}}, raw=True))]),
            TypeError,
            "span.extra['context']['trace_state']['k']",
        ),
        (
            "span parent",
            lambda: store.add_many_spans([_with(make_span(rid, aid, 2), parent=_context(span_id="p\x00"))]),
            ValueError,
            "span.extra['parent']['span_id']",
        ),
        # invalid status / literals
        ("rollout status", lambda: store.update_rollout(qid, status="bogus"), ValueError, "status"),
        ("rollout status None", lambda: store.update_rollout(qid, status=None), ValueError, "status"),
        ("rollout config None", lambda: store.update_rollout(qid, config=None), ValueError, "config"),
        ("attempt status", lambda: store.update_attempt(rid, aid, status="cancelled"), ValueError, "status"),
        ("mode", lambda: store.enqueue_rollout(1, mode="training"), ValueError, "mode"),
        ("config", lambda: store.enqueue_rollout(1, config={"max_attempts": 0}), ValueError, "max_attempts"),
        ("query status", lambda: store.query_rollouts(status_in="queuing"), TypeError, "status_in"),
        # pagination and sorting
        ("limit rollouts", lambda: store.query_rollouts(limit=-2), ValueError, "limit"),
        ("offset rollouts", lambda: store.query_rollouts(offset=-1), ValueError, "offset"),
        ("limit attempts", lambda: store.query_attempts(rid, limit=-2), ValueError, "limit"),
        ("offset spans", lambda: store.query_spans(rid, offset=-1), ValueError, "offset"),
        ("limit workers", lambda: store.query_workers(limit=-2), ValueError, "limit"),
        ("offset resources", lambda: store.query_resources(offset=-1), ValueError, "offset"),
        ("sort rollouts", lambda: store.query_rollouts(sort_by="nope"), ValueError, "'nope'"),
        ("sort spans", lambda: store.query_spans(rid, sort_by="nope"), ValueError, "'nope'"),
        ("sort workers", lambda: store.query_workers(sort_by="nope"), ValueError, "'nope'"),
        ("filter logic", lambda: store.query_rollouts(filter_logic="xor"), ValueError, "xor"),
        # text fields that cannot be stored
        ("NUL worker id", lambda: store.update_worker("w\x00"), ValueError, "worker_id"),
        (
            "surrogate key",
            lambda: store.enqueue_rollout(1, idempotency_key="k\ud800"),
            ValueError,
            "idempotency_key",
        ),
        ("empty key", lambda: store.enqueue_rollout(1, idempotency_key=""), ValueError, "idempotency_key"),
        ("NUL resources id", lambda: store.update_resources("r\x00", {}), ValueError, "resources_id"),
    ]


async def test_bad_input_names_the_field_and_changes_nothing(store, clock):
    ar, queued = await _populated(store)
    clock.advance(3600)  # a lazy sweep would have nothing to do anyway (no leases): it changes nothing
    before = await snapshot(store)
    failures = []
    for label, call, error, field in _bad_calls(store, ar, queued):
        try:
            await call()
        except error as exc:
            if field not in str(exc):
                failures.append(f"{label}: message {str(exc)!r} does not name {field!r}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{label}: raised {type(exc).__name__}: {exc}")
        else:
            failures.append(f"{label}: did not raise")
        after = await snapshot(store)
        if after != before:
            changed = [name for name in before["rows"] if before["rows"][name] != after["rows"][name]]
            failures.append(f"{label}: changed {changed or after['statistics']}")
            before = after
    assert failures == []


async def test_snapshot_detects_changes(store):
    # The helper itself must be able to fail: a real write changes the snapshot.
    await _populated(store)
    before = await snapshot(store)
    await store.update_worker("w1", heartbeat_stats={"ok": False})
    assert (await snapshot(store))["rows"]["workers"] != before["rows"]["workers"]
    assert (await snapshot(store))["counts"] == before["counts"]


# --- SQL metacharacters match literally -----------------------------------------------------------

NASTY = [
    "'; DROP TABLE rollouts; --",
    "%",
    "_",
    "a%b",
    "a_b",
    "it's",
    'say "hi"',
    "back\\slash",
    "\\%",
    "\\_",
    "%_%",
    "[x]",
    "*",
]


async def test_sql_metacharacters_match_literally(store):
    keyed = {}
    for i, key in enumerate(NASTY):
        keyed[key] = (await store.enqueue_rollout(i, idempotency_key=key)).rollout_id
        await store.update_worker(key)
        await store.update_resources(key, {})
    plain = await store.enqueue_rollout("plain", idempotency_key="plain")
    await store.update_worker("plain")
    await store.update_resources("plain", {})
    ar = await store.start_rollout("spans")
    await store.add_many_spans(
        [make_span(ar.rollout_id, ar.attempt.attempt_id, i, name=n) for i, n in enumerate(NASTY)]
    )
    await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 99, name="plain"))

    for key in NASTY:
        got = await store.query_rollouts(idempotency_key_in=[key])
        assert [r.rollout_id for r in got] == [keyed[key]], key
        assert [w.worker_id for w in await store.query_workers(worker_id_contains=key)] == sorted(
            (k for k in NASTY if key in k), key=NASTY.index
        ), key
        assert (await store.get_worker_by_id(key)).worker_id == key
        assert [r.resources_id for r in await store.query_resources(resources_id=key)] == [key]
        assert [r.resources_id for r in await store.query_resources(resources_id_contains=key)] == [
            k for k in NASTY if key in k
        ]
        assert (await store.get_resources_by_id(key)).resources_id == key
        assert [sp.name for sp in await store.query_spans(ar.rollout_id, name=key)] == [key]
        assert [sp.name for sp in await store.query_spans(ar.rollout_id, name_contains=key)] == [
            k for k in NASTY if key in k
        ]
        # Ids that do not exist match nothing, whatever their characters.
        assert len(await store.query_rollouts(rollout_id_in=[key])) == 0
        assert len(await store.query_rollouts(rollout_id_contains=key)) == 0
        assert await store.get_rollout_by_id(key) is None
        assert len(await store.query_spans(key)) == 0
        assert len(await store.query_attempts(key)) == 0
    # LIKE-style wildcards never act as wildcards.
    assert "plain" not in [w.worker_id for w in await store.query_workers(worker_id_contains="%")]
    assert "plain" not in [r.resources_id for r in await store.query_resources(resources_id_contains="_")]
    # Everything is still there: no statement was injected.
    stats = await store.statistics()
    assert stats["total_rollouts"] == len(NASTY) + 2
    assert stats["total_workers"] == len(NASTY) + 1
    assert plain.rollout_id in [r.rollout_id for r in await store.query_rollouts()]


async def test_nasty_values_round_trip_in_json_and_ids(store):
    payload = {key: key for key in NASTY}
    r = await store.enqueue_rollout(payload, metadata={"k": NASTY}, idempotency_key=NASTY[0])
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.input == payload and got.metadata == {"k": NASTY} and got.idempotency_key == NASTY[0]


@pytest.mark.parametrize("bad", ["x\x00y", "\ud800"])
async def test_unstorable_read_arguments_match_nothing(store, bad):
    ar, queued = await _populated(store)
    before = await snapshot(store)
    assert await store.get_rollout_by_id(bad) is None
    assert len(await store.query_rollouts(rollout_id_in=[bad, queued.rollout_id])) == 1
    assert len(await store.query_rollouts(rollout_id_in=[bad])) == 0
    assert len(await store.query_rollouts(rollout_id_contains=bad)) == 0
    assert len(await store.query_rollouts(idempotency_key_in=[bad])) == 0
    assert len(await store.query_attempts(bad)) == 0
    assert await store.get_latest_attempt(bad) is None
    assert len(await store.query_spans(bad)) == 0
    assert len(await store.query_spans(ar.rollout_id, bad)) == 0
    assert len(await store.query_spans(ar.rollout_id, name=bad)) == 0
    assert len(await store.query_spans(ar.rollout_id, name_contains=bad)) == 0
    assert await store.get_worker_by_id(bad) is None
    assert len(await store.query_workers(worker_id_contains=bad)) == 0
    assert await store.get_resources_by_id(bad) is None
    assert len(await store.query_resources(resources_id=bad)) == 0
    assert len(await store.query_resources(resources_id_contains=bad)) == 0
    assert await store.wait_for_rollouts(rollout_ids=[bad], timeout=0) == []
    assert await snapshot(store) == before
