"""Agents used by the runtime tests; module-level so spawned runner processes can import them."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from opentelemetry import trace

from lightning_sql import LitAgent, PromptTemplate, emit_reward, rollout
from lightning_sql.types import Rollout

_tracer = trace.get_tracer("tests.runtime")


def _llm_span(task: Any, prompt: str) -> str:
    with _tracer.start_as_current_span("openai.chat.completion") as span:
        span.set_attribute("gen_ai.prompt.0.role", "user")
        span.set_attribute("gen_ai.prompt.0.content", prompt)
        answer = str(task["x"] * 2)
        span.set_attribute("gen_ai.completion.0.role", "assistant")
        span.set_attribute("gen_ai.completion.0.content", answer)
        span.set_attribute("agent.pid", os.getpid())
    return answer


@rollout
def sync_agent(task: dict[str, Any], prompt_template: PromptTemplate) -> float:
    """Sync: one LLM span, returns the reward as a number."""
    answer = _llm_span(task, prompt_template.format(x=task["x"]))
    return 1.0 if answer == str(task["x"] * 2) else 0.0


@rollout
async def async_agent(task: dict[str, Any], prompt_template: PromptTemplate, rollout: Rollout) -> None:
    """Async: one LLM span and a reward span through emit_reward."""
    await asyncio.sleep(float(task.get("sleep", 0.0)))
    _llm_span(task, prompt_template.format(x=task["x"]))
    emit_reward(0.5)


class FlakyAgent(LitAgent[dict[str, Any]]):
    """Fails the first attempt of every rollout, succeeds on the retry."""

    def rollout(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> float:
        attempt = rollout.attempt.sequence_id  # type: ignore[attr-defined]
        if attempt == 1:
            raise RuntimeError(f"flaky failure on {task['x']}\x00 with a NUL")
        return 1.0


class AlwaysFails(LitAgent[dict[str, Any]]):
    async def rollout_async(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> None:
        raise ValueError("boom " + "x" * 50_000)


class SlowAgent(LitAgent[dict[str, Any]]):
    """Sleeps ``SLOW_AGENT_SECONDS`` (default 0.2) and returns a reward: for kill-and-resume tests."""

    async def rollout_async(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> float:
        await asyncio.sleep(float(os.environ.get("SLOW_AGENT_SECONDS", "0.2")))
        return 1.0


class ManySpansAgent(LitAgent[dict[str, Any]]):
    """Emits ``task['n']`` spans, yielding between them so concurrent agents interleave."""

    async def rollout_async(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> None:
        with _tracer.start_as_current_span("agent.root", attributes={"rollout": rollout.rollout_id}):
            for i in range(task["n"]):
                with _tracer.start_as_current_span(f"step-{i}", attributes={"i": i, "rollout": rollout.rollout_id}):
                    if i % 7 == 0:
                        await asyncio.sleep(0)
                if i % 50 == 0:
                    await asyncio.sleep(0.001)
        emit_reward(1.0)


slow_agent = SlowAgent()
many_spans_agent = ManySpansAgent()


