"""The hot paths: SQLite reads and writes in the caller's thread (writes grouped per loop turn),
models built without validation, JSON decoded straight by the C scanner.  Each must give exactly
what the slower path gives."""

from __future__ import annotations

import asyncio
import gc
import json
import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import func, insert, select
from sqlalchemy.exc import DBAPIError

from lightning_sql import SqlLightningStore
from lightning_sql.store.sql import engine as eng
from lightning_sql.store.sql import fastexec
from lightning_sql.store.sql import rollouts as ro_module
from lightning_sql.store.sql import rows as rows_module
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql import spans as spans_module
from lightning_sql.store.sql.rows import construct
from lightning_sql.types import (
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    Event,
    Link,
    OtelResource,
    Rollout,
    RolloutConfig,
    Span,
    SpanContext,
    TraceStatus,
    Worker,
)
from tests.contract.test_spans import make_span


def _state(model: Any) -> tuple[list[tuple[str, Any]], set[str], Any, Any]:
    return (
        list(model.__dict__.items()),  # values and their order (model_dump's key order)
        model.__pydantic_fields_set__,
        model.__pydantic_extra__,
        model.__pydantic_private__,
    )


CONSTRUCT_CASES: list[tuple[type[Any], dict[str, Any]]] = [
    (TraceStatus, {"status_code": "OK", "description": None}),
    (TraceStatus, {"status_code": "ERROR"}),  # a defaulted field missing: model_construct's path
    (TraceStatus, {"description": "d", "status_code": "OK", "vendor": 1}),  # another order, an extra
    (SpanContext, {"trace_id": "t", "span_id": "s", "is_remote": False, "trace_state": {"a": "b"}}),
    (Event, {"name": "e", "attributes": {"k": [1, 2]}, "timestamp": 1.5}),
    (Link, {"context": SpanContext(trace_id="t", span_id="s", is_remote=True, trace_state={}), "attributes": None}),
    (OtelResource, {"attributes": {"service.name": "x"}, "schema_url": ""}),
    (Attempt, {"rollout_id": "r", "attempt_id": "a", "sequence_id": 1, "start_time": 1.0}),
    (
        Attempt,
        {
            "rollout_id": "r",
            "attempt_id": "a",
            "sequence_id": 1,
            "start_time": 1.0,
            "end_time": None,
            "status": "running",
            "worker_id": "w",
            "last_heartbeat_time": 2.0,
            "metadata": {"k": 1},
        },
    ),
    (RolloutConfig, {"timeout_seconds": None, "unresponsive_seconds": 3.0, "max_attempts": 2, "retry_condition": []}),
    (Worker, {"worker_id": "w", "status": "idle"}),
]


