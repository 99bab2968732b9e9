"""Contract §4: constructor options and their validation, read-only stores, close/reopen, ``async with``,
statistics, capabilities, and the in-memory store's limits."""

from __future__ import annotations

import asyncio
import pickle
import re
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from lightning_sql import (
    EnqueueRolloutRequest,
    PromptTemplate,
    RolloutConfig,
    Span,
    SqlLightningStore,
    StoreUnavailableError,
)
from tests.conftest import PG_URL

STAT_KEYS = {
    "name",
    "total_rollouts",
    "total_attempts",
    "total_spans",
    "total_resources",
    "total_workers",
    "uptime",
    "queue_depth",
}


def _prompt(text: str) -> dict[str, PromptTemplate]:
    return {"p": PromptTemplate(template=text, engine="f-string")}


def _span() -> Span:
    return Span.from_attributes(attributes={}, rollout_id="ro-x", attempt_id="at-x", sequence_id=1)


# --- constructor validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"create_run": "yes"}, TypeError, "create_run"),
        ({"read_only": 1}, TypeError, "read_only"),
        ({"auto_migrate": None}, TypeError, "auto_migrate"),
        ({"clock": "time.time"}, TypeError, "clock"),
        ({"clock_sync": "on"}, TypeError, "clock_sync"),
        ({"scan_debounce_seconds": "10"}, TypeError, "scan_debounce_seconds"),
        ({"scan_debounce_seconds": True}, TypeError, "scan_debounce_seconds"),
        ({"connect_deadline_seconds": "30"}, TypeError, "connect_deadline_seconds"),
        ({"connect_deadline_seconds": -1}, ValueError, "connect_deadline_seconds"),
        ({"analyze_check_seconds": "10"}, TypeError, "analyze_check_seconds"),
        ({"analyze_check_seconds": False}, TypeError, "analyze_check_seconds"),
        ({"analyze_check_seconds": -1}, ValueError, "analyze_check_seconds"),
        ({"analyze_check_seconds": float("nan")}, ValueError, "analyze_check_seconds"),
        ({"default_rollout_config": {"max_attempts": 2}}, TypeError, "default_rollout_config"),
        ({"schema": ""}, ValueError, "schema"),
        ({"run": ""}, ValueError, "run"),
        ({"run": "bad\x00name"}, ValueError, "run"),
        ({"run_metadata": {"when": object()}}, TypeError, "run_metadata"),
        ({"bogus_option": 1}, ValueError, "bogus_option"),
    ],
)
async def test_bad_constructor_options_are_rejected_by_name(backend, kwargs, error, names):
    options = {"run": "x", **kwargs}
    with pytest.raises(error, match=re.escape(names)):
        backend.open(**options)


async def test_engine_options_are_checked_per_backend(backend):
    if backend.is_postgres:
        with pytest.raises(ValueError, match="busy_timeout") as info:
            backend.open(run="x", busy_timeout=5)
        assert "postgres" in str(info.value).lower()
        with pytest.raises(ValueError, match="max_overflow"):
            backend.open(run="x", max_overflow=1)  # the connection budget is pool_size + 1
        st = backend.open(run="x", pool_size=2, pool_pre_ping=True, echo=False)
    else:
        with pytest.raises(ValueError, match="pool_size") as info:
            backend.open(run="x", pool_size=2)
        assert "sqlite" in str(info.value).lower()
        st = backend.open(run="x", busy_timeout=5, echo=False)
    try:
        assert (await st.enqueue_rollout(1)).status == "queuing"
    finally:
        await st.close()


async def test_schema_option_is_for_postgres_only(backend):
    if backend.is_postgres:
        return  # the fixture itself passes schema= on PostgreSQL
    with pytest.raises(ValueError, match="schema"):
        SqlLightningStore(backend.url, run="x", schema="custom")


def test_unsupported_url_is_rejected_with_password_masked():
    with pytest.raises(ValueError) as info:
        SqlLightningStore("mysql://user:s3cret@db.example/x", run="x")
    assert "mysql" in str(info.value) and "s3cret" not in str(info.value)


def test_repr_and_url_mask_the_password():
    st = SqlLightningStore("postgresql://user:s3cret@127.0.0.1:1/db", run="x")
    assert "s3cret" not in repr(st) and "s3cret" not in st.url
    assert st.url.startswith("postgresql+asyncpg://")


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgresql+psycopg2", "postgresql+asyncpg"])
async def test_postgres_url_spellings(pg_backend, scheme):
    url = PG_URL.replace("postgresql://", f"{scheme}://", 1)
    st = SqlLightningStore(url, **pg_backend.options(run="spelling", clock_sync=False))
    try:
        await st.enqueue_rollout(1)
        assert (await st.statistics())["total_rollouts"] >= 1
    finally:
        await st.close()


