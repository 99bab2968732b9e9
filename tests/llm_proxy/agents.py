"""An agent and an algorithm for the proxy's Trainer tests (module-level: runner processes import them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sql import LLM, Algorithm, rollout
from lightning_sql.types import Triplet


@rollout
async def adder(task: dict[str, Any], llm: LLM) -> float:
    """Asks the model for a sum through the official SDK (streamed or not); reward 1 when it is right."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
    if task.get("stream"):
        stream = await client.chat.completions.create(
            model=llm.model, messages=messages, stream=True, **llm.sampling_parameters  # type: ignore[arg-type]
        )
        answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    else:
        response = await client.chat.completions.create(
            model=llm.model, messages=messages, **llm.sampling_parameters  # type: ignore[arg-type]
        )
        answer = response.choices[0].message.content or ""
    await client.close()
    return 1.0 if answer.split()[-1] == str(task["a"] + task["b"]) else 0.0


class TripletCollector(Algorithm):
    """Points the runners at the proxy, runs every task once, and keeps each rollout's triplets."""

    def __init__(self) -> None:
        super().__init__()
        self.triplets: dict[str, list[Triplet]] = {}
        self.proxy_was_running = False

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        proxy = self.get_llm_proxy()
        assert proxy is not None, "the Trainer hands its llm_proxy to the algorithm"
        self.proxy_was_running = proxy.is_running()
        await store.update_resources("policy", {"llm": proxy.as_resource(sampling_parameters={"temperature": 0})})
        rollouts = [await store.enqueue_rollout(task, mode="train", resources_id="policy") for task in train_dataset or []]
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in rollouts], timeout=120)
        adapter = self.get_adapter()
        for rollout_ in finished:
            spans = await store.query_spans(rollout_.rollout_id, "latest")
            self.triplets[rollout_.rollout_id] = adapter.adapt(list(spans))
