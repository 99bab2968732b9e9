"""fit / dev end to end on SQLite and PostgreSQL, with both strategies; hooks; failures and retries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lightning_sql import (
    AGL_ANNOTATION,
    Baseline,
    Hook,
    LitAgentRunner,
    PromptTemplate,
    RolloutConfig,
    Trainer,
    reward_value_key,
)
from lightning_sql.runtime.algorithm import sample_keys
from lightning_sql.runtime.runner import ERROR_TRACEBACK_LIMIT
from tests.runtime import agents

PROMPT = {"prompt": PromptTemplate(template="double {x}", engine="f-string")}
FAST_RUNNER = {"type": "agent", "poll_interval": 0.5, "heartbeat_interval": 0.5}


def _trainer(store: Any, **kwargs: Any) -> Trainer:
    kwargs.setdefault("algorithm", Baseline(polling_interval=0.5, span_verbosity="key_values"))
    kwargs.setdefault("runner", FAST_RUNNER)
    kwargs.setdefault("initial_resources", PROMPT)
    return Trainer(store=store, **kwargs)


def _summary(store: Any) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        rollouts = list(await store.query_rollouts())
        spans = {r.rollout_id: list(await store.query_spans(r.rollout_id)) for r in rollouts}
        attempts = {r.rollout_id: list(await store.query_attempts(r.rollout_id)) for r in rollouts}
        run = await store.get_run(store.run)
        return {"rollouts": rollouts, "spans": spans, "attempts": attempts, "run": run}

    return asyncio.run(read())


def _close(store: Any) -> None:
    asyncio.run(store.close())


@pytest.mark.parametrize("strategy", ["inprocess", "processes"])
@pytest.mark.parametrize("agent_name", ["sync_agent", "async_agent"])
def test_fit_end_to_end(mp_backend: Any, strategy: str, agent_name: str) -> None:
    if strategy == "processes" and agent_name == "sync_agent" and not mp_backend.is_postgres:
        pytest.skip("covered by the async agent on SQLite; keeps the suite short")
    store = mp_backend.open(run=f"fit-{strategy}-{agent_name}")
    try:
        trainer = _trainer(store, n_runners=2, strategy=strategy)
        train = [{"x": i} for i in range(6)]
        val = [{"x": 100 + i} for i in range(3)]
        trainer.fit(getattr(agents, agent_name), train, val)
        got = _summary(store)
        assert got["run"].status == "finished"
        rollouts = got["rollouts"]
        samples = [("train", s) for s in train] + [("val", s) for s in val]
        assert sorted((r.mode, r.idempotency_key) for r in rollouts) == sorted(
            (mode, key) for (mode, _), key in zip(samples, sample_keys(0, samples), strict=True)
        )
        assert all(key.startswith(f"0:{mode}:") for mode, key in ((r.mode, r.idempotency_key) for r in rollouts))
        assert {r.status for r in rollouts} == {"succeeded"}
        for r in rollouts:
            assert r.metadata == {"baseline_sample": r.idempotency_key}
            assert r.config == RolloutConfig(unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive", "timeout"])
            names = [s.name for s in got["spans"][r.rollout_id]]
            assert names == ["openai.chat.completion", AGL_ANNOTATION]
            assert [s.sequence_id for s in got["spans"][r.rollout_id]] == [1, 2]
            llm = got["spans"][r.rollout_id][0]
            assert llm.attributes["gen_ai.prompt.0.content"] == f"double {r.input['x']}"
            (attempt,) = got["attempts"][r.rollout_id]
            assert attempt.status == "succeeded" and attempt.worker_id in {"Worker-0", "Worker-1"}
        pids = {s.attributes["agent.pid"] for spans in got["spans"].values() for s in spans if "agent.pid" in s.attributes}
        import os

        if strategy == "processes":
            assert os.getpid() not in pids  # the agent ran in the children
        else:
            assert pids == {os.getpid()}
        harvested = trainer.algorithm.harvested  # type: ignore[union-attr]
        assert len(harvested) == 9 and trainer.algorithm.triplets_count == 9  # type: ignore[union-attr]
    finally:
        _close(store)


class RecordingHook(Hook):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Any) -> None:
        self.events.append(("on_rollout_start", rollout.rollout_id))

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        from lightning_sql import get_active_tracer

        assert get_active_tracer() is tracer
        self.events.append(("on_trace_start", rollout.rollout_id))

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        self.events.append(("on_trace_end", rollout.rollout_id))

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None:
        # Before the report: the attempt is not finished yet, and the spans are already stored.
        attempt = await runner.get_store().get_latest_attempt(rollout.rollout_id)
        assert attempt.status in ("preparing", "running")
        stored = await runner.get_store().query_spans(rollout.rollout_id)
        assert len(stored) == len(spans) == 2
        self.events.append(("on_rollout_end", rollout.rollout_id))


class BrokenHook(Hook):
    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        raise RuntimeError("hooks must not break the runner")


def test_dev_hooks_fire_in_order(mp_backend: Any) -> None:
    store = mp_backend.open(run="dev-hooks")
    hook = RecordingHook()
    try:
        trainer = _trainer(store, n_runners=1, hooks=[BrokenHook(), hook], algorithm=None)
        trainer.dev(agents.async_agent, [{"x": 1}, {"x": 2}], [{"x": 3}])
        got = _summary(store)
        assert {r.status for r in got["rollouts"]} == {"succeeded"} and len(got["rollouts"]) == 3
        order = ["on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end"]
        assert [name for name, _ in hook.events] == order * 3
        for i in range(3):
            assert len({rid for _, rid in hook.events[4 * i : 4 * i + 4]}) == 1
    finally:
        _close(store)


def test_failures_are_recorded_and_retried(mp_backend: Any) -> None:
    store = mp_backend.open(run="flaky")
    try:
        config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
        trainer = _trainer(store, n_runners=2, rollout_config=config)
        trainer.fit(agents.FlakyAgent(), [{"x": i} for i in range(4)])
        got = _summary(store)
        assert {r.status for r in got["rollouts"]} == {"succeeded"}
        for r in got["rollouts"]:
            first, second = got["attempts"][r.rollout_id]
            assert (first.status, second.status) == ("failed", "succeeded")
            error = first.metadata["error"]
            assert error["type"] == "RuntimeError"
            assert error["message"] == f"flaky failure on {r.input['x']}\\x00 with a NUL"
            assert "Traceback" in error["traceback"] and "FlakyAgent" not in error["type"]
            assert "agents.py" in error["traceback"]
            # the reward of the retry is an annotation span of attempt 2
            rewards = [s for s in got["spans"][r.rollout_id] if s.name == AGL_ANNOTATION]
            assert [(s.attempt_id, s.attributes[reward_value_key(0)]) for s in rewards] == [(second.attempt_id, 1.0)]
    finally:
        _close(store)


def test_failure_without_retry_fails_the_rollout(mp_backend: Any) -> None:
    store = mp_backend.open(run="always-fails")
    try:
        trainer = _trainer(store, n_runners=1, rollout_config=RolloutConfig(max_attempts=1))
        trainer.fit(agents.AlwaysFails(), [{"x": 1}])
        got = _summary(store)
        (r,) = got["rollouts"]
        assert r.status == "failed"
        (attempt,) = got["attempts"][r.rollout_id]
        error = attempt.metadata["error"]
        assert error["type"] == "ValueError" and error["message"].startswith("boom xxx")
        assert len(error["traceback"]) <= ERROR_TRACEBACK_LIMIT + 100
        # The frames that say where it failed are kept; the 50,000-character message is cut.
        assert 'raise ValueError("boom " + "x" * 50_000)' in error["traceback"]
        assert error["traceback"].rstrip().endswith("xxx...(truncated)")
    finally:
        _close(store)


def test_missing_resources_fail_the_attempt(mp_backend: Any) -> None:
    store = mp_backend.open(run="missing-resources")

    async def scenario() -> None:
        r = await store.enqueue_rollout({"x": 1}, resources_id="nope", config=RolloutConfig())
        runner: LitAgentRunner[Any] = LitAgentRunner(max_rollouts=1, poll_interval=0.2, heartbeat_interval=0)
        runner.init(agents.async_agent)
        runner.init_worker(0, store)
        await asyncio.wait_for(runner.iter(), 60)
        attempt = await store.get_latest_attempt(r.rollout_id)
        assert attempt.status == "failed" and "nope" in attempt.metadata["error"]["message"]
        assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"
        # an empty resources id with no resources in the run runs with {}
        ok = await runner.step({"x": 2})
        assert ok.status == "failed"  # async_agent needs a PromptTemplate: its error says so
        err = (await store.get_latest_attempt(ok.rollout_id)).metadata["error"]
        assert "PromptTemplate" in err["message"]
        done = await runner.step({"x": 3}, resources=PROMPT, mode="train")
        assert done.status == "succeeded"

    try:
        asyncio.run(scenario())
    finally:
        _close(store)