async def test_constructor_does_no_io_and_needs_no_loop(tmp_path):
    path = tmp_path / "lazy.db"
    st = SqlLightningStore(f"sqlite:///{path}", run="lazy")
    assert not path.exists()
    unreachable = SqlLightningStore(
        "postgresql://nobody@127.0.0.1:1/none", run="x", connect_deadline_seconds=1
    )
    assert unreachable.run == "x"
    r = await st.enqueue_rollout(1)
    assert path.exists() and r.status == "queuing"
    await st.close()


def test_constructor_outside_any_event_loop_then_used_in_consecutive_loops(tmp_path):
    st = SqlLightningStore(f"sqlite:///{tmp_path / 'loops.db'}", run="loops")

    async def enqueue() -> str:
        return (await st.enqueue_rollout(1)).rollout_id

    first = asyncio.run(enqueue())
    second = asyncio.run(enqueue())

    async def count_and_close() -> int:
        n = (await st.statistics())["total_rollouts"]
        await st.close()
        return n

    assert first != second and asyncio.run(count_and_close()) == 2


# --- read-only stores ---------------------------------------------------------------------------


def _write_calls() -> dict[str, Any]:
    return {
        "start_rollout": lambda st: st.start_rollout(1),
        "enqueue_rollout": lambda st: st.enqueue_rollout(1),
        "enqueue_many_rollouts": lambda st: st.enqueue_many_rollouts([EnqueueRolloutRequest(input=1)]),
        "dequeue_rollout": lambda st: st.dequeue_rollout(),
        "dequeue_many_rollouts": lambda st: st.dequeue_many_rollouts(limit=2),
        "start_attempt": lambda st: st.start_attempt("ro-x"),
        "update_rollout": lambda st: st.update_rollout("ro-x", status="failed"),
        "update_attempt": lambda st: st.update_attempt("ro-x", "latest", status="failed"),
        "touch_attempt": lambda st: st.touch_attempt("ro-x", "latest"),
        "update_resources": lambda st: st.update_resources("r", _prompt("{x}")),
        "update_worker": lambda st: st.update_worker("w"),
        "add_resources": lambda st: st.add_resources(_prompt("{x}")),
        "add_span": lambda st: st.add_span(_span()),
        "add_many_spans": lambda st: st.add_many_spans([_span()]),
        "add_otel_span": lambda st: st.add_otel_span("ro-x", "at-x", ReadableSpan(name="s")),
        "get_next_span_sequence_id": lambda st: st.get_next_span_sequence_id("ro-x", "at-x"),
        "get_many_span_sequence_ids": lambda st: st.get_many_span_sequence_ids([("ro-x", "at-x")]),
        "sweep": lambda st: st.sweep(),
        "mark_run_finished": lambda st: st.mark_run_finished(),
        "delete_run": lambda st: st.delete_run("x"),
    }


def _unreachable_url(backend: Any, tmp_path: Any) -> str:
    if backend.is_postgres:
        return "postgresql://nobody@127.0.0.1:1/none"
    if backend.name == "sqlite_memory":
        return "sqlite://"
    return f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"


async def test_read_only_write_methods_raise_permission_error_before_io(backend, tmp_path):
    # The database cannot even be reached: any I/O would surface as a different error.
    st = SqlLightningStore(
        _unreachable_url(backend, tmp_path), run="x", read_only=True, connect_deadline_seconds=1
    )
    calls = _write_calls()
    # Empty batches too: they do nothing else, but a read-only store refuses them all the same.
    calls["enqueue_many_rollouts([])"] = lambda st: st.enqueue_many_rollouts([])
    calls["add_many_spans([])"] = lambda st: st.add_many_spans([])
    for method, call in calls.items():
        with pytest.raises(PermissionError) as info:
            await call(st)
        assert method.removesuffix("([])") in str(info.value), method
    assert not (tmp_path / "missing").exists()
    await st.close()


async def test_read_only_store_reads_a_live_run_and_changes_nothing(backend, store_factory):
    if not backend.persistent:
        pytest.skip("a read-only store needs a database another instance wrote")
    writer = store_factory(run="live")
    r = await writer.enqueue_rollout({"x": 1})
    await writer.add_resources(_prompt("{x}"))
    reader = store_factory(run="live", read_only=True)
    assert reader.read_only is True
    assert [x.rollout_id for x in await reader.query_rollouts()] == [r.rollout_id]
    assert (await reader.get_latest_resources()) is not None
    before = await reader.statistics()
    for call in _write_calls().values():
        with pytest.raises(PermissionError):
            await call(reader)
    after = await reader.statistics()
    assert before | {"uptime": 0} == after | {"uptime": 0}
    assert [run.name for run in await reader.list_runs()] == ["live"]


async def test_read_only_store_refuses_an_empty_database(backend, tmp_path):
    if backend.is_postgres:
        url, options = backend.url, backend.options(run="x", read_only=True)
    elif backend.persistent:
        url, options = backend.url, {"run": "x", "read_only": True}
    else:
        pytest.skip("an in-memory database is always empty")
    st = SqlLightningStore(url, **options)
    try:
        with pytest.raises(Exception, match="lightning-sql db upgrade"):
            await st.list_runs()
    finally:
        await st.close()


