"""`lightning-sql cancel` (docs/queue.md)."""

from __future__ import annotations

import asyncio

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
