"""The OtelTracer under concurrency: no span lost, none mixed between attempts, order kept."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from opentelemetry import trace

from lightning_sql import AGL_ANNOTATION, Baseline, OtelTracer, Trainer, emit_reward
from lightning_sql.runtime import tracer as tracer_module
from tests.runtime import agents

N_AGENTS = 8
SPANS_PER_ROLLOUT = int(os.environ.get("LIGHTNING_SQL_TEST_TRACER_SPANS", "300"))  # > FLUSH_BATCH_SIZE


def test_eight_concurrent_agents_lose_no_span(mp_backend: Any) -> None:
    assert SPANS_PER_ROLLOUT > tracer_module.FLUSH_BATCH_SIZE  # exercises size-triggered flushes too
    store = mp_backend.open(run="tracer-8")
    try:
        trainer = Trainer(
            store=store,
            n_runners=N_AGENTS,
            algorithm=Baseline(max_queue_length=N_AGENTS, polling_interval=0.5, span_verbosity="none"),
            runner={"type": "agent", "poll_interval": 0.5, "heartbeat_interval": 0.5},
        )
        trainer.fit(agents.many_spans_agent, [{"n": SPANS_PER_ROLLOUT} for _ in range(2 * N_AGENTS)])

        async def check() -> None:
            rollouts = list(await store.query_rollouts())
            assert len(rollouts) == 2 * N_AGENTS and {r.status for r in rollouts} == {"succeeded"}
            workers = {r.attempt.worker_id for r in rollouts}  # type: ignore[union-attr]
            assert len(workers) > 1  # they did run concurrently
            for r in rollouts:
                spans = list(await store.query_spans(r.rollout_id))
                steps = [s for s in spans if s.name.startswith("step-")]
                assert len(spans) == SPANS_PER_ROLLOUT + 2  # steps + root + reward
                # nothing of another attempt
                assert {s.attributes.get("rollout", r.rollout_id) for s in spans} == {r.rollout_id}
                # sequence ids follow end order: steps in order, then the root, then the reward
                assert [s.attributes["i"] for s in steps] == list(range(SPANS_PER_ROLLOUT))
                assert [s.sequence_id for s in spans] == list(range(1, SPANS_PER_ROLLOUT + 3))
                assert spans[-2].name == "agent.root" and spans[-1].name == AGL_ANNOTATION
                root = spans[-2]
                assert {s.parent_id for s in steps} == {root.span_id}

        asyncio.run(check())
    finally:
        asyncio.run(store.close())


async def test_spans_outside_a_context_are_not_stored_and_provider_is_shared(store_factory: Any) -> None:
    store = store_factory(run="tracer-routing")
    a, b = OtelTracer(), OtelTracer()
    a.init()
    b.init()
    provider = trace.get_tracer_provider()
    assert tracer_module._PROCESSOR is not None
    processors = provider._active_span_processor._span_processors  # type: ignore[attr-defined]
    assert sum(p is tracer_module._PROCESSOR for p in processors) == 1  # added once per process
    r1 = await store.start_rollout({"x": 1})
    r2 = await store.start_rollout({"x": 2})
    a.init_worker(0, store)
    b.init_worker(1, store)
    otel = trace.get_tracer("t")
    with otel.start_as_current_span("outside"):
        pass

    async def traced(tracer: OtelTracer, r: Any, label: str) -> list[str]:
        async with tracer.trace_context(name=label, rollout_id=r.rollout_id, attempt_id=r.attempt.attempt_id):
            for i in range(5):
                with otel.start_as_current_span(f"{label}-{i}"):
                    await asyncio.sleep(0)
            await asyncio.to_thread(lambda: otel.start_span(f"{label}-thread").end())
            emit_reward(2.0)
        return [s.name for s in tracer.get_last_trace()]

    names_a, names_b = await asyncio.gather(traced(a, r1, "a"), traced(b, r2, "b"))
    assert names_a == [f"a-{i}" for i in range(5)] + ["a-thread", AGL_ANNOTATION]
    assert names_b == [f"b-{i}" for i in range(5)] + ["b-thread", AGL_ANNOTATION]
    stored_a = [s.name for s in await store.query_spans(r1.rollout_id)]
    stored_b = [s.name for s in await store.query_spans(r2.rollout_id)]
    assert stored_a == names_a and stored_b == names_b  # stored before trace_context returned
    assert (await store.statistics())["total_spans"] == 14  # "outside" was not stored