# --- close, reopen, async with ----------------------------------------------------------------


async def test_async_with_closes_the_store(backend, clock):
    async with backend.open(run="ctx", clock=clock, clock_sync=False) as st:
        assert isinstance(st, SqlLightningStore)
        r = await st.enqueue_rollout({"x": 1})
    if backend.persistent:
        # A later call reattaches lazily; a new instance sees the data.
        assert (await st.get_rollout_by_id(r.rollout_id)) is not None
        await st.close()
        async with backend.open(run="ctx", clock=clock, clock_sync=False) as again:
            got = await again.get_rollout_by_id(r.rollout_id)
            assert got is not None and got.input == {"x": 1}
    else:
        with pytest.raises(RuntimeError):
            await st.get_rollout_by_id(r.rollout_id)


async def test_close_is_idempotent_and_other_instances_keep_working(backend, store_factory):
    a = store_factory()
    r = await a.enqueue_rollout(1)
    if backend.persistent:
        b = store_factory()
        await b.statistics()
        await a.close()
        await a.close()
        got = await b.dequeue_rollout()  # the shared I/O thread still serves b
        assert got is not None and got.rollout_id == r.rollout_id
    else:
        await a.close()
        await a.close()


async def test_in_memory_store_limits(backend, clock):
    if backend.name != "sqlite_memory":
        pytest.skip("in-memory SQLite only")
    st = backend.open(run="mem", clock=clock)
    other = backend.open(run="mem", clock=clock)
    try:
        await st.enqueue_rollout(1)
        assert (await other.statistics())["total_rollouts"] == 0  # each instance is its own database
        with pytest.raises(TypeError, match=re.escape("sqlite://")):
            pickle.dumps(st)
    finally:
        await other.close()
    await st.close()
    for call in (st.statistics, st.query_rollouts, lambda: st.enqueue_rollout(2), st.list_runs):
        with pytest.raises(RuntimeError):
            await call()


async def test_persistent_store_pickles_into_a_working_copy(backend, store_factory):
    if not backend.persistent:
        pytest.skip("in-memory stores are not picklable")
    st = store_factory(run=None, default_rollout_config=RolloutConfig(timeout_seconds=7))
    r = await st.enqueue_rollout(1)
    copy = pickle.loads(pickle.dumps(st))
    try:
        assert copy.run == st.run  # a generated run name travels with the pickle
        assert copy.default_rollout_config == RolloutConfig(timeout_seconds=7)
        got = await copy.dequeue_rollout()
        assert got is not None and got.rollout_id == r.rollout_id
    finally:
        await copy.close()


# --- statistics, capabilities, misc -----------------------------------------------------------


async def test_statistics_keys_and_counts(store):
    stats = await store.statistics()
    assert set(stats) == STAT_KEYS
    assert stats["name"] == "SqlLightningStore"
    assert all(stats[k] == 0 for k in STAT_KEYS - {"name", "uptime"})  # type: ignore[literal-required]
    assert stats["uptime"] >= 0
    res = await store.add_resources(_prompt("{x}"))
    await store.update_resources(res.resources_id, _prompt("v2 {x}"))  # versions are not counted
    ar = await store.start_rollout(1, worker_id="w1")
    await store.start_attempt(ar.rollout_id)
    await store.add_span(
        Span.from_attributes(
            attributes={}, rollout_id=ar.rollout_id, attempt_id=ar.attempt.attempt_id, sequence_id=1
        )
    )
    await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(3)])
    await store.update_worker("w2")
    later = await store.statistics()
    assert {k: later[k] for k in STAT_KEYS - {"name", "uptime"}} == {  # type: ignore[literal-required]
        "total_rollouts": 4,
        "total_attempts": 2,
        "total_spans": 1,
        "total_resources": 1,
        "total_workers": 2,
        "queue_depth": 3,
    }
    assert later["uptime"] >= stats["uptime"]


async def test_uptime_is_monotonic_not_the_store_clock(store, clock):
    first = (await store.statistics())["uptime"]
    clock.advance(-10_000)
    second = (await store.statistics())["uptime"]
    assert 0 <= first <= second < 600


async def test_capabilities(backend, store):
    caps = store.capabilities
    assert caps["async_safe"] is True and caps["thread_safe"] is True
    assert caps["otlp_traces"] is False
    assert caps["zero_copy"] is (backend.name != "sqlite_memory")
    with pytest.raises(NotImplementedError):
        store.otlp_traces_endpoint()


async def test_unreachable_database_raises_store_unavailable(backend, tmp_path):
    if not backend.is_postgres:
        pytest.skip("SQLite files are created on demand")
    st = SqlLightningStore("postgresql://nobody:pw@127.0.0.1:1/none", run="x", connect_deadline_seconds=1)
    try:
        with pytest.raises(StoreUnavailableError) as info:
            await st.enqueue_rollout(1)
        assert "127.0.0.1:1" in str(info.value) and ":pw@" not in str(info.value)
        assert isinstance(info.value, ConnectionError)
    finally:
        await st.close()
