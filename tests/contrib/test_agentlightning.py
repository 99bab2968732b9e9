"""The Agent-Lightning 0.3 bridge: agentlightning's own Trainer, strategies and server on SqlLightningStore.

Skipped when ``agentlightning`` is not installed, except with ``LIGHTNING_SQL_REQUIRE_AGENTLIGHTNING=1``
(CI), where its absence fails the run. Size knob: ``LIGHTNING_SQL_AGL_SAMPLES`` (training samples per
Trainer run, default 6).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REQUIRE_AGL = os.environ.get("LIGHTNING_SQL_REQUIRE_AGENTLIGHTNING") == "1"

try:
    # The bridge is imported first: it makes agentlightning's import work offline (LiteLLM cost map).
    from lightning_sql.contrib import agentlightning as bridge_module
except ImportError as exc:  # pragma: no cover - depends on the environment
    if REQUIRE_AGL:
        raise ImportError(
            f"agentlightning is required (LIGHTNING_SQL_REQUIRE_AGENTLIGHTNING=1) but cannot be imported: {exc}"
        ) from exc
    pytest.skip(f"agentlightning is not installed: {exc}", allow_module_level=True)

import agentlightning as agl  # noqa: E402
from agentlightning.execution import ClientServerExecutionStrategy, SharedMemoryExecutionStrategy  # noqa: E402
from agentlightning.store.base import UNSET as AGL_UNSET  # noqa: E402
from agentlightning.store.base import LightningStore as AglLightningStore  # noqa: E402
from agentlightning.store.threading import LightningStoreThreaded  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from pydantic import ValidationError  # noqa: E402

import lightning_sql  # noqa: E402
from lightning_sql import SqlLightningStore  # noqa: E402
from tests.conftest import BackendSpec  # noqa: E402
from tests.contrib._agl_child import run_one_rollout  # noqa: E402

AgentLightningSqlStore = bridge_module.AgentLightningSqlStore

N_SAMPLES = int(os.environ.get("LIGHTNING_SQL_AGL_SAMPLES", "6"))
TRAIN_SAMPLES = [{"x": i} for i in range(N_SAMPLES)]
VAL_SAMPLES = [{"x": 100}]
PROMPT = "Solve {x}"


# --- upstream's API surface ------------------------------------------------------------------------


def _public_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and not isinstance(inspect.getattr_static(cls, name), property)
    }


def test_every_upstream_method_is_overridden_with_upstreams_signature() -> None:
    upstream = _public_methods(AglLightningStore)
    assert len(upstream) >= 28  # the whole contract, not a subset
    for name, method in upstream.items():
        ours = inspect.getattr_static(AgentLightningSqlStore, name)
        assert name in AgentLightningSqlStore.__dict__, f"{name} is inherited from upstream's abstract base"
        expected = [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]
        actual = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()]
        assert actual == expected, name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(method), name
    assert "capabilities" in AgentLightningSqlStore.__dict__


# --- conversions ---------------------------------------------------------------------------------------


def _agl_span(rollout_id: str, attempt_id: str, sequence_id: int, name: str, **attributes: Any) -> agl.Span:
    span = agl.Span.from_attributes(
        attributes=attributes or {"k": "v"},
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        name=name,
    )
    return span.model_copy(update={"custom_extra": {"nested": [1, 2]}})


async def test_models_convert_both_ways_with_exact_upstream_types(
    store_factory: Callable[..., SqlLightningStore],
) -> None:
    store = AgentLightningSqlStore(store_factory())

    queued = await store.enqueue_rollout(
        {"q": 1}, mode="train", config=agl.RolloutConfig(max_attempts=2, retry_condition=["failed"]),
        metadata={"m": 1},
    )
    assert type(queued) is agl.Rollout
    assert not hasattr(queued, "resources_version") and not hasattr(queued, "idempotency_key")
    assert queued.config == agl.RolloutConfig(max_attempts=2, retry_condition=["failed"])
    assert type(queued.config) is agl.RolloutConfig

    batch = await store.enqueue_many_rollouts([agl.EnqueueRolloutRequest(input={"q": 2}, mode="val")])
    assert type(batch) is list and [type(r) for r in batch] == [agl.Rollout]

    claimed = await store.dequeue_rollout(worker_id="w1")
    assert type(claimed) is agl.AttemptedRollout and type(claimed.attempt) is agl.Attempt
    assert claimed.rollout_id == queued.rollout_id and claimed.attempt.worker_id == "w1"
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id

    started = await store.start_rollout({"q": 3}, worker_id="w2")
    assert type(started) is agl.AttemptedRollout
    many = await store.dequeue_many_rollouts(limit=5, worker_id="w3")
    assert type(many) is list and [type(r) for r in many] == [agl.AttemptedRollout]
    retried = await store.start_attempt(started.rollout_id)
    assert type(retried) is agl.AttemptedRollout and retried.attempt.sequence_id == 2

    page = await store.query_rollouts(sort_by="start_time")
    assert type(page) is agl.PaginatedResult and page.total == 3 and page.limit == -1
    # Every rollout here has an attempt; a rollout without one comes back as a plain Rollout.
    assert {type(r) for r in page} == {agl.AttemptedRollout}
    fresh = await store.enqueue_rollout({"q": 4})
    plain = await store.get_rollout_by_id(fresh.rollout_id)
    assert type(plain) is agl.Rollout and plain.status == "queuing"
    assert await store.get_rollout_by_id("ro-missing") is None

    # agentlightning's UNSET leaves fields alone; an explicit None clears them.
    updated = await store.update_rollout(rid, metadata=None)
    assert type(updated) is agl.Rollout and updated.metadata is None and updated.mode == "train"
    updated = await store.update_rollout(rid, config=agl.RolloutConfig(max_attempts=3))
    assert updated.config.max_attempts == 3 and updated.metadata is None
    attempt = await store.update_attempt(rid, aid, metadata={"a": 1})
    assert type(attempt) is agl.Attempt and attempt.status == "preparing" and attempt.metadata == {"a": 1}
    attempt = await store.update_attempt(rid, "latest", status="running", metadata=AGL_UNSET)
    assert attempt.metadata == {"a": 1} and attempt.status == "running"

    # Spans: add_span returns the caller's object; extras survive the round trip in both directions.
    first = _agl_span(rid, aid, 1, "first")
    assert await store.add_span(first) is first
    assert await store.add_span(first) is None  # duplicate
    second, third = _agl_span(rid, aid, 2, "second"), _agl_span(rid, aid, 3, "third")
    added = await store.add_many_spans([second, third, second])
    assert type(added) is list and added[0] is second and added[1] is third and len(added) == 2
    provider = TracerProvider()
    with provider.get_tracer("bridge-test").start_as_current_span("otel-span") as otel_span:
        otel_span.set_attribute("o", 1)
    from_otel = await store.add_otel_span(rid, aid, otel_span)  # type: ignore[arg-type]
    assert type(from_otel) is agl.Span and from_otel.name == "otel-span" and from_otel.sequence_id == 4
    assert await store.get_next_span_sequence_id(rid, aid) == 5
    assert await store.get_many_span_sequence_ids([(rid, aid), (rid, aid)]) == [6, 7]
    spans = await store.query_spans(rid, "latest")
    assert type(spans) is agl.PaginatedResult and [type(s) for s in spans] == [agl.Span] * 4
    assert [s.name for s in spans] == ["first", "second", "third", "otel-span"]
    assert spans[0] == first and spans[0].model_extra == {"custom_extra": {"nested": [1, 2]}}
    assert (await store.query_spans(rid, name_contains="ir")).total == 2

    attempts = await store.query_attempts(rid)
    assert type(attempts) is agl.PaginatedResult and [type(a) for a in attempts] == [agl.Attempt]
    latest = await store.get_latest_attempt(rid)
    assert type(latest) is agl.Attempt and latest.status == "running"  # promoted by the spans

    # Resources: concrete upstream classes come back (discriminated union re-materialised).
    resources = {
        "llm": agl.LLM(endpoint="http://llm", model="m", sampling_parameters={"t": 0.5}),
        "proxy": agl.ProxyLLM(endpoint="http://proxy/v1", model="p"),
        "prompt": agl.PromptTemplate(template=PROMPT, engine="f-string"),
    }
    added_res = await store.add_resources(resources)
    assert type(added_res) is agl.ResourcesUpdate and added_res.version == 1
    assert {k: type(v) for k, v in added_res.resources.items()} == {
        "llm": agl.LLM, "proxy": agl.ProxyLLM, "prompt": agl.PromptTemplate,
    }
    assert added_res.resources == resources
    updated_res = await store.update_resources(added_res.resources_id, {"prompt": resources["prompt"]})
    assert updated_res.version == 2 and updated_res.resources_id == added_res.resources_id
    assert (await store.get_latest_resources()) == updated_res
    assert (await store.get_resources_by_id(added_res.resources_id)) == updated_res
    assert await store.get_resources_by_id("missing") is None
    res_page = await store.query_resources()
    assert type(res_page) is agl.PaginatedResult and [type(r) for r in res_page] == [agl.ResourcesUpdate]

    # Workers.
    worker = await store.update_worker("w1", {"cpu": 1.5})
    assert type(worker) is agl.Worker and worker.heartbeat_stats == {"cpu": 1.5}
    assert type(await store.get_worker_by_id("w1")) is agl.Worker
    workers = await store.query_workers(sort_by="worker_id")
    assert type(workers) is agl.PaginatedResult and [w.worker_id for w in workers] == ["w1", "w2", "w3"]

    # Finishing: propagation and waits return upstream Rollouts.
    await store.update_attempt(rid, aid, status="succeeded")
    finished = await store.wait_for_rollouts(rollout_ids=[rid, "ro-missing"], timeout=5)
    assert type(finished) is list and [(type(r), r.status) for r in finished] == [(agl.Rollout, "succeeded")]

    stats = await store.statistics()
    assert stats["name"] == "AgentLightningSqlStore" and stats["total_rollouts"] == 4
    assert stats["total_spans"] == 4 and stats["total_resources"] == 1


def test_conversion_helpers_drop_lightning_sql_only_fields() -> None:
    ours = lightning_sql.Rollout(
        rollout_id="ro-1", input={"a": 1}, start_time=1.0, resources_id="rs-1", resources_version=3,
        idempotency_key="k", priority=3, config=lightning_sql.RolloutConfig(max_attempts=2, retry_backoff_seconds=1.0),
    )
    theirs = bridge_module.to_agl(ours)
    assert type(theirs) is agl.Rollout
    mine_only = ("resources_version", "idempotency_key", "priority", "not_before")
    expected = {k: v for k, v in ours.model_dump().items() if k not in mine_only}
    # agentlightning's RolloutConfig has no back-off: its fields are dropped too (docs/queue.md).
    expected["config"] = {k: v for k, v in expected["config"].items() if not k.startswith("retry_backoff")}
    assert theirs.model_dump() == expected
    back = bridge_module.from_agl(theirs)
    assert type(back) is lightning_sql.Rollout and back.resources_version is None and back.rollout_id == "ro-1"
    assert bridge_module.from_agl(AGL_UNSET) is lightning_sql.UNSET
    assert bridge_module.from_agl({"not": "a model"}) == {"not": "a model"}
    page = bridge_module.to_agl(lightning_sql.PaginatedResult(items=[ours], limit=1, offset=2, total=9))
    assert type(page) is agl.PaginatedResult and (page.limit, page.offset, page.total) == (1, 2, 9)
    assert repr(page).startswith("<PaginatedResult (2:3 of 9)")
    assert type(bridge_module.from_agl(agl.ProxyLLM(endpoint="http://p", model="m"))) is lightning_sql.ProxyLLM


async def test_store_errors_pass_through_unchanged(store_factory: Callable[..., SqlLightningStore]) -> None:
    store = AgentLightningSqlStore(store_factory())
    with pytest.raises(ValueError, match="^Rollout ro-missing not found$"):
        await store.update_attempt("ro-missing", "latest", status="failed")
    with pytest.raises(ValueError, match="^Rollout ro-missing not found$"):
        await store.get_next_span_sequence_id("ro-missing", "at-1")
    rollout = await store.enqueue_rollout({"q": 1})
    with pytest.raises(ValueError, match=f"^No attempts found for rollout {rollout.rollout_id}$"):
        await store.update_attempt(rollout.rollout_id, "latest", status="failed")
    with pytest.raises(ValidationError):
        await store.update_rollout(rollout.rollout_id, status=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Failed to sort items by 'bogus': field does not exist on Rollout"):
        await store.query_rollouts(sort_by="bogus")
    with pytest.raises(TypeError, match="heartbeat_stats"):
        await store.update_worker("w", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input"):
        await store.enqueue_rollout({"tags": {1, 2}})
    with pytest.raises(NotImplementedError):
        store.otlp_traces_endpoint()
    # Nothing was written by the failing calls.
    assert (await store.statistics())["total_rollouts"] == 1


def test_capabilities_follow_the_backend(tmp_path: Path) -> None:
    on_file = AgentLightningSqlStore(f"sqlite:///{tmp_path / 'caps.db'}", run="r")
    assert on_file.capabilities == {"thread_safe": True, "async_safe": True, "zero_copy": True, "otlp_traces": False}
    in_memory = AgentLightningSqlStore("sqlite://", run="r")
    assert in_memory.capabilities["zero_copy"] is False and in_memory.capabilities["async_safe"] is True
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(in_memory)
    with pytest.raises(TypeError, match="store options"):
        AgentLightningSqlStore(SqlLightningStore("sqlite://", run="r"), run="other")
    with pytest.raises(TypeError, match="url_or_store"):
        AgentLightningSqlStore(42)  # type: ignore[arg-type]


async def test_url_store_uses_time_time_at_call_time_and_forwards_the_default_config(
    mp_backend: BackendSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Upstream's convention: every timestamp is the calling host's time.time() looked up at call time,
    # with no server-clock offset, also on PostgreSQL (where lightning_sql's default syncs the clock).
    store = AgentLightningSqlStore(
        mp_backend.url,
        run="clock-run",
        default_rollout_config=agl.RolloutConfig(unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive"]),
        **mp_backend.options(),
    )
    try:
        await store.statistics()  # connect, migrate and create the run before time.time is patched
        fixed = 1_234_567_890.25
        monkeypatch.setattr(time, "time", lambda: fixed)
        rollout = await store.enqueue_rollout({"q": 1})
        monkeypatch.undo()
        assert rollout.start_time == fixed
        assert rollout.config == agl.RolloutConfig(
            unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive"]
        )
        assert type(store.default_rollout_config) is agl.RolloutConfig
        store.default_rollout_config = None
        assert (await store.enqueue_rollout({"q": 2})).config == agl.RolloutConfig()
        store.default_rollout_config = agl.RolloutConfig(max_attempts=2)
        assert (await store.enqueue_rollout({"q": 3})).config.max_attempts == 2
    finally:
        await store.close()


def test_calls_through_upstreams_threaded_wrapper_do_not_deadlock(mp_backend: BackendSpec) -> None:
    # LightningStoreThreaded (shm strategy) holds a threading.Lock across each awaited store call; with
    # a store whose calls suspend, a second task on the same loop would block the loop on that lock.
    # The calls run on their own thread so that a deadlock fails this test instead of hanging it.
    store = AgentLightningSqlStore(mp_backend.url, run="threaded", **mp_backend.options())
    wrapped = LightningStoreThreaded(store)
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        rollouts = await asyncio.gather(*(wrapped.enqueue_rollout({"i": i}) for i in range(20)))
        assert len({r.rollout_id for r in rollouts}) == 20
        claims = await asyncio.gather(*(wrapped.dequeue_rollout(worker_id=f"w{i}") for i in range(25)))
        claimed = [c for c in claims if c is not None]
        assert len(claimed) == 20 and len({c.rollout_id for c in claimed}) == 20
        assert all(type(c) is agl.AttemptedRollout for c in claimed)
        # wait_for_rollouts is not locked by the wrapper and stays a real wait.
        waiter = asyncio.ensure_future(wrapped.wait_for_rollouts(rollout_ids=[claimed[0].rollout_id], timeout=30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await wrapped.update_attempt(claimed[0].rollout_id, "latest", status="succeeded")
        assert [r.status for r in await waiter] == ["succeeded"]
        await store.close()

    def run() -> None:
        try:
            asyncio.run(scenario())
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "calls through LightningStoreThreaded deadlocked"
    if "error" in outcome:
        raise outcome["error"]
    assert outcome == {"ok": True}


# --- pickling into runner processes --------------------------------------------------------------------


def test_bridge_pickles_into_forked_and_spawned_processes(mp_backend: BackendSpec, tmp_path: Path) -> None:
    store = AgentLightningSqlStore(mp_backend.url, run="pickled", **mp_backend.options())

    async def enqueue() -> list[str]:
        return [(await store.enqueue_rollout({"i": i})).rollout_id for i in range(2)]

    enqueued = asyncio.run(enqueue())  # the parent has a live I/O thread and connections before forking
    copy = pickle.loads(pickle.dumps(store))
    assert type(copy) is AgentLightningSqlStore and copy.run == "pickled"

    children = []
    for method in ("fork", "spawn"):
        result = tmp_path / f"{method}.txt"
        process = multiprocessing.get_context(method).Process(
            target=run_one_rollout, args=(store, f"{method}-worker", str(result))
        )
        process.start()
        children.append((process, result))
    for process, _ in children:
        process.join(timeout=120)
        assert process.exitcode == 0
    claimed = {result.read_text() for _, result in children}
    assert claimed == set(enqueued)

    async def verify() -> None:
        for rollout_id in enqueued:
            rollout = await copy.get_rollout_by_id(rollout_id)
            assert rollout is not None and rollout.status == "succeeded"
            spans = await copy.query_spans(rollout_id)
            assert [s.name for s in spans] == ["child-span"]
        workers = await copy.query_workers(sort_by="worker_id")
        assert [w.worker_id for w in workers] == ["fork-worker", "spawn-worker"]
        await copy.close()
        await store.close()

    asyncio.run(verify())


# --- agentlightning's Trainer end to end ----------------------------------------------------------------


@agl.rollout
def reward_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    """Offline agent: formats its prompt resource, emits one OTel span, returns reward x / 10."""
    agl.emit_message(prompt_template.format(x=task["x"]))
    return task["x"] / 10.0


@agl.rollout
def reward_only_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    """Offline agent that emits no OTel span of its own (see the managed client-server case below)."""
    assert prompt_template.format(x=task["x"]) == PROMPT.format(x=task["x"])
    return task["x"] / 10.0


# In the managed client-server strategy the runners reach the store only through upstream's HTTP
# client, whose capabilities send the tracer's OTel spans through upstream's OTLP exporter; with the
# installed opentelemetry exporter that exporter ignores the store server's endpoint (it retries the
# default localhost:4318 and drops the spans), with upstream's in-memory store as well. The reward span
# (written with add_span) still arrives, so that strategy runs the reward-only agent.
AGENTS = {"shm": reward_agent, "cs": reward_only_agent, "cs-direct": reward_agent}
SPAN_NAMES = {
    "shm": {"agentlightning.message", "agentlightning.annotation"},
    "cs": {"agentlightning.annotation"},
    "cs-direct": {"agentlightning.message", "agentlightning.annotation"},
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _strategy(name: str) -> tuple[Any, int]:
    if name == "shm":
        # One runner thread: upstream's tracer keeps one process-wide "active tracer", so several
        # runner threads in one process collide (with its in-memory store too).
        return SharedMemoryExecutionStrategy(main_thread="algorithm", graceful_delay=1.0), 1
    managed = name == "cs"  # "cs-direct": runner processes call the SQL store themselves, no HTTP hop
    return (
        ClientServerExecutionStrategy(
            n_runners=2, server_host="127.0.0.1", server_port=_free_port(), managed_store=managed,
            graceful_timeout=5.0, terminate_timeout=5.0,
        ),
        2,
    )


async def _assert_run_complete(url: str, options: dict[str, Any], run: str, span_names: set[str]) -> None:
    store = SqlLightningStore(url, run=run, create_run=False, **options)
    try:
        page = await store.query_rollouts()
        assert sorted(r.input["x"] for r in page) == sorted(s["x"] for s in TRAIN_SAMPLES + VAL_SAMPLES)
        assert {r.input["x"]: r.mode for r in page} == {
            **{s["x"]: "train" for s in TRAIN_SAMPLES}, **{s["x"]: "val" for s in VAL_SAMPLES}
        }
        resources = await store.get_resources_by_id("default")
        assert resources is not None and resources.resources["prompt"].template == PROMPT  # type: ignore[union-attr]
        for rollout in page:
            assert rollout.status == "succeeded", rollout
            assert type(rollout) is lightning_sql.AttemptedRollout and rollout.attempt.status == "succeeded"
            assert (rollout.attempt.worker_id or "").startswith("Worker-")
            assert rollout.resources_id == "default" and rollout.resources_version == 1
            spans = await store.query_spans(rollout.rollout_id)
            by_name = {span.name: span for span in spans}
            assert len(spans) == len(span_names) and set(by_name) == span_names, by_name
            reward = by_name["agentlightning.annotation"].attributes["agentlightning.reward.0.value"]
            assert reward == pytest.approx(rollout.input["x"] / 10.0)
        stats = await store.statistics()
        assert stats["total_rollouts"] == len(page) and stats["total_spans"] == len(span_names) * len(page)
    finally:
        await store.close()


@pytest.mark.parametrize("strategy_name", ["shm", "cs", "cs-direct"])
def test_agentlightning_trainer_runs_to_completion(mp_backend: BackendSpec, strategy_name: str) -> None:
    run = f"agl-{strategy_name}"
    store = AgentLightningSqlStore(mp_backend.url, run=run, **mp_backend.options())
    strategy, n_runners = _strategy(strategy_name)
    trainer = agl.Trainer(
        store=store,
        algorithm=agl.Baseline(polling_interval=0.1),
        n_runners=n_runners,
        runner=agl.LitAgentRunner(tracer=agl.OtelTracer(), poll_interval=0.1),
        strategy=strategy,
        initial_resources={"prompt": agl.PromptTemplate(template=PROMPT, engine="f-string")},
    )
    started = time.monotonic()
    trainer.fit(AGENTS[strategy_name], train_dataset=TRAIN_SAMPLES, val_dataset=VAL_SAMPLES)
    assert time.monotonic() - started < 120

    asyncio.run(_assert_run_complete(mp_backend.url, mp_backend.options(), run, SPAN_NAMES[strategy_name]))

    # The CLI reads the same run.
    args = ["runs", "--url", mp_backend.url, "--json"]
    if mp_backend.schema is not None:
        args += ["--schema", mp_backend.schema]
    from lightning_sql.cli import cli

    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (row,) = [r for r in json.loads(result.stdout) if r["name"] == run]
    total = len(TRAIN_SAMPLES) + len(VAL_SAMPLES)
    assert (row["rollouts"], row["succeeded"], row["failed"], row["spans"]) == (total, total, 0, len(SPAN_NAMES[strategy_name]) * total)
    asyncio.run(store.close())


async def test_agentlightning_heartbeat_tests_pass_on_a_url_store(
    mp_backend: BackendSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Agent-Lightning 0.3's test_spans_promote_preparing_attempt_with_heartbeat and
    test_running_attempt_updates_heartbeat (tests/store/test_core.py), on the bridge built from a URL."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    def readable(index: int) -> ReadableSpan:
        context = SpanContext(trace_id=0xAB, span_id=index, is_remote=False, trace_flags=TraceFlags(1))
        return ReadableSpan(name="s", context=context, attributes={}, start_time=1, end_time=2)

    store = AgentLightningSqlStore(mp_backend.url, run="heartbeat", scan_debounce_seconds=0, **mp_backend.options())
    try:
        rollout = await store.enqueue_rollout(input={"test": "preparing-heartbeat"})
        assert await store.dequeue_rollout() is not None
        attempt_id = (await store.query_attempts(rollout.rollout_id))[0].attempt_id
        monkeypatch.setattr("agentlightning.store.collection_based.time.time", lambda: 1234.5)
        await store.add_otel_span(rollout.rollout_id, attempt_id, readable(1))
        after = (await store.query_attempts(rollout.rollout_id))[0]
        assert (after.status, after.last_heartbeat_time) == ("running", 1234.5)
        first = after.last_heartbeat_time
        monkeypatch.setattr("agentlightning.store.collection_based.time.time", lambda: first + 100.0)
        await store.add_otel_span(rollout.rollout_id, attempt_id, readable(2))
        assert (await store.query_attempts(rollout.rollout_id))[0].last_heartbeat_time == first + 100.0
    finally:
        monkeypatch.undo()
        await store.close()
