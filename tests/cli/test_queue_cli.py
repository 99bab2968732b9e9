"""`lightning-sql cancel` (docs/queue.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from lightning_sql import SqlLightningStore
from tests.analysis.fixtures import Populated
from tests.cli.runner import invoke, ok, with_store


def test_cancel_one_rollout_then_the_whole_run(fresh: Populated) -> None:
    async def enqueue(store: SqlLightningStore) -> list[str]:
        return [(await store.enqueue_rollout({"i": i})).rollout_id for i in range(4)]

    ids = asyncio.run(with_store(fresh, "work", enqueue))
    args = ["--run", "work", *fresh.cli_args()]
    assert ok(["cancel", ids[0], *args]) == {"run": "work", "rollouts": {ids[0]: "cancelled"}}
    human = invoke(["cancel", "--all", *args])
    assert human.exit_code == 0 and "Cancelled 3 rollout(s) of work." in human.stdout, human.output
    assert {r["status"] for r in ok(["rollouts", *args])} == {"cancelled"}
    assert ok(["cancel", "--all", *args])["cancelled"] == 0
    refused = invoke(["cancel", ids[1], "--all", *args])
    assert refused.exit_code != 0 and "not both" in refused.output
    unknown = invoke(["cancel", "ro-missing", *args])
    assert unknown.exit_code != 0 and "not found" in unknown.output


def test_pause_drain_and_resume(fresh: Populated) -> None:
    async def claim_one(store: SqlLightningStore) -> str:
        await store.enqueue_many_rollouts([{"input": i} for i in range(3)])
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None
        return claimed.rollout_id

    rid = asyncio.run(with_store(fresh, "cycle", claim_one))
    args = ["--run", "cycle", *fresh.cli_args()]
    undrained = invoke(["pause", "--drain", "0.2", *args, "--json"])
    assert undrained.exit_code == 1 and '"drained": false' in undrained.stdout, undrained.output

    async def while_paused(store: SqlLightningStore) -> Any:
        nothing = await store.dequeue_rollout()
        await store.update_attempt(rid, "latest", status="succeeded")
        return nothing

    assert asyncio.run(with_store(fresh, "cycle", while_paused)) is None
    assert ok(["pause", "--drain", "5", *args]) == {"run": "cycle", "paused": True, "drained": True}
    human = invoke(["resume", *args])
    assert human.exit_code == 0 and "Run cycle is running." in human.stdout, human.output

    async def after(store: SqlLightningStore) -> Any:
        return await store.dequeue_rollout()

    assert asyncio.run(with_store(fresh, "cycle", after)) is not None