@pytest.mark.parametrize(("cls", "values"), CONSTRUCT_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_construct_builds_what_model_construct_builds(cls: type[Any], values: dict[str, Any]) -> None:
    before = dict(values)
    built = construct(cls, values)
    expected = cls.model_construct(**values)
    assert type(built) is cls
    assert _state(built) == _state(expected)
    assert built == expected and built.model_dump() == expected.model_dump()
    assert values == before  # the caller's dict is not consumed
    built.__pydantic_fields_set__.add("x")  # each model has a set of its own
    assert "x" not in construct(cls, values).__pydantic_fields_set__


@pytest.mark.parametrize(("cls", "values"), CONSTRUCT_CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_adopting_a_decoded_dict_builds_what_model_construct_builds(cls: type[Any], values: dict[str, Any]) -> None:
    """``rows.adopter``: the fields in their order, in another order (PostgreSQL's JSONB sorts keys),
    with one missing or with an extra: the model that ``model_construct`` builds, fields in
    definition order."""
    for ordered in (values, dict(reversed(list(values.items())))):
        expected = cls.model_construct(**ordered)
        built = rows_module.adopter(cls)(dict(ordered))
        assert type(built) is cls
        assert _state(built) == _state(expected)
        assert list(built.__dict__) == [name for name in cls.model_fields if name in built.__dict__]


def test_construct_of_a_span_with_extras_equals_validation() -> None:
    span = make_span("r", "a", 1, vendor_field={"x": 1})
    values = {**span.__dict__, **(span.model_extra or {})}
    built = construct(Span, values)
    assert _state(built) == _state(Span.model_construct(**values))
    assert built == span and built.model_extra == {"vendor_field": {"x": 1}}
    rollout = Rollout.model_construct(rollout_id="r", input=1)
    built_rollout = construct(Rollout, dict(rollout.__dict__))
    assert _state(built_rollout) == _state(Rollout.model_construct(**rollout.__dict__))
    attempt = Attempt(rollout_id="r", attempt_id="a", sequence_id=1, start_time=1.0)
    full = {**rollout.__dict__, "attempt": attempt}
    assert _state(construct(AttemptedRollout, full)) == _state(AttemptedRollout.model_construct(**full))


def test_sqlite_json_fast_path_decodes_and_fails_like_json_loads() -> None:
    slow_calls: list[Any] = []

    def slow(value: Any) -> Any:
        slow_calls.append(value)
        return json.loads(value)

    process = fastexec._sqlite_json(slow)
    for text in ['{"a":[1,2.5,null,"é"]}', "[]", '"s"', "3", "null", '  {"a": 1} ', b'{"a": 1}']:
        assert process(text) == json.loads(text)
    assert slow_calls == []  # valid text (whitespace and bytes included) never takes the slow path
    assert process(None) is None
    with pytest.raises(json.JSONDecodeError):
        process('{"a": 1} x')  # trailing garbage is an error, as for json.loads
    with pytest.raises(json.JSONDecodeError):
        process("{")
    assert slow_calls == ['{"a": 1} x', "{"]  # what the fast parser refuses: json.loads's own error


# The JSON fast path of the read paths (``loads_json``: PostgreSQL's JSONB codec; ``_sqlite_json``:
# SQLite's result processor) must give what ``json.loads`` gives, value for value and error for error.
_JSON_TEXTS = [
    '{"a":1,"b":[true,false,null],"c":"x"}',
    " \t[1, 2]\n",  # surrounding whitespace
    "18446744073709551616",  # beyond 64 bits: an exact int
    "[-9223372036854775809, 123456789012345678901234567890]",
    "[5e-324, 1.7976931348623157e308, 0.1, 1E+2, -0.0]",
    "[0.1000000000000000055511151231257827021181583404541015625]",  # a long decimal expansion
    "[1.5e999, NaN, -Infinity]",  # what json.loads accepts beyond the standard
    '{"a":1,"a":2}',  # duplicate keys: the last one
    '"\\ud83d\\ude00 \\u00e9 \\u0000"',  # escapes, a surrogate pair
    '"\\ud800"',  # a lone surrogate: the fast parser refuses it, json.loads reads it
    "[1,]",
    "nan",
    "",
    '{"a":1}{"b":2}',
    "[" * 3000 + "]" * 3000,  # deeper than either parser goes
]


def _outcome(call: Any, text: Any) -> tuple[str, Any]:
    try:
        return "value", repr(call(text))
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return "error", (type(exc), str(exc))


def _sqlite_json_processor() -> Any:
    """The store's result processor of a JSON column on SQLite (the fast path before SQLAlchemy's)."""
    from sqlalchemy.dialects import sqlite

    dialect = sqlite.dialect()
    return fastexec._sqlite_json(s.JsonValue().dialect_impl(dialect).result_processor(dialect, None))


@pytest.mark.parametrize("text", _JSON_TEXTS, ids=range(len(_JSON_TEXTS)))
def test_json_reads_decode_as_json_loads(text: str) -> None:
    expected = _outcome(json.loads, text)
    assert _outcome(fastexec.loads_json, text) == expected
    processor = _sqlite_json_processor()
    assert _outcome(processor, text) == expected


def test_the_sqlite_json_processor_passes_numbers_through() -> None:
    """SQLite hands a JSON column holding a bare number over as a number: SQLAlchemy's processor
    passes it through, and so does the fast path in front of it."""
    processor = _sqlite_json_processor()
    assert processor(5) == 5 and processor(2.5) == 2.5


def _deep_state(model: Any) -> Any:
    """``_state`` of a model and of every model inside its fields (lists included)."""

    def inner(value: Any) -> Any:
        if isinstance(value, BaseModel):
            return _deep_state(value)
        if isinstance(value, list):
            return [inner(item) for item in value]
        return value

    values, fields_set, extra, private = _state(model)
    return [(name, inner(value)) for name, value in values], fields_set, extra, private


def _decoded_span_row(row: Any) -> dict[str, Any]:
    """A read-back's span row (JSON columns as text) as a mapping of decoded columns."""
    values = dict(rows_module._mapping(row))
    for name in rows_module.SPAN_JSON_FIELDS:
        if values[name] is not None:
            values[name] = json.loads(values[name])
    return values


async def test_span_rows_build_what_the_general_path_builds(store: SqlLightningStore) -> None:
    """A read-back's span (``deferred_span_from_row``, built on first use by ``_span_state``'s direct
    assembly) must be the general path's (``construct`` per model) in every detail, on every backend
    (JSONB reorders keys)."""
    ar = await store.start_rollout({"q": 1})
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    plain = make_span(rid, aid, 1)
    rich = make_span(
        rid,
        aid,
        2,
        parent_id="00000000000000aa",
        attributes={"z": 1, "a": [1.5, 2.5], "s": "é"},
        extra_field={"nested": [1, {"x": "y"}]},
        flag=True,
    )
    rich.status = TraceStatus(status_code="ERROR", description="boom")
    rich.parent = SpanContext(trace_id=rich.trace_id, span_id="00000000000000aa", is_remote=True, trace_state={"v": "1"})
    rich.events = [Event(name="ev", attributes={"n": 1}, timestamp=3.0), Event(name="bare", attributes={})]
    rich.links = [Link(context=plain.context, attributes={"l": "x"}), Link(context=plain.context)]
    rich.resource = OtelResource(attributes={"service.name": "svc", "n": 2}, schema_url="https://x")
    bare = make_span(rid, aid, 3, start_time=None, end_time=None, attributes={})
    bare.context = None
    await store.add_many_spans([plain, rich, bare])

    captured: list[Any] = []
    real = rows_module.deferred_span_from_row

    def capture(row: Any) -> Any:
        captured.append(row)
        return real(row)

    general_calls: list[Any] = []
    general = rows_module._span_from_mapping

    def count_general(m: Any) -> Any:
        general_calls.append(m)
        return general(m)

    spans_module.deferred_span_from_row = capture  # type: ignore[assignment]
    rows_module._span_from_mapping = count_general  # type: ignore[assignment]
    try:
        got = list(await store.query_spans(rid))
        assert [s.sequence_id for s in got] == [1, 2, 3]
        assert got == [plain, rich, bare]  # every span built on first use, here
    finally:
        spans_module.deferred_span_from_row = real  # type: ignore[assignment]
        rows_module._span_from_mapping = general  # type: ignore[assignment]
    assert general_calls == []  # the usual rows took the direct path
    for row, span in zip(captured, got, strict=True):
        assert type(span) is Span
        built = general(_decoded_span_row(row))
        assert _deep_state(span) == _deep_state(built)
        assert repr(span) == repr(built)
        assert span.model_dump() == built.model_dump()
    assert got[1].model_extra == {"extra_field": {"nested": [1, {"x": "y"}]}, "flag": True}
    # Rows of another shape (a plain mapping, extra fields missing) take the general path.
    as_dict = dict(rows_module._mapping(captured[0]))
    assert _deep_state(rows_module.deferred_span_from_row(as_dict)) == _deep_state(got[0])


async def test_rollout_rows_build_what_the_general_path_builds(store: SqlLightningStore) -> None:
    """``attempted`` and ``attempt_from_row`` assemble usual rows directly; the results must be the
    general path's (``construct`` per model) in every detail, on every backend."""
    config = RolloutConfig(timeout_seconds=5.0, unresponsive_seconds=2.5, max_attempts=3, retry_condition=["failed"])
    plain = await store.enqueue_rollout({"task": 1})
    rich = await store.enqueue_rollout(
        {"task": [1, {"k": "é"}]}, mode="train", config=config, metadata={"m": [1, 2]}, idempotency_key="key-1"
    )
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None and claimed.rollout_id == plain.rollout_id
    await store.update_attempt(plain.rollout_id, claimed.attempt.attempt_id, status="failed", metadata={"x": 1})

    built: list[tuple[Any, Any]] = []
    real_attempted, real_attempt = ro_module.attempted, ro_module.attempt_from_row
    general_calls: list[Any] = []
    general = rows_module._attempted_from_mapping

    def capture(row: Any, attempt: Any) -> Any:
        built.append((row, attempt))
        return real_attempted(row, attempt)

    def count_general(m: Any, attempt: Any) -> Any:
        general_calls.append(m)
        return general(m, attempt)

    ro_module.attempted = capture  # type: ignore[assignment]
    rows_module._attempted_from_mapping = count_general  # type: ignore[assignment]
    try:
        got = list(await store.query_rollouts())
    finally:
        ro_module.attempted = real_attempted  # type: ignore[assignment]
        rows_module._attempted_from_mapping = general  # type: ignore[assignment]
    assert general_calls == []  # the usual rows took the direct path
    assert [r.rollout_id for r in got] == [plain.rollout_id, rich.rollout_id]
    assert type(got[0]) is AttemptedRollout and type(got[1]) is Rollout
    assert got[1].config == config and got[1].metadata == {"m": [1, 2]} and got[1].idempotency_key == "key-1"
    for (row, attempt), rollout in zip(built, got, strict=True):
        expected = general(rows_module._mapping(row), attempt)
        assert _deep_state(rollout) == _deep_state(expected)
        assert repr(rollout) == repr(expected)
        assert rollout.model_dump() == expected.model_dump()
    attempt = got[0].attempt  # type: ignore[union-attr]
    assert attempt.status == "failed" and attempt.metadata == {"x": 1}

    def attempt_rows(ctx: Any, run_id: int, _now: float) -> list[Any]:
        return ctx.execute(select(s.attempts).where(s.attempts.c.run_id == run_id)).all()

    (arow,) = await store._call("test", attempt_rows, write=False)
    m = rows_module._mapping(arow)
    expected_attempt = construct(Attempt, {name: m[name] for name in Attempt.model_fields})
    assert _deep_state(real_attempt(arow)) == _deep_state(expected_attempt) == _deep_state(attempt)
    as_dict = dict(rows_module._mapping(built[1][0]))  # another row shape: the general path
    assert _deep_state(rows_module.attempted(as_dict, None)) == _deep_state(got[1])


async def test_models_read_back_do_not_share_state(store: SqlLightningStore) -> None:
    """Each model read back owns its extras: an extra field set on one span's status or context
    (their models allow extras) shows on no other span, read now or later."""
    ar = await store.start_rollout({"q": 1})
    await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, k) for k in (1, 2)])
    first, second = await store.query_spans(ar.rollout_id)
    first.status.note = "mine"  # type: ignore[attr-defined]
    first.context.note = "mine"  # type: ignore[union-attr]
    assert first.status.__pydantic_extra__ is not second.status.__pydantic_extra__
    assert not hasattr(second.status, "note") and not hasattr(second.context, "note")
    again = (await store.query_spans(ar.rollout_id))[0]
    assert not hasattr(again.status, "note") and not hasattr(again.context, "note")


