"""``Trainer(llm_proxy=...)``: built from any spec, started before the runners, stopped at the end; the
stored calls become triplets with token ids and rewards, for lightning_sql's adapter and Agent-Lightning's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import Baseline, LLMProxy, SqlLightningStore, Trainer
from lightning_sql.llm_proxy.testing import StandInModelServer, reply, tokenize
from tests.conftest import BackendSpec
from tests.llm_proxy.agents import TripletCollector, adder
from tests.llm_proxy.conftest import MODEL, model_entry, spans_of
from tests.required import AGENTLIGHTNING, required_import
from tests.runtime.agents import sync_agent

TASKS = [{"a": a, "b": b, "stream": a % 2 == 0} for a, b in [(1, 2), (2, 5), (3, 3), (10, 7), (4, 4), (6, 1)]]


def _expected_reward(task: dict[str, Any]) -> float:
    answer = reply(f"<|user|> What is {task['a']} + {task['b']}? <|assistant|>")
    return 1.0 if answer.split()[-1] == str(task["a"] + task["b"]) else 0.0


def _store_spec(backend: BackendSpec) -> dict[str, Any]:
    return {"url": backend.url, **backend.options()}


@pytest.mark.parametrize("spec_kind", ["dict", "instance"])
def test_trainer_runs_agents_through_its_proxy_and_the_calls_become_triplets(
    spec_kind: str, persistent_backend: BackendSpec, stand_in: StandInModelServer
) -> None:
    entry = model_entry(stand_in.url)
    proxy_spec: Any = {"model_list": [entry]} if spec_kind == "dict" else LLMProxy(model_list=[entry])
    algorithm = TripletCollector()
    trainer = Trainer(
        store=_store_spec(persistent_backend), run="proxy-e2e", n_runners=3, algorithm=algorithm,
        llm_proxy=proxy_spec,
    )
    assert isinstance(trainer.llm_proxy, LLMProxy) and trainer.llm_proxy.get_store() is trainer.store
    trainer.fit(adder, train_dataset=TASKS)
    assert algorithm.proxy_was_running and not trainer.llm_proxy.is_running()
    assert len(algorithm.triplets) == len(TASKS)

    async def check() -> None:
        store = persistent_backend.open(run="proxy-e2e")
        rollouts = {r.rollout_id: r for r in await store.query_rollouts()}
        assert {r.status for r in rollouts.values()} == {"succeeded"}
        for rollout_id, triplets in algorithm.triplets.items():
            task = rollouts[rollout_id].input
            prompt = f"<|user|> What is {task['a']} + {task['b']}? <|assistant|>"
            (triplet,) = triplets
            assert triplet.prompt["token_ids"] == tokenize(prompt)
            assert triplet.response["token_ids"] == tokenize(reply(prompt))
            assert triplet.reward == _expected_reward(task)
            spans = await store.query_spans(rollout_id)
            (call,) = [s for s in spans if s.name == "openai.chat.completion"]
            assert call.attributes["lightning_sql.proxy.stream"] is task["stream"]
            assert call.attributes["gen_ai.request.temperature"] == 0
        await store.close()
        await trainer.store.close()  # type: ignore[attr-defined]

    asyncio.run(check())


def test_agentlightning_adapter_turns_the_same_spans_into_triplets(
    tmp_path: Path, stand_in: StandInModelServer
) -> None:
    """Agent-Lightning's own TracerTraceToTriplet, reading through the bridge, sees the token ids and rewards."""
    agl = required_import("agentlightning", AGENTLIGHTNING)
    from lightning_sql.contrib.agentlightning import AgentLightningSqlStore

    url = f"sqlite:///{tmp_path / 'agl.db'}"
    algorithm = TripletCollector()
    trainer = Trainer(store=url, run="agl", n_runners=2, algorithm=algorithm,
                      llm_proxy={"model_list": [model_entry(stand_in.url)]})
    trainer.fit(adder, train_dataset=TASKS[:4])

    async def check() -> None:
        bridge = AgentLightningSqlStore(url, run="agl")
        assert len(algorithm.triplets) == 4  # one per task: a loop over none would prove nothing
        for rollout_id, ours in algorithm.triplets.items():
            spans = list(await bridge.query_spans(rollout_id, "latest"))
            theirs = agl.TracerTraceToTriplet().adapt(spans)
            assert len(theirs) == 1 and len(ours) == 1
            assert theirs[0].prompt["token_ids"] == ours[0].prompt["token_ids"] != []
            assert theirs[0].response["token_ids"] == ours[0].response["token_ids"] != []
            assert theirs[0].reward == ours[0].reward is not None
            assert theirs[0].metadata["response_id"] == ours[0].metadata["response_id"]
            (proxied,) = agl.LlmProxyTraceToTriplet().adapt(spans)  # the adapter of its RL examples
            assert proxied.prompt["token_ids"] == ours[0].prompt["token_ids"]
            assert proxied.response["token_ids"] == ours[0].response["token_ids"]
            assert proxied.reward == ours[0].reward and proxied.metadata["response_id"] == ours[0].metadata["response_id"]
        await bridge.close()
        await trainer.store.close()  # type: ignore[attr-defined]

    asyncio.run(check())


