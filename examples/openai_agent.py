"""The quickstart's loop with a real OpenAI-compatible endpoint.

    export OPENAI_BASE_URL=https://api.openai.com/v1   # or any compatible server (vLLM, Ollama, ...)
    export OPENAI_API_KEY=sk-...
    python examples/openai_agent.py [--model gpt-4o-mini] [--url sqlite:///openai_agent.db] [--fresh]

Each chat completion is an OpenTelemetry span named ``openai.chat.completion`` carrying the GenAI
attributes (``gen_ai.prompt.*``, ``gen_ai.completion.*``, ``gen_ai.usage.*``), so the LLM calls land
in the store next to the reward.  When OpenLLMetry's ``opentelemetry-instrumentation-openai`` is
installed, its spans are stored too: any OpenTelemetry instrumentation active inside a rollout
reaches the store, because lightning_sql's span processor sits on the process's TracerProvider.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from opentelemetry import trace
from rich.console import Console

from lightning_sql import LLM, Baseline, SqlLightningStore, Trainer, emit_reward, rollout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import make_dataset  # noqa: E402  (same arithmetic task)

console = Console()
tracer = trace.get_tracer("openai_agent")


def _instrument() -> None:
    try:
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor  # type: ignore[import-not-found]
    except ImportError:
        return
    OpenAIInstrumentor().instrument()


@rollout
async def openai_agent(task: dict[str, Any], llm: LLM) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key=llm.api_key or os.environ.get("OPENAI_API_KEY"))
    messages = [
        {"role": "system", "content": "You are a calculator. Answer with the number only."},
        {"role": "user", "content": f"What is {task['question']}?"},
    ]
    with tracer.start_as_current_span("openai.chat.completion") as span:
        span.set_attribute("gen_ai.system", "openai")
        span.set_attribute("gen_ai.request.model", llm.model)
        for i, message in enumerate(messages):
            span.set_attribute(f"gen_ai.prompt.{i}.role", message["role"])
            span.set_attribute(f"gen_ai.prompt.{i}.content", message["content"])
        response = await client.chat.completions.create(
            model=llm.model, messages=messages, **llm.sampling_parameters  # type: ignore[arg-type]
        )
        answer = response.choices[0].message.content or ""
        span.set_attribute("gen_ai.response.id", response.id)
        span.set_attribute("gen_ai.response.model", response.model)
        span.set_attribute("gen_ai.completion.0.role", "assistant")
        span.set_attribute("gen_ai.completion.0.content", answer)
        if response.usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", response.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", response.usage.completion_tokens)
    await client.close()
    emit_reward(1.0 if answer.strip().rstrip(".") == str(task["answer"]) else 0.0)


def main(argv: list[str] | None = None) -> SqlLightningStore:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="sqlite:///openai_agent.db")
    parser.add_argument("--run", default="openai-agent")
    parser.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    parser.add_argument("--train", type=int, default=8)
    parser.add_argument("--val", type=int, default=4)
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args(argv)
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        parser.error("set OPENAI_BASE_URL and OPENAI_API_KEY")
    logging.basicConfig(level=logging.WARNING)
    _instrument()

    store = SqlLightningStore(args.url, run=args.run)
    if args.fresh:
        asyncio.run(store.delete_run(args.run))
    trainer = Trainer(
        store=store,
        n_runners=args.runners,
        algorithm=Baseline(polling_interval=1.0, span_verbosity="none"),
        runner={"type": "agent", "poll_interval": 1.0},
        initial_resources={"llm": LLM(endpoint=base_url, model=args.model, sampling_parameters={"temperature": 0})},
    )
    trainer.fit(openai_agent, make_dataset(args.train, 11), make_dataset(args.val, 12))

    async def report() -> None:
        rollouts = list(await store.query_rollouts())
        rewards = []
        for r in rollouts:
            spans = await store.query_spans(r.rollout_id, attempt_id="latest", name="agentlightning.annotation")
            rewards += [s.attributes["agentlightning.reward.0.value"] for s in spans]
        console.print(
            f"{len(rollouts)} rollouts, statuses {sorted({r.status for r in rollouts})}, "
            f"mean reward {sum(rewards) / max(len(rewards), 1):.3f}, "  # type: ignore[arg-type]
            f"{(await store.statistics())['total_spans']} spans stored in {store.url} (run {args.run})"
        )

    asyncio.run(report())
    return store


if __name__ == "__main__":
    main()