def test_span_values_encode_what_model_dump_gives() -> None:
    """``span_values`` encodes sub-models from their fields' dict when it can; the stored text must
    be that of ``model_dump()`` for plain models, models with extras and subclasses alike."""
    from lightning_sql.types import encode_json

    class TaggedContext(SpanContext):
        tag: str = "t"

    rich = make_span("r", "a", 1, parent_id="00000000000000aa", extra_field={"n": [1]})
    rich.status = TraceStatus(status_code="ERROR", description="boom", code_detail=7)  # an extra field
    rich.parent = TaggedContext(trace_id=rich.trace_id, span_id="00000000000000aa", is_remote=True, trace_state={})
    rich.resource = OtelResource(attributes={"service.name": "svc"}, schema_url="u")
    bare = make_span("r", "a", 2)
    bare.context = None
    for span in (rich, bare):
        row = rows_module.span_values(span, 1)
        extra = {
            "status": span.status.model_dump(),
            "context": None if span.context is None else span.context.model_dump(),
            "parent": None if span.parent is None else span.parent.model_dump(),
            **(span.model_extra or {}),
        }
        assert str(row["extra"]) == encode_json(extra, "x")
        assert str(row["resource"]) == encode_json(span.resource.model_dump(), "x")
    assert '"code_detail":7' in str(rows_module.span_values(rich, 1)["extra"])
    assert '"tag":"t"' in str(rows_module.span_values(rich, 1)["extra"])


