"""Trainer component specs, deprecated arguments, agents' signatures, the adapter."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

from lightning_sql import (
    AGL_ANNOTATION,
    LLM,
    Baseline,
    FastAlgorithm,
    InProcessExecutionStrategy,
    LitAgentRunner,
    NoopTracer,
    OtelTracer,
    ProcessExecutionStrategy,
    PromptTemplate,
    ProxyLLM,
    RolloutConfig,
    Span,
    SqlLightningStore,
    TracerTraceToTriplet,
    TraceTree,
    Trainer,
    rollout,
)
from lightning_sql.runtime.algorithm import Algorithm
from lightning_sql.types import AttemptedRollout, reward_name_key, reward_value_key


def _store(tmp_path: Any, **kw: Any) -> SqlLightningStore:
    return SqlLightningStore(f"sqlite:///{tmp_path / 'c.db'}", **kw)


def test_component_specs(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    t = Trainer(store=url, run="r1", n_runners=3, strategy="processes", tracer="noop", runner=LitAgentRunner,
                adapter={"llm_call_match": "x"}, algorithm="baseline", max_rollouts=7)
    assert isinstance(t.store, SqlLightningStore) and t.store.run == "r1"
    assert t.store.default_rollout_config == RolloutConfig(
        unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive", "timeout"]
    )
    assert isinstance(t.strategy, ProcessExecutionStrategy) and t.strategy.n_runners == 3
    assert isinstance(t.tracer, NoopTracer)
    assert isinstance(t.runner, LitAgentRunner) and t.runner.tracer is t.tracer and t.runner.max_rollouts == 7
    assert isinstance(t.adapter, TracerTraceToTriplet) and t.adapter.llm_call_match == "x"
    assert isinstance(t.algorithm, Baseline)
    t2 = Trainer(store={"url": url, "run": "r2"}, strategy={"type": "shm", "graceful_timeout": 1.0},
                 algorithm=lambda: Baseline(n_epochs=2), tracer="lightning_sql.runtime.tracer:OtelTracer",
                 runner={"type": "lightning_sql.runtime.runner.LitAgentRunner", "poll_interval": 0.1})
    assert isinstance(t2.strategy, InProcessExecutionStrategy) and t2.strategy.graceful_timeout == 1.0
    assert t2.algorithm.n_epochs == 2 and isinstance(t2.tracer, OtelTracer)  # type: ignore[union-attr]
    assert t2.runner.poll_interval == 0.1  # type: ignore[attr-defined]
    assert Trainer(store=url, strategy="cs").strategy.__class__ is ProcessExecutionStrategy
    with pytest.raises(TypeError, match="algorithm"):
        Trainer(store=url, algorithm=lambda: 42)
    with pytest.raises(TypeError, match="tracer"):
        Trainer(store=url, tracer=Baseline)
    with pytest.raises(ValueError, match="strategy"):
        Trainer(store=url, strategy="warp-drive")


def test_store_instance_and_run(tmp_path: Any) -> None:
    store = _store(tmp_path, run="a")
    with pytest.raises(ValueError, match="'a'.*'b'"):
        Trainer(store=store, run="b")
    assert Trainer(store=store, run="a").store is store
    assert store.default_rollout_config is not None and store.default_rollout_config.unresponsive_seconds == 60
    mine = RolloutConfig(timeout_seconds=5)
    Trainer(store=store, rollout_config=mine)
    assert store.default_rollout_config == mine  # an explicit config replaces the store's
    Trainer(store=store)
    assert store.default_rollout_config == mine  # the default only fills a store that has none


def test_default_store_url(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("LIGHTNING_SQL_URL", f"sqlite:///{tmp_path / 'env.db'}")
    t = Trainer()
    assert str(tmp_path / "env.db") in t.store.url and t.run  # a new, generated run
    monkeypatch.delenv("LIGHTNING_SQL_URL")
    monkeypatch.chdir(tmp_path)
    assert "lightning_sql.db" in Trainer(run="x").store.url


def test_deprecated_arguments_warn_and_work(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'd.db'}"
    adapter = TracerTraceToTriplet()
    with pytest.warns(DeprecationWarning) as record:
        t = Trainer(store=url, n_workers=3, max_tasks=5, triplet_exporter=adapter, dev=True)
    assert len(record) == 4
    assert t.n_runners == 3 and t.max_rollouts == 5 and t.adapter is adapter and t.dev_mode
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(store=url, n_runners=2)


def test_dev_requires_a_fast_algorithm(tmp_path: Any) -> None:
    class Slow(Algorithm):
        def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None: ...

    t = Trainer(store=f"sqlite:///{tmp_path / 'e.db'}", algorithm=Slow())
    with pytest.raises(TypeError, match="FastAlgorithm"):
        t.dev(rollout(lambda task, llm: None))
    assert issubclass(Baseline, FastAlgorithm)


def test_baseline_arguments() -> None:
    with pytest.raises(ValueError, match="train_split must be between 0 and 1."):
        Baseline(train_split=1.0)
    with pytest.raises(ValueError, match="span_verbosity"):
        Baseline(span_verbosity="all")  # type: ignore[arg-type]


def test_rollout_decorator_signatures() -> None:
    @rollout
    def by_llm(task: Any, llm: LLM) -> float:
        return 1.0

    @rollout
    async def by_prompt(task: Any, prompt_template: PromptTemplate, rollout: Any) -> None:
        return None

    assert not by_llm.is_async() and by_prompt.is_async()
    with pytest.raises(NotImplementedError):

        @rollout
        def bad(task: Any, model: Any) -> None: ...

    seen: dict[str, Any] = {}

    @rollout
    def routed(task: Any, llm: LLM, rollout: Any) -> None:
        seen["url"] = llm.endpoint

    ar = AttemptedRollout.model_validate(
        {"rollout_id": "ro-1", "input": 1, "start_time": 0.0,
         "attempt": {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "start_time": 0.0}}
    )
    routed.rollout(1, {"m": ProxyLLM(endpoint="http://h/v1", model="m")}, ar)
    assert seen["url"] == "http://h/rollout/ro-1/attempt/at-1/v1"
    with pytest.raises(ValueError, match="LLM"):
        by_llm.rollout(1, {}, ar)


def _span(span_id: str, parent: str | None, name: str, start: float, end: float, seq: int, **attrs: Any) -> Span:
    return Span.from_attributes(
        attributes=attrs, rollout_id="ro-1", attempt_id="at-1", sequence_id=seq, name=name,
        trace_id="0" * 32, span_id=span_id, parent_id=parent, start_time=start, end_time=end,
    )


def _reward(span_id: str, parent: str | None, t: float, seq: int, value: float) -> Span:
    return _span(span_id, parent, AGL_ANNOTATION, t, t, seq, **{reward_name_key(0): "primary", reward_value_key(0): value})


def test_trace_to_triplets() -> None:
    spans = [
        _span("a" * 16, None, "agent", 0, 10, 1, **{"agent.name": "solver"}),
        _span("b" * 16, "a" * 16, "openai.chat.completion", 1, 2, 2, **{
            "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi", "gen_ai.completion.0.content": "yo",
            "prompt_token_ids": [1, 2], "response_token_ids": [3], "gen_ai.response.id": "r1"}),
        _span("c" * 16, "b" * 16, "http.post", 1.1, 1.9, 2),
        _span("d" * 16, "a" * 16, "openai.chat.completion", 3, 4, 3, **{"gen_ai.prompt.0.content": "again"}),
        _reward("e" * 16, "a" * 16, 5, 4, 0.75),
        # an orphan (its parent was never stored) inside the agent's time range: repaired under it
        _span("f" * 16, "9" * 16, "openai.chat.completion", 6, 7, 5, **{"gen_ai.prompt.0.content": "orphan"}),
    ]
    triplets = TracerTraceToTriplet().adapt(spans)
    assert [t.prompt["raw_content"][0]["content"] for t in triplets] == ["hi", "again", "orphan"]
    assert triplets[0].prompt["token_ids"] == [1, 2] and triplets[0].response["token_ids"] == [3]
    assert triplets[0].response["raw_content"] == [{"content": "yo"}]
    assert triplets[0].metadata["response_id"] == "r1"
    assert [t.reward for t in triplets] == [None, 0.75, None]  # the reward follows the second call
    assert len(TracerTraceToTriplet(agent_match="nobody").adapt(spans)) == 0
    assert len(TracerTraceToTriplet(agent_match="solver", repair_hierarchy=False).adapt(spans)) == 2
    tree = TraceTree.from_spans(spans)
    assert tree.is_virtual and len(tree.children) == 2
    tree.repair_hierarchy()
    assert len(tree.children) == 1 and tree.children[0].span.name == "agent"
    assert TracerTraceToTriplet().adapt([]) == []  # no spans, no triplets (unlike upstream: see adapt)


def test_runner_return_values(tmp_path: Any) -> None:
    from lightning_sql import SpanCoreFields, TraceStatus

    store = _store(tmp_path, run="returns")

    async def scenario() -> None:
        results: list[Any] = [
            True,
            [SpanCoreFields(name="core", status=TraceStatus(status_code="OK"), attributes={"k": 1}, start_time=1.0, end_time=2.0)],
            [Span.from_attributes(attributes={}, name="own", rollout_id=None)],
            [],
            "nonsense",
        ]
        from lightning_sql import LitAgent

        class Returner(LitAgent[Any]):
            async def rollout_async(self, task: Any, resources: Any, rollout: Any) -> Any:
                value = results[task]
                if isinstance(value, list) and value and isinstance(value[0], Span):
                    value[0].rollout_id, value[0].attempt_id = rollout.rollout_id, rollout.attempt.attempt_id
                return value

        runner: LitAgentRunner[Any] = LitAgentRunner(tracer=NoopTracer(), heartbeat_interval=0)
        runner.init(Returner())
        runner.init_worker(0, store)
        outcomes = [await runner.step(i) for i in range(len(results))]
        assert [o.status for o in outcomes] == ["succeeded", "succeeded", "succeeded", "succeeded", "failed"]
        names = [[s.name for s in await store.query_spans(o.rollout_id)] for o in outcomes]
        assert names == [[AGL_ANNOTATION], ["core"], ["own"], [], []]
        reward = (await store.query_spans(outcomes[0].rollout_id))[0]
        assert reward.attributes[reward_value_key(0)] == 1.0 and reward.sequence_id == 1
        error = (await store.get_latest_attempt(outcomes[4].rollout_id)).metadata["error"]  # type: ignore[union-attr]
        assert error["type"] == "ValueError" and "Invalid rollout result" in error["message"]
        await store.close()

    asyncio.run(scenario())
