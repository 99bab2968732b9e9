"""Child-process entry points for the bridge's pickling tests (importable by spawned children)."""

from __future__ import annotations

import asyncio
from typing import Any


def run_one_rollout(store: Any, worker_id: str, result_path: str) -> None:
    """Claim one rollout through the (unpickled) bridge, add a span, report success; record what was seen."""

    async def go() -> str:
        import agentlightning as agl

        claimed = await store.dequeue_rollout(worker_id=worker_id)
        assert type(claimed) is agl.AttemptedRollout, type(claimed)
        span = agl.Span.from_attributes(
            attributes={"child": worker_id},
            rollout_id=claimed.rollout_id,
            attempt_id=claimed.attempt.attempt_id,
            sequence_id=await store.get_next_span_sequence_id(claimed.rollout_id, claimed.attempt.attempt_id),
            name="child-span",
        )
        await store.add_span(span)
        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        return claimed.rollout_id

    rollout_id = asyncio.run(go())
    with open(result_path, "w") as fh:
        fh.write(rollout_id)
