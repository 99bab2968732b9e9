"""Spans read back decode their JSON columns on first use (``rows.DeferredSpan``): whatever a caller
does with one, it sees the span that was added, on every backend; only reading the plain columns
(ids, name, times) leaves the JSON undecoded."""

from __future__ import annotations

import copy
import json
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import text, update

from lightning_sql import SqlLightningStore
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.rows import DeferredSpan
from lightning_sql.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus
from tests.contract.test_spans import make_span


class _Holder(BaseModel):
    spans: list[Span]


async def _rich_span(store: SqlLightningStore) -> Span:
    ar = await store.start_rollout({"q": 1})
    span = make_span(
        ar.rollout_id,
        ar.attempt.attempt_id,
        1,
        parent_id="00000000000000aa",
        attributes={"z": 1, "a": [1.5, 2.5], "s": "é", "b": True},
        extra_field={"nested": [1, {"x": "y"}]},
    )
    span.status = TraceStatus(status_code="ERROR", description="boom")
    span.parent = SpanContext(trace_id=span.trace_id, span_id="00000000000000aa", is_remote=True, trace_state={"v": "1"})
    span.events = [Event(name="ev", attributes={"n": 1}, timestamp=3.0)]
    span.links = [Link(context=span.context, attributes={"l": "x"})]  # type: ignore[arg-type]
    span.resource = OtelResource(attributes={"service.name": "svc"}, schema_url="https://x")
    await store.add_span(span)
    return span


async def _read_back(store: SqlLightningStore, rollout_id: str) -> Span:
    (got,) = await store.query_spans(rollout_id)
    assert type(got) is DeferredSpan and isinstance(got, Span)
    return got


# Every way of using a span that is not reading a plain column: each must see the added span.
USES: dict[str, Callable[[Span, Span], bool]] = {
    "attributes": lambda got, want: got.attributes == want.attributes,
    "status": lambda got, want: got.status == want.status and type(got.status) is TraceStatus,
    "events and links": lambda got, want: got.events == want.events and got.links == want.links,
    "==": lambda got, want: got == want,
    "== reversed": lambda got, want: want == got,
    "model_dump": lambda got, want: got.model_dump() == want.model_dump(),
    "model_dump_json": lambda got, want: json.loads(got.model_dump_json()) == json.loads(want.model_dump_json()),
    "model_extra": lambda got, want: got.model_extra == want.model_extra,
    "an extra field": lambda got, want: got.extra_field == {"nested": [1, {"x": "y"}]},  # type: ignore[attr-defined]
    "a missing attribute": lambda got, want: not hasattr(got, "no_such_field") and getattr(got, "nope", 7) == 7,
    "model_fields_set": lambda got, want: got.model_fields_set == set(Span.model_fields),  # as every read-back
    "repr": lambda got, want: repr(got) == repr(got.model_copy()) and repr(got).startswith(f"Span(rollout_id='{want.rollout_id}'"),
    "vars": lambda got, want: vars(got) == vars(want),
    "dict()": lambda got, want: dict(got) == dict(want),
    "pickle": lambda got, want: pickle.loads(pickle.dumps(got)) == want,
    "copy": lambda got, want: copy.copy(got) == want and type(copy.copy(got).attributes) is dict,
    "copy, then a plain field": lambda got, want: copy.copy(got).sequence_id == want.sequence_id,
    "deepcopy": lambda got, want: copy.deepcopy(got) == want,
    "model_copy": lambda got, want: got.model_copy(update={"name": "n2"}).model_dump() == {**want.model_dump(), "name": "n2"},
    "model_validate": lambda got, want: Span.model_validate(got) == want,
    "TypeAdapter": lambda got, want: json.loads(TypeAdapter(list[Span]).dump_json([got])) == [want.model_dump(mode="json")],
    "in a model": lambda got, want: json.loads(_Holder(spans=[got]).model_dump_json()) == {"spans": [want.model_dump(mode="json")]},
}


@pytest.mark.parametrize("use", list(USES))
async def test_every_use_of_a_read_back_span_sees_the_added_span(store: SqlLightningStore, use: str) -> None:
    want = await _rich_span(store)
    got = await _read_back(store, want.rollout_id)
    assert USES[use](got, want)
    assert type(got) is Span  # used once: a plain Span from then on
    assert got == want and got.model_dump() == want.model_dump()


async def test_plain_columns_are_read_without_decoding(store: SqlLightningStore) -> None:
    want = await _rich_span(store)
    got = await _read_back(store, want.rollout_id)
    plain = ("rollout_id", "attempt_id", "sequence_id", "trace_id", "span_id", "parent_id", "name", "start_time", "end_time")
    assert [getattr(got, name) for name in plain] == [getattr(want, name) for name in plain]
    assert type(got) is DeferredSpan  # nothing decoded yet
    assert got.attributes == want.attributes and type(got) is Span


