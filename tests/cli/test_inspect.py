"""`show`, `spans`, `status`, `gc --dry-run` and plain output: what a user reads after a run.

Issue 34 items 4 (the stored traceback), 9 (plain untruncated text off a terminal), 10 (spans in
pages, `show --limit`, a readable dry run) and 11 (recent throughput of a young run).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lightning_sql import RolloutConfig, SqlLightningStore
from lightning_sql.analysis import AnalysisDatabase
from lightning_sql.cli import queries
from tests.analysis.dataset import make_span
from tests.analysis.fixtures import Populated
from tests.cli.runner import invoke, ok, with_store

N_SPANS = 25


async def _rollout_with_spans(store: SqlLightningStore) -> str:
    await store.enqueue_rollout({"q": 1})
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None
    await store.add_many_spans(
        [
            make_span(claimed.rollout_id, claimed.attempt.attempt_id, i + 1, f"step-{i:02d}", 100.0 + i, 100.5 + i, {"i": i},
                      trace_id="ab" * 16)
            for i in range(N_SPANS)
        ]
    )
    return claimed.rollout_id


def test_failed_attempt_shows_its_stored_traceback(fresh: Populated) -> None:
    async def enqueue(store: SqlLightningStore) -> None:
        await store.enqueue_rollout({"divisor": 0}, config=RolloutConfig(max_attempts=1))

    asyncio.run(with_store(fresh, "fails", enqueue))
    args = ["--run", "fails", *fresh.cli_args()]
    ok(["worker", "--agent", "tests.cli.agents:dividing_agent", "--max-rollouts", "1", *args])
    (rollout,) = ok(["rollouts", *args])
    assert rollout["status"] == "failed"

    shown = ok(["show", rollout["rollout_id"], *args])
    (attempt,) = shown["attempts"]
    assert attempt["error"]["type"].endswith("ZeroDivisionError")
    assert "_divide" in attempt["error"]["traceback"] and "1 / task" in attempt["error"]["traceback"]

    human = invoke(["show", rollout["rollout_id"], *args])
    assert human.exit_code == 0, human.output
    lines = human.stdout.splitlines()
    assert any("traceback" in line for line in lines)
    assert any("_divide" in line for line in lines)  # the frame where it failed
    assert any("return 1 / task[\"divisor\"]" in line for line in lines)


def test_show_limits_the_spans_per_attempt(fresh: Populated) -> None:
    rollout_id = asyncio.run(with_store(fresh, "many", _rollout_with_spans))
    args = ["--run", "many", *fresh.cli_args()]
    (attempt,) = ok(["show", rollout_id, "--limit", "10", *args])["attempts"]
    assert attempt["spans_shown"] == 10 and attempt["spans_total"] == N_SPANS
    assert [s["name"] for s in attempt["spans"]] == [f"step-{i:02d}" for i in range(10)]
    (everything,) = ok(["show", rollout_id, "--limit", "0", *args])["attempts"]
    assert everything["spans_shown"] == everything["spans_total"] == N_SPANS

    human = invoke(["show", rollout_id, "--limit", "10", *args])
    assert human.exit_code == 0, human.output
    assert "step-09" in human.stdout and "step-10" not in human.stdout
    assert f"{N_SPANS - 10} more span(s)" in human.stdout


def test_show_has_a_default_span_limit() -> None:
    from lightning_sql.cli.rollouts import show_command

    limit = next(p for p in show_command.params if p.name == "limit")
    assert limit.default == 100


def test_spans_are_read_page_by_page(fresh: Populated, monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(with_store(fresh, "paged", _rollout_with_spans))
    args = ["--run", "paged", *fresh.cli_args()]
    reads: list[Any] = []
    real_read = AnalysisDatabase.read

    def counting_read(self: AnalysisDatabase, unit: Any) -> Any:
        reads.append(unit)
        return real_read(self, unit)

    monkeypatch.setattr(AnalysisDatabase, "read", counting_read)
    monkeypatch.setattr(queries, "SPAN_PAGE_ROWS", 7)
    rows = ok(["spans", "--limit", "0", *args])
    assert [r["name"] for r in rows] == [f"step-{i:02d}" for i in range(N_SPANS)]  # once each, in order
    assert rows[0]["attributes"] == {"i": 0}
    assert len(reads) == 1 + 4  # the run's id, then ceil(25 / 7) pages

    reads.clear()
    assert [r["name"] for r in ok(["spans", "--limit", "10", *args])] == [f"step-{i:02d}" for i in range(10)]
    assert len(reads) == 1 + 2

    human = invoke(["spans", "--limit", "0", *args])
    assert human.exit_code == 0, human.output
    lines = human.stdout.splitlines()
    assert lines[0].split("\t") == list(queries.SPAN_TABLE_COLUMNS)  # one header, then every span
    assert [line.split("\t")[5] for line in lines[1:]] == [f"step-{i:02d}" for i in range(N_SPANS)]


def test_plain_output_is_untruncated(fresh: Populated) -> None:
    async def write(store: SqlLightningStore) -> None:
        await store.enqueue_rollout({"q": 1})

    asyncio.run(with_store(fresh, "narrow", write))
    result = invoke(["rollouts", "--run", "narrow", *fresh.cli_args()], env={"COLUMNS": "40"})
    assert result.exit_code == 0, result.output
    (rollout,) = ok(["rollouts", "--run", "narrow", *fresh.cli_args()])
    header, row = result.stdout.splitlines()
    assert header.split("\t")[0] == "rollout_id"
    assert row.split("\t")[:3] == [rollout["rollout_id"], "queuing", "-"]
    assert "…" not in result.stdout


def test_gc_dry_run_prints_a_sentence(fresh: Populated) -> None:
    asyncio.run(with_store(fresh, "old", _rollout_with_spans))
    args = fresh.cli_args()
    spans = invoke(["gc", "--spans-before", "110", "--run", "old", "--dry-run", *args])
    assert spans.exit_code == 0, spans.output
    assert spans.stdout.strip() == "Would delete 10 span(s) started before 110 in run 'old'. Nothing was deleted."
    run = invoke(["gc", "--delete-run", "old", "--dry-run", *args])
    assert run.exit_code == 0, run.output
    assert run.stdout.strip() == (
        "Would delete run 'old' and everything in it: 1 rollouts, 1 attempts, 25 spans, 1 workers. Nothing was deleted."
    )
    assert len(ok(["spans", "--run", "old", "--limit", "0", *args])) == N_SPANS


def test_recent_throughput_of_a_young_run_uses_its_age(fresh: Populated) -> None:
    created = fresh.clock()

    async def finish_five(store: SqlLightningStore) -> None:
        for _ in range(5):
            await store.enqueue_rollout({"q": 1})
            claimed = await store.dequeue_rollout(worker_id="w")
            assert claimed is not None
            fresh.clock.advance(1.0)
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")

    asyncio.run(with_store(fresh, "young", finish_five))
    args = ["--run", "young", *fresh.cli_args()]
    young = ok(["status", "--now", str(created + 10.0), *args])
    assert young["throughput_per_min_recent"] == pytest.approx(5 * 60.0 / 10.0)
    old = ok(["status", "--now", str(created + 1_000.0), *args])  # all five ended long before the window
    assert old["throughput_per_min_recent"] == 0
    mid = ok(["status", "--now", str(created + 200.0), *args])
    assert mid["throughput_per_min_recent"] == pytest.approx(5 * 60.0 / 200.0)


def test_show_gives_the_priority_and_the_back_off(fresh: Populated) -> None:
    """A rollout in back-off: `show` names its priority and when it can be claimed again."""
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"], retry_backoff_seconds=30.0)

    async def requeue(store: SqlLightningStore) -> str:
        rollout = await store.enqueue_rollout({"q": 1}, config=config, priority=4)
        await store.dequeue_rollout(worker_id="w")
        await store.update_attempt(rollout.rollout_id, "latest", status="failed")
        return rollout.rollout_id

    rollout_id = asyncio.run(with_store(fresh, "delayed", requeue))
    args = ["--run", "delayed", *fresh.cli_args()]
    shown = ok(["show", rollout_id, *args])
    assert shown["rollout"]["priority"] == 4
    assert shown["rollout"]["not_before"] == fresh.clock() + 30.0
    human = invoke(["show", rollout_id, *args])
    assert human.exit_code == 0, human.output
    assert "priority=4" in human.stdout and "not_before=2001-09-09T01:47:10.000+00:00" in human.stdout