def test_trainer_builds_its_proxy_from_a_class_a_name_or_an_import_path(tmp_path: Path) -> None:
    for spec in (LLMProxy, "llm_proxy", "lightning_sql.llm_proxy:LLMProxy", {"type": "llm_proxy", "port": 18999}):
        trainer = Trainer(store=f"sqlite:///{tmp_path / 'specs.db'}", llm_proxy=spec)
        assert isinstance(trainer.llm_proxy, LLMProxy) and trainer.llm_proxy.get_store() is trainer.store
    assert trainer.llm_proxy.port == 18999
    with pytest.raises(ValueError, match="llm_proxy"):
        Trainer(store="sqlite://", llm_proxy=42)
    with pytest.raises(TypeError, match="llm_proxy"):
        Trainer(store="sqlite://", llm_proxy=Baseline)
    with pytest.raises(ValueError, match="provider"):
        Trainer(store="sqlite://", llm_proxy={"model_list": [{"model_name": "x", "litellm_params": {"model": "anthropic/claude"}}]})


def test_the_asyncio_launch_mode_is_served_from_the_algorithms_loop(
    tmp_path: Path, stand_in: StandInModelServer
) -> None:
    algorithm = TripletCollector()
    trainer = Trainer(store=f"sqlite:///{tmp_path / 'aio.db'}", n_runners=2, algorithm=algorithm,
                      llm_proxy={"model_list": [model_entry(stand_in.url)], "launch_mode": "asyncio"})
    trainer.fit(adder, train_dataset=TASKS[:3])
    assert algorithm.proxy_was_running and not trainer.llm_proxy.is_running()
    assert [len(t) for t in algorithm.triplets.values()] == [1, 1, 1]
    assert all(t[0].response["token_ids"] for t in algorithm.triplets.values())