async def test_setting_a_field_first_keeps_the_others(store: SqlLightningStore) -> None:
    want = await _rich_span(store)
    got = await _read_back(store, want.rollout_id)
    got.name = "renamed"
    assert got.name == "renamed" and got.attributes == want.attributes and got.status == want.status
    again = await _read_back(store, want.rollout_id)
    again.attributes = {"new": 1}
    assert again.attributes == {"new": 1} and again.model_dump() == {**want.model_dump(), "attributes": {"new": 1}}
    assert again.model_fields_set == set(Span.model_fields)


async def test_a_span_shows_what_its_query_read_not_a_later_write(store: SqlLightningStore) -> None:
    """The JSON texts are taken in the query's own read: a change to the row between the query and
    the span's first use does not show (as when the span was built in the query)."""
    want = await _rich_span(store)
    got = await _read_back(store, want.rollout_id)

    def rewrite(ctx: Any, run_id: int, _now: float) -> None:
        ctx.execute(update(s.spans).where(s.spans.c.run_id == run_id).values(attributes={"later": True}))

    await store._call("test", rewrite, write=True)
    assert got.attributes == want.attributes
    assert (await _read_back(store, want.rollout_id)).attributes == {"later": True}


async def test_threads_using_one_span_at_once_see_one_realization(store: SqlLightningStore) -> None:
    """Eight threads take the span's first use together: one decodes it, all see its objects."""
    want = await _rich_span(store)
    got = await _read_back(store, want.rollout_id)
    barrier = threading.Barrier(8)
    seen: list[Any] = []

    def use() -> None:
        barrier.wait()
        seen.append((got.attributes, got.status, got.model_dump()))

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8
    assert all(a is seen[0][0] and st is seen[0][1] for a, st, _ in seen)  # one set of decoded objects
    assert all(dumped == want.model_dump() for _, _, dumped in seen)


async def test_a_stored_value_that_does_not_decode_raises_on_first_use(store: SqlLightningStore) -> None:
    """Only SQLite can hold a JSON column that is not JSON (written by hand): the query returns
    the span, its first use raises the decoder's error, and its plain columns stay readable."""
    if store.dialect != "sqlite":
        pytest.skip("PostgreSQL's JSONB holds only valid JSON")
    want = await _rich_span(store)

    def corrupt(ctx: Any, run_id: int, _now: float) -> None:
        ctx.execute(text("UPDATE spans SET attributes = '{not json' WHERE run_id = :r"), {"r": run_id})

    await store._call("test", corrupt, write=True)
    got = await _read_back(store, want.rollout_id)
    assert got.sequence_id == 1 and got.name == want.name
    with pytest.raises(ValueError):
        _ = got.attributes
    assert type(got) is DeferredSpan and got.span_id == want.span_id


async def test_a_row_of_another_shape_takes_the_general_path(store: SqlLightningStore) -> None:
    """A row whose ``extra`` lacks one of the model fields kept there (written by hand, or by an
    older writer) is built by ``_span_from_mapping``, as an eagerly read span was."""
    want = await _rich_span(store)
    status = {"status_code": "ERROR", "description": "boom"}

    def reshape(ctx: Any, run_id: int, _now: float) -> None:
        ctx.execute(update(s.spans).where(s.spans.c.run_id == run_id).values(extra={"status": status, "k": 1}))

    await store._call("test", reshape, write=True)
    got = await _read_back(store, want.rollout_id)
    assert got.status == TraceStatus(**status) and type(got) is Span
    assert got.model_extra == {"k": 1} and got.attributes == want.attributes
    assert "context" not in vars(got)  # as model_construct leaves a required field it was not given


async def test_a_plain_field_read_while_another_thread_realizes_the_span(store: SqlLightningStore) -> None:
    """A thread reading plain fields while another realizes the same spans, the interpreter switching
    threads every microsecond: every read answers the stored value, none meets a half-made span."""
    ar = await store.start_rollout({"q": 1})
    await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, k) for k in range(1, 201)])
    spans = list(await store.query_spans(ar.rollout_id))
    assert [type(sp) for sp in spans] == [DeferredSpan] * 200
    errors: list[BaseException] = []
    wrong: list[int] = []
    done = threading.Event()

    def realize_all() -> None:
        try:
            for sp in spans:
                sp.attributes  # noqa: B018
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def read_plain() -> None:
        try:
            while not done.is_set():
                for k, sp in enumerate(spans, 1):
                    if sp.sequence_id != k:
                        wrong.append(k)
        except BaseException as exc:
            errors.append(exc)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=read_plain) for _ in range(3)] + [threading.Thread(target=realize_all)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert errors == [] and wrong == []
    assert all(type(sp) is Span for sp in spans)
