"""A quickstart-like run written through the store API, for the analysis, cookbook and CLI tests.

Two runs share one database: ``quickstart`` (two epochs of train + val samples, resources versions 1 and
2, two workers, LLM-call spans with old- and new-style ``gen_ai`` token attributes, reward spans with
one or two dimensions, agent failures recorded in attempt metadata, retries that succeed on another
worker, rollouts that fail for good, one still running, one still queued) and ``quickstart-b`` (a
smaller comparison run).  Time comes from the injected fake clock, so durations are exact.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_sql import (
    OtelResource,
    PromptTemplate,
    RolloutConfig,
    Span,
    SpanContext,
    SqlLightningStore,
    TraceStatus,
)

MAIN_RUN = "quickstart"
OTHER_RUN = "quickstart-b"
WORKERS = ("Worker-0", "Worker-1")


def make_span(
    rollout_id: str,
    attempt_id: str,
    sequence_id: int,
    name: str,
    start: float,
    end: float,
    attributes: dict[str, Any],
    *,
    trace_id: str,
    parent_id: str | None = None,
) -> Span:
    span_id = secrets.token_hex(8)
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=name,
        status=TraceStatus(status_code="OK"),
        attributes=attributes,
        events=[],
        links=[],
        start_time=start,
        end_time=end,
        context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
        parent=None,
        resource=OtelResource(attributes={"service.name": "quickstart"}, schema_url=""),
    )


@dataclass
class RunFacts:
    """What the dataset wrote for one run, to check query results against."""

    name: str
    rollouts: int = 0
    succeeded: int = 0
    failed: int = 0
    spans: int = 0
    llm_calls: int = 0
    rewards: int = 0  # reward dimensions
    retried: int = 0
    final_rewards: dict[str, float] = field(default_factory=dict)
    llm_latency: dict[str, float] = field(default_factory=dict)  # span_id -> seconds
    error_types: dict[str, str] = field(default_factory=dict)  # attempt_id -> type
    rollout_ids: list[str] = field(default_factory=list)
    span_ids: dict[str, list[str]] = field(default_factory=dict)  # rollout_id -> span ids


async def _run_attempt(
    store: SqlLightningStore,
    clock: Any,
    facts: RunFacts,
    rollout: Any,
    attempt_id: str,
    index: int,
    *,
    reward: float | None,
    second_dimension: bool,
    new_token_names: bool,
) -> None:
    rid = rollout.rollout_id
    trace_id = secrets.token_hex(16)
    t0 = clock()
    seq = 1
    root = make_span(rid, attempt_id, seq, "agent.run", t0, t0 + 3.0, {"agent.name": "calculator"}, trace_id=trace_id)
    spans = [root]
    latency = 0.5 + (index % 7) * 0.25
    prompt_key, completion_key = (
        ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens")
        if new_token_names
        else ("gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens")
    )
    llm = make_span(
        rid,
        attempt_id,
        seq + 1,
        "openai.chat.completion",
        t0 + 0.1,
        t0 + 0.1 + latency,
        {
            "gen_ai.system": "openai",
            "gen_ai.request.model": "fake-calculator-1",
            "gen_ai.response.model": "fake-calculator-1-0613" if index % 2 else "fake-calculator-1",
            prompt_key: 40 + index,
            completion_key: 5 + index % 3,
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": f"What is {index} + {index}?",
            "gen_ai.completion.0.content": str(2 * index),
        },
        trace_id=trace_id,
        parent_id=root.span_id,
    )
    spans.append(llm)
    facts.llm_calls += 1
    facts.llm_latency[llm.span_id] = latency
    tool = make_span(
        rid, attempt_id, seq + 2, "tool.calculator", t0 + 1.0, t0 + 1.2, {"tool.name": "add"},
        trace_id=trace_id, parent_id=llm.span_id,
    )
    spans.append(tool)
    if reward is not None:
        # An early, superseded reward, then the final one: the view must pick the last.
        early = make_span(
            rid, attempt_id, seq + 3, "agentlightning.annotation", t0 + 1.5, t0 + 1.5,
            {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.0},
            trace_id=trace_id, parent_id=root.span_id,
        )
        attrs: dict[str, Any] = {
            "agentlightning.reward.0.name": "primary",
            "agentlightning.reward.0.value": reward,
        }
        if second_dimension:
            attrs["agentlightning.reward.1.name"] = "brevity"
            attrs["agentlightning.reward.1.value"] = 0.5
        final = make_span(
            rid, attempt_id, seq + 4, "agentlightning.annotation", t0 + 2.0, t0 + 2.0, attrs,
            trace_id=trace_id, parent_id=root.span_id,
        )
        # A tag annotation without a reward after it: not a reward span for the final reward.
        tag = make_span(
            rid, attempt_id, seq + 5, "agentlightning.annotation", t0 + 2.5, t0 + 2.5, {"agentlightning.tag.0": "done"},
            trace_id=trace_id, parent_id=root.span_id,
        )
        spans += [early, final, tag]
        facts.rewards += 2 + (1 if second_dimension else 0)
    await store.add_many_spans(spans)
    facts.spans += len(spans)
    facts.span_ids.setdefault(rid, []).extend(s.span_id for s in spans)


async def populate_run(
    store: SqlLightningStore,
    clock: Any,
    *,
    name: str,
    n_samples: int,
    epochs: int,
    reward_of: Callable[[int, int], float],
) -> RunFacts:
    """Write one quickstart-like run through ``store`` (bound to ``name``)."""
    facts = RunFacts(name)
    await store.add_resources({"prompt": PromptTemplate(template="Solve: {question}", engine="f-string")})
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    for epoch in range(epochs):
        if epoch > 0:
            latest = await store.get_latest_resources()
            assert latest is not None
            await store.update_resources(
                latest.resources_id,
                {"prompt": PromptTemplate(template="Think step by step. {question}", engine="f-string")},
            )
        for index in range(n_samples):
            mode = "val" if index % 4 == 3 else "train"
            key = f"{epoch}:{mode}:{index}"
            await store.enqueue_rollout(
                {"question": f"{index} + {index}"}, mode=mode, config=config,
                metadata={"baseline_sample": key}, idempotency_key=key,
            )
            facts.rollouts += 1
        claims = 0
        while True:
            worker = WORKERS[claims % len(WORKERS)]
            claims += 1
            claimed = await store.dequeue_rollout(worker_id=worker)
            if claimed is None:
                break
            clock.advance(1.0)
            index = int(str((claimed.metadata or {})["baseline_sample"]).split(":")[2])
            attempt = claimed.attempt
            if attempt.sequence_id == 1:
                facts.rollout_ids.append(claimed.rollout_id)
            fails_always = index % 9 == 7
            if fails_always or (index % 5 == 1 and attempt.sequence_id == 1):
                await _run_attempt(store, clock, facts, claimed, attempt.attempt_id, index, reward=None,
                                   second_dimension=False, new_token_names=False)
                clock.advance(1.5)
                error_type = "ZeroDivisionError" if fails_always else "TimeoutError"
                await store.update_attempt(
                    claimed.rollout_id, attempt.attempt_id, status="failed",
                    metadata={"error": {"type": error_type, "message": f"sample {index} broke", "traceback": ""}},
                )
                facts.error_types[attempt.attempt_id] = error_type
                if attempt.sequence_id == 1:
                    facts.retried += 1  # max_attempts=2, retry on failed: requeued
                else:
                    facts.failed += 1
                continue
            reward = reward_of(epoch, index)
            await _run_attempt(store, clock, facts, claimed, attempt.attempt_id, index, reward=reward,
                               second_dimension=index % 3 == 0, new_token_names=index % 2 == 1)
            clock.advance(2.0)
            await store.update_attempt(claimed.rollout_id, attempt.attempt_id, status="succeeded")
            facts.succeeded += 1
            facts.final_rewards[claimed.rollout_id] = reward
    return facts


async def populate(open_store: Callable[..., SqlLightningStore], clock: Any) -> dict[str, RunFacts]:
    """Both runs, plus one rollout left running and one left queued in the main run."""
    main = open_store(run=MAIN_RUN)
    facts = {
        MAIN_RUN: await populate_run(
            main, clock, name=MAIN_RUN, n_samples=12, epochs=2,
            reward_of=lambda epoch, index: round(0.3 + 0.4 * epoch + 0.02 * (index % 5), 4),
        )
    }
    # In flight at the end of the "quickstart": one running, one queued.
    await main.enqueue_rollout({"question": "running"}, mode="train", idempotency_key="2:train:0")
    await main.enqueue_rollout({"question": "queued"}, mode="train", idempotency_key="2:train:1")
    running = await main.dequeue_rollout(worker_id=WORKERS[0])
    assert running is not None
    await main.update_worker(WORKERS[0], heartbeat_stats={"cpu": 0.5})
    facts[MAIN_RUN].rollouts += 2
    other = open_store(run=OTHER_RUN)
    facts[OTHER_RUN] = await populate_run(
        other, clock, name=OTHER_RUN, n_samples=6, epochs=1,
        reward_of=lambda epoch, index: round(0.1 + 0.05 * index, 4),
    )
    return facts