def test_span_rows_are_not_tracked_by_the_collector() -> None:
    """A span's row holds plain ``str`` JSON texts (no ``EncodedJson``, a tracked object), so the row
    itself is a dict the collector does not track: rows wait in batches for their statement, and
    every tracked object there lengthened each young collection of the caller's process."""
    span = make_span("r", "a", 1, extra_field={"n": [1]})
    span.events = [Event(name="e", attributes={"a": 1})]
    for candidate in (span, make_span("r", "a", 2)):
        row = rows_module.span_values(candidate, 1)
        assert all(type(row[name]) is str for name in rows_module.SPAN_JSON_FIELDS)
        assert not gc.is_tracked(row)


def test_config_copy_is_a_deep_model_copy() -> None:
    class Custom(RolloutConfig):
        note: str = "n"

    for config in (
        RolloutConfig(),
        RolloutConfig(timeout_seconds=3.0, max_attempts=2, retry_condition=["failed", "timeout"]),
        Custom(max_attempts=4, retry_condition=["failed"]),  # a subclass: pydantic's own deep copy
    ):
        copied, expected = rows_module.config_copy(config), config.model_copy(deep=True)
        assert type(copied) is type(config)
        assert _state(copied) == _state(expected)
        assert copied.retry_condition is not config.retry_condition


