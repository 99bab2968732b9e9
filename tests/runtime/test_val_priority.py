"""``Baseline(val_priority=...)`` puts validation ahead of training (docs/queue.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_sql import Baseline, SqlLightningStore, Trainer, rollout


@rollout
def solver(task: dict[str, int], prompt_template: object) -> float:
    return 1.0


@pytest.mark.parametrize(("val_priority", "first"), [(5, "val"), (0, "train")])
def test_baseline_runs_validation_first_when_asked(tmp_path: Path, val_priority: int, first: str) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    trainer = Trainer(store=url, run="p", n_runners=1, strategy="shm",
                      algorithm=Baseline(n_epochs=1, polling_interval=0.1, span_verbosity="none", val_priority=val_priority))
    trainer.fit(solver, [{"t": i} for i in range(6)], [{"v": i} for i in range(3)])

    async def order() -> list[tuple[str, int]]:
        async with SqlLightningStore(url, run="p") as store:
            done = await store.query_rollouts()
            claimed = sorted(done.items, key=lambda r: r.attempt.start_time)  # type: ignore[union-attr]
            return [(r.mode, r.priority) for r in claimed]  # type: ignore[misc]

    import asyncio

    claimed = asyncio.run(order())
    assert len(claimed) == 9
    modes = [mode for mode, _p in claimed]
    assert modes[:3] == [first] * 3
    assert {p for mode, p in claimed if mode == "val"} == {val_priority}
    assert {p for mode, p in claimed if mode == "train"} == {0}