def test_baseline_runs_without_a_proxy_and_imports_no_http_stack(tmp_path: Path) -> None:
    trainer = Trainer(store=f"sqlite:///{tmp_path / 'plain.db'}", run="plain", n_runners=2,
                      algorithm=Baseline(polling_interval=0.1),
                      initial_resources={"prompt": {"resource_type": "prompt_template", "template": "{x}",  # type: ignore[dict-item]
                                                    "engine": "f-string"}})
    assert trainer.llm_proxy is None
    trainer.fit(sync_agent, train_dataset=[{"x": i} for i in range(4)], val_dataset=[{"x": 9}])
    assert trainer.algorithm is not None and len(trainer.algorithm.harvested) == 5  # type: ignore[attr-defined]
    code = (
        "import sys, lightning_sql\n"
        "from lightning_sql import Trainer, Baseline, LLMProxy\n"
        "Trainer(store='sqlite://')\n"
        "print(sorted(m for m in ('starlette', 'uvicorn', 'httpx') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_model_name_is_needed_when_the_list_has_several() -> None:
    proxy = LLMProxy(model_list=[model_entry("http://127.0.0.1:1/v1"), model_entry("http://127.0.0.1:2/v1")])
    resource = proxy.as_resource()
    assert resource.resource_type == "proxy_llm" and resource.model == MODEL
    assert resource.get_base_url("ro-1", "at-1") == f"{proxy.endpoint}/rollout/ro-1/attempt/at-1"
    assert proxy.as_resource("ro-1", "at-1").endpoint == f"{proxy.endpoint}/rollout/ro-1/attempt/at-1"
    two = LLMProxy(model_list=[model_entry("http://127.0.0.1:1/v1"), model_entry("http://127.0.0.1:1/v1", name="b")])
    with pytest.raises(ValueError, match="Multiple models"):
        two.as_resource()
    with pytest.raises(ValueError, match="Either rollout_id and attempt_id"):
        proxy.as_resource("ro-1")
    with pytest.raises(ValueError, match="No models"):
        LLMProxy().as_resource()
    with pytest.raises(ValueError, match="Store is not set"):
        asyncio.run(LLMProxy(model_list=[model_entry("http://127.0.0.1:1/v1")]).start())
    with pytest.raises(ValueError, match="launch_mode"):
        LLMProxy(launch_mode="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="middleware"):
        LLMProxy(middlewares=["nope"])
    with pytest.raises(ValueError, match="api_base"):
        LLMProxy(model_list=[{"model_name": "x", "litellm_params": {"model": "hosted_vllm/x"}}])  # type: ignore[typeddict-item]


def test_sqlite_memory_store_is_fine_in_thread_mode(stand_in: StandInModelServer) -> None:
    store = SqlLightningStore("sqlite://", run="mem")

    async def go() -> None:
        proxy = LLMProxy(model_list=[model_entry(stand_in.url)], store=store)
        await proxy.start()
        rollout = await store.start_rollout(input={})
        import openai

        client = openai.AsyncOpenAI(base_url=proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id).endpoint,
                                    api_key="x", max_retries=0)
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        await proxy.stop()
        assert len(await spans_of(store, rollout.rollout_id)) == 1
        await store.close()

    asyncio.run(go())


def test_code_written_for_agentlightning_runs_with_the_bridge_store(
    tmp_path: Path, stand_in: StandInModelServer
) -> None:
    """Agent-Lightning-style code: its store (the bridge), a claimed rollout, the openai SDK, its adapter."""
    agl = required_import("agentlightning", AGENTLIGHTNING)
    from openai import AsyncOpenAI

    from lightning_sql.contrib.agentlightning import AgentLightningSqlStore

    async def go() -> None:
        store = AgentLightningSqlStore(f"sqlite:///{tmp_path / 'bridge.db'}", run="bridge")
        proxy = LLMProxy(model_list=[model_entry(stand_in.url)], store=store)  # type: ignore[arg-type]
        await proxy.start()
        await store.enqueue_rollout(input={"q": 1})
        claimed = await store.dequeue_rollout(worker_id="w1")
        assert claimed is not None
        client = AsyncOpenAI(base_url=proxy.as_resource(claimed.rollout_id, claimed.attempt.attempt_id).endpoint,
                             api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        await client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
        stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)  # type: ignore[arg-type]
        [chunk async for chunk in stream]
        await client.close()
        await proxy.stop()
        spans = list(await store.query_spans(claimed.rollout_id))
        assert [(s.sequence_id, s.name) for s in spans] == [
            (1, "openai.chat.completion"), (1, "raw_gen_ai_request"), (2, "openai.chat.completion"), (2, "raw_gen_ai_request"),
        ]
        prompt = "<|user|> What is 3 + 4? <|assistant|>"
        # Both of Agent-Lightning's adapters read the same calls: TracerTraceToTriplet the calls' spans,
        # LlmProxyTraceToTriplet (its RL examples' adapter) their raw_gen_ai_request children.
        for adapter in (agl.TracerTraceToTriplet(), agl.LlmProxyTraceToTriplet()):
            triplets = adapter.adapt(spans)
            assert [t.prompt["token_ids"] for t in triplets] == [tokenize(prompt)] * 2, adapter
            assert [t.response["token_ids"] for t in triplets] == [tokenize(reply(prompt))] * 2, adapter
        await store.close()

    asyncio.run(go())