# --- inline reads -----------------------------------------------------------------------------


async def _with_spans(store: SqlLightningStore, n: int = 3) -> list[str]:
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])
    ids = []
    for ar in await store.dequeue_many_rollouts(limit=n, worker_id="w"):
        await store.add_many_spans([make_span(ar.rollout_id, ar.attempt.attempt_id, k) for k in (1, 2)])
        ids.append(ar.rollout_id)
    return ids


def _worker(store: SqlLightningStore) -> Any:
    worker = store._worker
    assert worker is not None
    return worker


async def test_sqlite_file_reads_run_inline_and_match_the_thread(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        ids = await _with_spans(store)
        worker = _worker(store)
        assert worker.inline_reads

        async def reads() -> list[Any]:
            return [
                [(sp.rollout_id, sp.sequence_id, sp.model_dump()) for sp in await store.query_spans(ids[0], "latest")],
                [r.model_dump() for r in await store.query_rollouts(status_in=["running"])],
                (await store.get_rollout_by_id(ids[1])),
                await store.get_latest_attempt(ids[2]),
                await store.query_workers(),
            ]

        before = worker.inline_read_count
        inline = await reads()
        assert worker.inline_read_count - before == 5
        worker.inline_reads = False
        threaded = await reads()
        assert worker.inline_read_count - before == 5  # none more ran inline
        assert inline == threaded and len(inline[0]) == 2
    finally:
        await store.close()


class _Neighbour:
    """Another task of the running loop, counting its turns (one per ``period`` seconds at most)."""

    def __init__(self, period: float) -> None:
        self.ticks = 0
        self._period = period
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(self._period)

    def stop(self) -> None:
        self._task.cancel()


async def test_an_inline_read_still_lets_the_loops_other_tasks_run(tmp_path: Path) -> None:
    """A read that ran inline is still a suspension point: a loop polling with reads does not
    starve its neighbours (it used to yield while the I/O thread worked)."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 1)
        neighbour = _Neighbour(0)
        before = _worker(store).inline_read_count
        for _ in range(20):
            await store.query_rollouts()
        assert _worker(store).inline_read_count - before == 20  # all inline...
        assert neighbour.ticks >= 19  # ...and the neighbour ran between them
        neighbour.stop()
    finally:
        await store.close()


async def test_memory_reads_and_write_units_never_run_inline_reads(tmp_path: Path) -> None:
    memory = SqlLightningStore("sqlite://", run="r", clock_sync=False)
    try:
        await _with_spans(memory)
        assert not _worker(memory).inline_reads and _worker(memory).inline_read_count == 0
    finally:
        await memory.close()
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store)  # enqueue, claim, add spans: writes only (and the sweeps before claims)
        assert _worker(store).inline_read_count == 0
    finally:
        await store.close()


async def test_an_inline_read_unit_cannot_write(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        worker, run_id = await store._prepare()

        def sneaky(ctx: Any) -> None:
            ctx.conn.execute(insert(s.workers).values(run_id=run_id, worker_id="sneaky", status="idle"))

        with pytest.raises(DBAPIError, match="readonly"):
            await store._submit(worker, sneaky, write=False)
        assert len(await store.query_workers()) == 0
    finally:
        await store.close()


async def test_a_read_that_meets_a_lock_goes_to_the_writer_thread(tmp_path: Path) -> None:
    """An inline reader has no busy timeout: a lock (or any error the writer thread's retries and
    conversions handle) sends the unit to the writer thread instead of waiting on the caller's loop.
    An error of the unit itself is raised at once, with no second try."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 2)
        worker, run_id = await store._prepare()
        threads: list[str] = []

        def locked_inline(ctx: Any) -> int:
            threads.append(threading.current_thread().name)
            if threading.current_thread() is threading.main_thread():
                raise sqlite3.OperationalError("database is locked")
            return int(ctx.execute(select(func.count()).select_from(s.rollouts)).scalar_one())

        before = worker.inline_read_count
        assert await store._submit(worker, locked_inline, write=False) == 2
        assert threads[0] == "MainThread" and threads[1].startswith("lightning-sql-io")
        assert worker.inline_read_count == before

        def bad(ctx: Any) -> None:
            threads.append(threading.current_thread().name)
            raise KeyError("the unit's own error")

        threads.clear()
        with pytest.raises(KeyError):
            await store._submit(worker, bad, write=False)
        assert threads == ["MainThread"]
        # The reader connection is usable after both failures (rolled back, not left in a transaction).
        assert len(await store.query_rollouts()) == 2 and worker.inline_read_count == before + 1
    finally:
        await store.close()


async def test_close_closes_the_reader_connections(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())  # a reader in another thread too
    worker = _worker(store)
    assert len(worker._reader_slots) == 2
    await store.close()
    assert worker.closed and worker._reader_slots == []
    worker._thread.join(5)  # the writer thread closes its own connection on its way out
    # Every connection to the file is closed: an exclusive lock is possible at once.
    locker = sqlite3.connect(tmp_path / "s.db", isolation_level=None, timeout=0)
    locker.execute("PRAGMA locking_mode=EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    locker.rollback()
    locker.close()


async def test_the_readers_of_threads_that_ended_are_closed(tmp_path: Path) -> None:
    """A thread's reader connection (and its engine, and the file descriptors of the database and
    its WAL) is closed once the thread has ended and another thread opens one: a caller that reads
    from a new thread each time does not pile them up."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        await _with_spans(store, 1)
        await store.query_rollouts()
        worker = _worker(store)
        ended: list[Any] = []
        for _ in range(5):
            thread = threading.Thread(target=asyncio.run, args=(store.query_rollouts(),))
            thread.start()
            thread.join()
            ended.append(thread)
        assert [slot[0] for slot in worker._reader_slots] == [threading.main_thread(), ended[-1]]
        assert len(await store.query_rollouts()) == 1  # this thread's reader is still there
    finally:
        await store.close()


# --- inline writes ----------------------------------------------------------------------------


async def _lifecycle(store: SqlLightningStore) -> list[Any]:
    """Every kind of write of a lifecycle, and what each returned (without the random ids)."""
    out: list[Any] = []
    queued = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(3)])
    out.append([r.status for r in queued])
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    out.append((claimed.status, claimed.attempt.sequence_id, claimed.attempt.worker_id, claimed.input))
    out.append(list(await store.get_many_span_sequence_ids([(rid, aid)] * 3)))
    spans = await store.add_many_spans([make_span(rid, aid, k) for k in (1, 2)])
    out.append([(sp.sequence_id, sp.name) for sp in spans])
    out.append((await store.add_span(make_span(rid, aid, 3))).sequence_id)  # type: ignore[union-attr]
    attempt = await store.update_attempt(rid, aid, status="failed", metadata={"m": 1})
    out.append((attempt.status, attempt.metadata, attempt.end_time is not None))
    out.append((await store.update_rollout(queued[1].rollout_id, status="cancelled")).status)
    with pytest.raises(ValueError, match="not found"):
        await store.update_attempt("ro-missing", "latest", status="running")
    out.append({k: v for k, v in (await store.statistics()).items() if k != "uptime"})
    out.append([(r.input, r.status) for r in await store.query_rollouts(sort_by="start_time")])
    out.append([(w.worker_id, w.status) for w in await store.query_workers()])
    return out


async def test_sqlite_writes_run_inline_and_match_the_thread(tmp_path: Path) -> None:
    results = []
    for inline in (True, False):
        store = SqlLightningStore(f"sqlite:///{tmp_path / f'{inline}.db'}", run="r", clock_sync=False)
        try:
            await store.statistics()
            worker = _worker(store)
            worker.inline_writes = inline
            before = worker.inline_write_count
            results.append(await _lifecycle(store))
            if inline:
                assert worker.inline_write_count - before >= 8  # every write call of the lifecycle...
            else:
                assert worker.inline_write_count == before  # ...or none of them
        finally:
            await store.close()
    assert results[0] == results[1]
    assert results[0][1] == ("preparing", 1, "w", {"i": 0}) and results[0][2] == [1, 2, 3]


async def test_a_write_that_meets_a_lock_goes_to_the_writer_thread(tmp_path: Path) -> None:
    """Inline, the writer connection waits for no lock: while another process holds the write lock
    the call waits on the writer thread (which retries), and the caller's event loop goes on."""
    path = tmp_path / "s.db"
    store = SqlLightningStore(f"sqlite:///{path}", run="r", clock_sync=False, scan_debounce_seconds=3600)
    try:
        await store.query_rollouts()  # the first lazy sweep (a write), so that the call below is one unit
        worker = _worker(store)
        before = worker.inline_write_count
        locker = sqlite3.connect(path, isolation_level=None, timeout=0)
        locker.execute("BEGIN IMMEDIATE")
        neighbour = _Neighbour(0.01)
        call = asyncio.create_task(store.enqueue_rollout({"x": 1}))
        await asyncio.sleep(0.5)
        assert not call.done() and neighbour.ticks >= 10  # waiting, off the caller's loop
        locker.rollback()
        locker.close()
        rollout = await asyncio.wait_for(call, 30)
        neighbour.stop()
        assert worker.inline_write_count == before  # it ran on the writer thread
        assert [r.rollout_id for r in await store.query_rollouts()] == [rollout.rollout_id]
        await store.enqueue_rollout({"x": 2})
        assert worker.inline_write_count == before + 1  # and the next write runs inline again
    finally:
        await store.close()


async def test_a_failing_inline_write_changes_nothing_and_is_not_replayed(tmp_path: Path) -> None:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        worker, run_id = await store._prepare()
        threads: list[str] = []

        def half_done(ctx: Any) -> None:
            threads.append(threading.current_thread().name)
            ctx.conn.execute(insert(s.workers).values(run_id=run_id, worker_id="half", status="idle", create_seq=1))
            raise KeyError("the unit's own error")

        with pytest.raises(KeyError):
            await store._submit(worker, half_done, write=True)
        assert threads == ["MainThread"]  # inline, once
        assert len(await store.query_workers()) == 0  # rolled back
        await store.update_worker("whole", {"n": 1})  # the connection is usable after the failure
        assert [w.worker_id for w in await store.query_workers()] == ["whole"]
    finally:
        await store.close()


async def test_a_write_waits_for_the_writer_thread_while_it_works(tmp_path: Path) -> None:
    """While the writer thread (or another thread) is inside SQLite, a write queues for the writer
    thread rather than competing for the connection; queued units keep their turn."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        worker, _run_id = await store._prepare()
        started, release = threading.Event(), threading.Event()

        def blocker(ctx: Any) -> None:
            started.set()
            release.wait(30)

        fut = worker.submit(blocker, write=True, deadline_s=30)
        assert await asyncio.to_thread(started.wait, 10)
        threads: list[str] = []

        def note(ctx: Any) -> str:
            threads.append(threading.current_thread().name)
            return "done"

        call = asyncio.create_task(store._submit(worker, note, write=True))
        await asyncio.sleep(0.2)
        assert not call.done() and threads == []
        release.set()
        assert await asyncio.wait_for(call, 10) == "done"
        await asyncio.wrap_future(fut)
        assert threads[0].startswith("lightning-sql-io")
    finally:
        await store.close()


async def test_concurrent_writes_of_one_loop_commit_as_one_inline_group(tmp_path: Path) -> None:
    """The writes that one loop's tasks issue in one turn run together, in the calling thread, in one
    transaction (a savepoint each): a failing call is rolled back alone and gets its own error."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False, scan_debounce_seconds=3600)
    try:
        await store.query_rollouts()  # the first lazy sweep
        started = [await store.start_rollout({"s": i}) for i in range(3)]
        worker = _worker(store)
        groups, units = worker.inline_groups, worker.inline_write_count
        calls = [store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1)) for ar in started]
        calls += [store.enqueue_rollout({"n": j}) for j in range(5)]
        calls += [store.update_attempt(f"ro-gone-{j}", "latest", status="running") for j in range(3)]
        calls.append(store.add_span(make_span(started[0].rollout_id, "at-missing", 2)))
        calls.append(store.update_attempt(started[1].rollout_id, "latest", metadata={"m": 1}))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert (worker.inline_groups - groups, worker.inline_write_count - units) == (1, len(calls))
        assert all(isinstance(r, Span) for r in results[:3])
        assert all(isinstance(r, Rollout) and r.status == "queuing" for r in results[3:8])
        assert [str(r) for r in results[8:11]] == [f"Rollout ro-gone-{j} not found" for j in range(3)]
        assert str(results[11]) == f"Attempt at-missing not found for rollout {started[0].rollout_id}"
        assert isinstance(results[12], Attempt) and results[12].metadata == {"m": 1}
        stats = await store.statistics()
        assert (stats["total_spans"], stats["total_rollouts"], stats["queue_depth"]) == (3, 8, 5)
        assert await store.get_next_span_sequence_id(started[0].rollout_id, started[0].attempt.attempt_id) == 2
        assert worker._soon == {}  # nothing left queued for any loop
    finally:
        await store.close()


