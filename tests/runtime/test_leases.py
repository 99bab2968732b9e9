"""Runner heartbeats: the lease is refreshed with touch_attempt, and a lost lease is abandoned."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lightning_sql import Hook, LitAgent, LitAgentRunner, RolloutConfig


class BlockingAgent(LitAgent[Any]):
    """The first attempt blocks until cancelled; later attempts succeed at once."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.cancelled = 0

    async def rollout_async(self, task: Any, resources: Any, rollout: Any) -> float:
        if rollout.attempt.sequence_id == 1:
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return 1.0


class EndHook(Hook):
    def __init__(self) -> None:
        self.ended: list[str] = []

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None:
        self.ended.append(rollout.attempt.attempt_id)


@pytest.mark.parametrize("mode", ["thread", "asyncio"])
async def test_lost_lease_is_abandoned_and_the_retry_runs(store_factory: Any, clock: Any, mode: str) -> None:
    store = store_factory()
    config = RolloutConfig(unresponsive_seconds=30, max_attempts=2, retry_condition=["unresponsive"])
    rollout = await store.enqueue_rollout({"x": 1}, config=config)
    agent, hook = BlockingAgent(), EndHook()
    runner: LitAgentRunner[Any] = LitAgentRunner(
        max_rollouts=2, poll_interval=0.2, heartbeat_interval=0.1, interval_jitter=0.0, heartbeat_launch_mode=mode  # type: ignore[arg-type]
    )
    runner.init(agent, hooks=[hook])
    runner.init_worker(0, store)
    task = asyncio.ensure_future(runner.iter())
    await asyncio.wait_for(agent.started.wait(), 30)

    # While the agent is busy (no spans), heartbeats keep the lease fresh with the store clock.
    first = await store.get_latest_attempt(rollout.rollout_id)
    clock.advance(20)
    for _ in range(100):
        touched = await store.get_latest_attempt(rollout.rollout_id)
        if touched.last_heartbeat_time == clock():
            break
        await asyncio.sleep(0.05)
    assert touched.last_heartbeat_time == clock()
    assert await store.sweep() == 0  # 20 s without spans, yet alive
    worker = await store.get_worker_by_id("Worker-0")
    assert worker.heartbeat_stats["pid"] > 0 and "memory_percent" in worker.heartbeat_stats

    # Let the lease expire: a sweep right after the clock jumps sees the last heartbeat 31 s old.
    clock.advance(31)
    hits = await store.sweep()
    if hits == 0:  # a heartbeat slipped in between: expire again
        clock.advance(31)
        hits = await store.sweep()
    assert hits == 1
    await asyncio.wait_for(task, 30)

    attempts = list(await store.query_attempts(rollout.rollout_id))
    assert [a.status for a in attempts] == ["unresponsive", "succeeded"]
    assert attempts[0].attempt_id == first.attempt_id
    assert agent.cancelled == 1  # the agent was stopped, not left running
    assert hook.ended == [a.attempt_id for a in attempts]  # on_rollout_end fired for the abandoned attempt too
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "succeeded"


async def test_stopping_mid_attempt_hands_the_rollout_back(store_factory: Any) -> None:
    store = store_factory()
    config = RolloutConfig(unresponsive_seconds=30, max_attempts=2, retry_condition=["unresponsive"])
    rollout = await store.enqueue_rollout({"x": 1}, config=config)
    agent, hook = BlockingAgent(), EndHook()
    runner: LitAgentRunner[Any] = LitAgentRunner(poll_interval=0.2, heartbeat_interval=0)
    runner.init(agent, hooks=[hook])
    runner.init_worker(0, store)
    task = asyncio.ensure_future(runner.iter())
    await asyncio.wait_for(agent.started.wait(), 30)
    task.cancel()  # e.g. Ctrl-C, or the strategy's grace period ran out
    with pytest.raises(asyncio.CancelledError):
        await task
    attempt = await store.get_latest_attempt(rollout.rollout_id)
    assert attempt.status == "unresponsive" and attempt.metadata["error"]["type"] == "asyncio.CancelledError"
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "requeuing"  # claimable again now
    assert agent.cancelled == 1 and hook.ended == [attempt.attempt_id]
