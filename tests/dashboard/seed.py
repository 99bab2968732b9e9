"""A small store with known numbers for the dashboard tests, written through the public store API.

Run ``demo``: resources ``main`` v1 then v2 (two prompt templates); 4 train rollouts under v1 with
final rewards 0.0, 0.5, 1.0, 0.5 (mean 0.5); 2 val rollouts under v2 with rewards 1.0, 0.8 (mean
0.9); one train rollout under v2 failed by ``ValueError``; one still queuing.  The first rollout
carries an agent span, an LLM call (messages and token ids) and its reward span.  Run ``HOSTILE``
has hostile text everywhere a user's string is stored.
"""

from __future__ import annotations

import secrets
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
from tests.helpers import FakeClock

HOSTILE = '<script>window.__pwned=1</script> [/] \u202eevil\u202c עברית \x1b[31mred\x1b[0m & "q"'
DEMO_RUN = "demo"
TEMPLATE_V1 = "You are helpful.\nAnswer: {question}"
TEMPLATE_V2 = "You are very helpful.\nAnswer briefly: {question}"
TRAIN_REWARDS = (0.0, 0.5, 1.0, 0.5)
VAL_REWARDS = (1.0, 0.8)
PROMPT_TOKEN_IDS = [101, 2023, 2003]
RESPONSE_TOKEN_IDS = [4242, 102]


@dataclass
class Seeded:
    url: str
    schema: str | None
    demo_rollouts: list[str] = field(default_factory=list)
    failed_rollout: str = ""
    queued_rollout: str = ""
    llm_rollout: str = ""
    hostile_rollout: str = ""
    resources_id: str = ""


def span(rollout_id: str, attempt_id: str, seq: int, name: str, start: float, end: float, *,
         parent: str | None = None, trace_id: str | None = None, attributes: dict[str, Any] | None = None,
         span_id: str | None = None) -> Span:
    trace_id = trace_id or secrets.token_hex(16)
    span_id = span_id or secrets.token_hex(8)
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=seq,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent,
        name=name,
        status=TraceStatus(status_code="OK"),
        attributes=attributes or {},
        events=[],
        links=[],
        start_time=start,
        end_time=end,
        context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
        parent=None,
        resource=OtelResource(attributes={"service.name": "seed"}, schema_url=""),
    )


def reward_span(rollout_id: str, attempt_id: str, seq: int, value: float, t: float, **kw: Any) -> Span:
    return span(rollout_id, attempt_id, seq, "agentlightning.annotation", t, t + 0.01,
                attributes={"agentlightning.reward.0.value": value, "agentlightning.reward.0.name": "accuracy"}, **kw)


async def _finish(store: SqlLightningStore, clock: FakeClock, worker: str, reward: float | None,
                  *, llm: bool = False) -> str:
    claimed = await store.dequeue_rollout(worker_id=worker)
    assert claimed is not None
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    t = clock.advance(1.0)
    if llm:
        trace = secrets.token_hex(16)
        root = secrets.token_hex(8)
        await store.add_span(span(rid, aid, 1, "agent.run", t, t + 2.0, trace_id=trace, span_id=root))
        await store.add_span(span(rid, aid, 2, "openai.chat.completion", t + 0.2, t + 1.2, trace_id=trace, parent=root, attributes={
            "gen_ai.system": "openai",
            "gen_ai.request.model": "demo-model",
            "gen_ai.prompt.0.role": "system",
            "gen_ai.prompt.0.content": "You are helpful.",
            "gen_ai.prompt.1.role": "user",
            "gen_ai.prompt.1.content": "What is 2+2?",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": "4",
            "gen_ai.usage.prompt_tokens": 3,
            "gen_ai.usage.completion_tokens": 2,
            "prompt_token_ids": PROMPT_TOKEN_IDS,
            "response_token_ids": RESPONSE_TOKEN_IDS,
        }))
        assert reward is not None
        await store.add_span(reward_span(rid, aid, 3, reward, t + 1.5, trace_id=trace, parent=root))
    elif reward is not None:
        await store.add_span(reward_span(rid, aid, 1, reward, t))
    clock.advance(1.0)
    await store.update_attempt(rid, aid, status="succeeded")
    return rid


async def seed(url: str, schema: str | None, clock: FakeClock) -> Seeded:
    opts: dict[str, Any] = {"clock": clock, "clock_sync": False}
    if schema is not None:
        opts["schema"] = schema
    out = Seeded(url, schema)
    store = SqlLightningStore(url, run=DEMO_RUN, **opts)
    try:
        v1 = await store.add_resources({"main": PromptTemplate(template=TEMPLATE_V1, engine="f-string")})
        out.resources_id = v1.resources_id
        train = [await store.enqueue_rollout(input={"question": f"q{i}"}, mode="train") for i in range(4)]
        for i, reward in enumerate(TRAIN_REWARDS):
            rid = await _finish(store, clock, "worker-1", reward, llm=i == 0)
            assert rid == train[i].rollout_id
            out.demo_rollouts.append(rid)
        out.llm_rollout = train[0].rollout_id
        clock.advance(5.0)
        await store.update_resources(v1.resources_id, {"main": PromptTemplate(template=TEMPLATE_V2, engine="f-string")})
        for reward in VAL_REWARDS:
            await store.enqueue_rollout(input={"question": "v"}, mode="val")
            out.demo_rollouts.append(await _finish(store, clock, "worker-2", reward))
        failing = await store.enqueue_rollout(input={"question": "boom"}, mode="train",
                                              config=RolloutConfig(max_attempts=1))
        claimed = await store.dequeue_rollout(worker_id="worker-2")
        assert claimed is not None and claimed.rollout_id == failing.rollout_id
        clock.advance(1.0)
        await store.update_attempt(failing.rollout_id, claimed.attempt.attempt_id, status="failed", metadata={
            "error": {"type": "ValueError", "message": "bad input: boom", "traceback": "Traceback...\nValueError: bad input"}
        })
        out.failed_rollout = failing.rollout_id
        clock.advance(1.0)
        queued = await store.enqueue_rollout(input={"question": "later"}, mode="train")
        out.queued_rollout = queued.rollout_id
    finally:
        await store.close()

    hostile = SqlLightningStore(url, run=HOSTILE, **opts)
    try:
        await hostile.add_resources({HOSTILE: PromptTemplate(template=HOSTILE + "\nline 2", engine="f-string")})
        ro = await hostile.enqueue_rollout(input={"question": HOSTILE}, mode="train")
        claimed = await hostile.dequeue_rollout(worker_id=HOSTILE)
        assert claimed is not None
        t = clock.advance(1.0)
        await hostile.add_span(span(ro.rollout_id, claimed.attempt.attempt_id, 1, HOSTILE, t, t + 1,
                                    attributes={HOSTILE: HOSTILE}))
        await hostile.update_attempt(ro.rollout_id, claimed.attempt.attempt_id, status="failed", metadata={
            "error": {"type": HOSTILE, "message": HOSTILE, "traceback": HOSTILE}
        })
        out.hostile_rollout = ro.rollout_id
    finally:
        await hostile.close()
    return out