@pytest.mark.parametrize(("cap", "groups"), [(4, 3), (1, 0)])
async def test_inline_groups_keep_the_group_size_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int, groups: int
) -> None:
    monkeypatch.setattr(eng, "SQLITE_GROUP_COMMIT_MAX", cap)
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False, scan_debounce_seconds=3600)
    try:
        await store.query_rollouts()  # the first lazy sweep
        worker = _worker(store)
        before = worker.inline_groups, worker.inline_write_count
        await asyncio.gather(*(store.enqueue_rollout({"n": j}) for j in range(10)))
        assert (worker.inline_groups - before[0], worker.inline_write_count - before[1]) == (groups, 10)
        assert (await store.statistics())["queue_depth"] == 10
    finally:
        await store.close()


async def test_writes_from_several_threads_share_the_writer_connection_safely(tmp_path: Path) -> None:
    """Four threads, each with its own event loop and eight concurrent runners, claim and finish 400
    rollouts on one store: writes run inline or, while another thread is inside SQLite, on the writer
    thread; every rollout is claimed once and every result is stored."""
    store = SqlLightningStore(f"sqlite:///{tmp_path / 's.db'}", run="r", clock_sync=False)
    try:
        n = 400
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in range(n)])
        worker = _worker(store)
        before = worker.inline_write_count
        claimed: list[list[str]] = [[] for _ in range(4)]
        errors: list[BaseException] = []

        async def runner(mine: list[str]) -> None:
            while (ar := await store.dequeue_rollout(worker_id=f"w{threading.get_ident()}")) is not None:
                await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1))
                await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
                mine.append(ar.rollout_id)

        def thread_main(mine: list[str]) -> None:
            async def runners() -> None:
                await asyncio.gather(*(runner(mine) for _ in range(8)))

            try:
                asyncio.run(runners())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=thread_main, args=(mine,)) for mine in claimed]
        for thread in threads:
            thread.start()
        for thread in threads:
            await asyncio.to_thread(thread.join, 120)
        assert errors == [] and not any(t.is_alive() for t in threads)
        ids = [rid for mine in claimed for rid in mine]
        assert len(ids) == n and len(set(ids)) == n
        inline = worker.inline_write_count - before
        assert 0 < inline < 3 * n  # both paths carried writes (3 write calls per rollout, plus sweeps)
        stats = await store.statistics()
        assert (stats["total_spans"], stats["queue_depth"]) == (n, 0)
        done = await store.query_rollouts(status_in=["succeeded"])
        assert len(done) == n
    finally:
        await store.close()


def test_the_read_gate_turns_readers_away_while_a_fork_waits() -> None:
    gate = eng._ReadGate()
    assert gate.enter()
    assert gate.close(0.01) is False  # one reader is still inside: fork waited and gave up
    assert not gate.enter()  # closed: a new read goes to the writer thread
    gate.leave()
    assert gate.close(0.01) is True
    gate.open()
    assert gate.enter()
    gate.leave()


async def test_a_closed_store_leaves_no_worker_behind(backend: Any) -> None:
    """Closing releases everything the store opened: once the caller drops the store, its I/O worker,
    engines and connections are garbage.  (A reader connection left checked out kept its pool in
    SQLAlchemy's finalizer registry, and through the pool's ``creator`` the whole worker: ~1,500
    objects per SQLite store opened and closed.)"""
    store = backend.open(run="r", clock_sync=False)
    await _with_spans(store, 1)
    await store.query_rollouts()
    await asyncio.to_thread(asyncio.run, store.query_rollouts())  # a reader in another thread too
    worker = _worker(store)
    gone, io_thread = weakref.ref(worker), worker._thread
    del worker
    await store.close()
    del store
    io_thread.join(10)  # the I/O thread ends on its own after close(); its frame holds the worker
    assert not io_thread.is_alive()
    gc.collect()
    assert gone() is None
