"""`lightning-sql` on SQLite and PostgreSQL through click's CliRunner, `--json` output parsed.

Read commands run against one populated database per module and backend (tests/analysis/dataset.py);
commands that write (db, sweep, gc, worker) get their own database.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import RolloutConfig, SqlLightningStore, cli
from lightning_sql.store.sql.migrate import HEAD_REVISION
from lightning_sql.store.sql.views import VIEW_NAMES
from tests.analysis.dataset import MAIN_RUN, OTHER_RUN, WORKERS
from tests.analysis.fixtures import Populated
from tests.cli.runner import as_json, invoke, ok

# --- reads on the populated database -------------------------------------------------------------


def test_runs(populated: Populated) -> None:
    rows = {row["name"]: row for row in ok(["runs", *populated.cli_args()])}
    assert set(rows) == {MAIN_RUN, OTHER_RUN}
    for name, facts in populated.facts.items():
        assert rows[name]["rollouts"] == facts.rollouts
        assert rows[name]["succeeded"] == facts.succeeded
        assert rows[name]["failed"] == facts.failed
        assert rows[name]["spans"] == facts.spans
    assert rows[MAIN_RUN]["queued"] == 1 and rows[MAIN_RUN]["running"] == 1


def test_runs_human_output(populated: Populated) -> None:
    result = invoke(["runs", *populated.cli_args()])
    assert result.exit_code == 0, result.output
    assert MAIN_RUN in result.stdout and OTHER_RUN in result.stdout


def test_status(populated: Populated) -> None:
    now = populated.clock() + 10.0
    snapshot = ok(["status", "--run", MAIN_RUN, "--now", str(now), *populated.cli_args()])
    facts = populated.facts[MAIN_RUN]
    assert snapshot["queue_depth"] == 1
    assert snapshot["running"] == 1
    assert snapshot["succeeded"] == facts.succeeded and snapshot["failed"] == facts.failed
    assert snapshot["throughput_per_min_overall"] > 0
    workers = {w["worker_id"]: w for w in snapshot["workers"]}
    assert set(workers) == set(WORKERS)
    assert workers[WORKERS[0]]["current_rollout_id"] is not None
    assert workers[WORKERS[0]]["heartbeat_age_seconds"] is not None and workers[WORKERS[0]]["heartbeat_age_seconds"] >= 0


def test_status_watch_emits_one_snapshot_per_refresh(populated: Populated) -> None:
    result = invoke(
        ["status", "--run", MAIN_RUN, "--watch", "--count", "3", "--interval", "0", "--json", *populated.cli_args()]
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    assert len(lines) == 3 and all(line["run"] == MAIN_RUN for line in lines)


def test_status_watch_human(populated: Populated) -> None:
    result = invoke(["status", "--run", MAIN_RUN, "--watch", "--count", "2", "--interval", "0", *populated.cli_args()])
    assert result.exit_code == 0, result.output
    assert "queue depth" in result.stdout


def test_rollouts_filter_sort_limit(populated: Populated) -> None:
    facts = populated.facts[MAIN_RUN]
    everything = ok(["rollouts", "--run", MAIN_RUN, "--limit", "0", *populated.cli_args()])
    assert len(everything) == facts.rollouts
    finals = {r["rollout_id"]: r["final_reward"] for r in everything if r["status"] == "succeeded"}
    assert finals == pytest.approx(facts.final_rewards)

    failed = ok(["rollouts", "--run", MAIN_RUN, "--status", "failed", "--limit", "0", *populated.cli_args()])
    assert len(failed) == facts.failed and all(r["attempts"] == 2 for r in failed)

    val = ok(["rollouts", "--run", MAIN_RUN, "--mode", "val", "--limit", "0", *populated.cli_args()])
    assert val and all(r["mode"] == "val" for r in val)

    best = ok(["rollouts", "--run", MAIN_RUN, "--sort", "reward", "--desc", "--limit", "3", *populated.cli_args()])
    assert len(best) == 3
    assert [r["final_reward"] for r in best] == sorted(facts.final_rewards.values(), reverse=True)[:3]

    by_worker = ok(["rollouts", "--run", MAIN_RUN, "--worker", WORKERS[1], "--limit", "0", *populated.cli_args()])
    assert by_worker and all(r["latest_worker_id"] == WORKERS[1] for r in by_worker)

    v2 = ok(["rollouts", "--run", MAIN_RUN, "--resources-version", "2", "--limit", "0", *populated.cli_args()])
    assert v2 and all(r["resources_version"] == 2 for r in v2)


def test_show_rollout_with_attempts_and_span_tree(populated: Populated) -> None:
    retried = ok(["rollouts", "--run", MAIN_RUN, "--status", "succeeded", "--sort", "attempts", "--desc",
                  "--limit", "1", *populated.cli_args()])[0]
    assert retried["attempts"] == 2
    shown = ok(["show", retried["rollout_id"], "--run", MAIN_RUN, *populated.cli_args()])
    assert shown["rollout"]["rollout_id"] == retried["rollout_id"]
    first, second = shown["attempts"]
    assert first["status"] == "failed" and first["error_type"] == "TimeoutError"
    assert second["status"] == "succeeded"
    (root,) = second["spans"]
    assert root["name"] == "agent.run"
    children = {child["name"] for child in root["children"]}
    assert {"openai.chat.completion", "agentlightning.annotation"} <= children
    llm = next(child for child in root["children"] if child["name"] == "openai.chat.completion")
    assert [grandchild["name"] for grandchild in llm["children"]] == ["tool.calculator"]

    human = invoke(["show", retried["rollout_id"], "--run", MAIN_RUN, *populated.cli_args()])
    assert human.exit_code == 0 and "tool.calculator" in human.stdout and "TimeoutError" in human.stdout


def test_show_unknown_rollout_exits_1(populated: Populated) -> None:
    result = invoke(["show", "ro-nope", "--run", MAIN_RUN, "--json", *populated.cli_args()])
    assert result.exit_code == 1
    assert "ro-nope" in as_json(result)["error"]


def test_spans(populated: Populated) -> None:
    facts = populated.facts[MAIN_RUN]
    rollout_id, span_ids = next(iter(facts.span_ids.items()))
    rows = ok(["spans", "--run", MAIN_RUN, "--rollout", rollout_id, "--limit", "0", *populated.cli_args()])
    assert sorted(r["span_id"] for r in rows) == sorted(span_ids)
    llm = ok(["spans", "--run", MAIN_RUN, "--name", "openai", "--limit", "0", *populated.cli_args()])
    assert len(llm) == facts.llm_calls and all("openai" in r["name"] for r in llm)
    assert all("gen_ai.request.model" in r["attributes"] for r in llm)
    limited = ok(["spans", "--run", MAIN_RUN, "--limit", "5", *populated.cli_args()])
    assert len(limited) == 5


def test_export(populated: Populated, tmp_path: Path) -> None:
    data = ok(["export", "--run", MAIN_RUN, "--to", str(tmp_path / "out"), "--views", "--chunk-rows", "7",
               *populated.cli_args()])
    facts = populated.facts[MAIN_RUN]
    assert data["rows"]["spans"] == facts.spans
    assert data["rows"]["rollouts"] == facts.rollouts
    assert set(VIEW_NAMES) <= set(data["files"])
    lines = Path(data["files"]["spans"]).read_text().splitlines()
    assert len(lines) == facts.spans
    assert data["chunks"] >= facts.spans // 7


def test_export_rejects_unknown_tables(populated: Populated, tmp_path: Path) -> None:
    result = invoke(["export", "--run", MAIN_RUN, "--to", str(tmp_path), "--table", "nope", *populated.cli_args()])
    assert result.exit_code == 2 and "nope" in result.output


def test_check_passes_on_a_consistent_run(populated: Populated) -> None:
    data = ok(["check", "--run", MAIN_RUN, *populated.cli_args()])
    assert data == {"run": MAIN_RUN, "ok": True, "violations": []}


def test_db_current_and_check(populated: Populated) -> None:
    assert ok(["db", "current", *populated.cli_args()]) == {
        "revision": HEAD_REVISION, "head": HEAD_REVISION, "state": "up to date"
    }
    assert ok(["db", "check", *populated.cli_args()])["ok"] is True


# --- errors --------------------------------------------------------------------------------------


def test_unknown_run_lists_the_runs(populated: Populated) -> None:
    for command in (["rollouts"], ["status"], ["spans"], ["show", "ro-1"]):
        result = invoke([*command, "--run", "nope", "--json", *populated.cli_args()])
        assert result.exit_code == 1, (command, result.output)
        error = as_json(result)
        assert "nope" in error["error"] and MAIN_RUN in error["error"] and OTHER_RUN in error["error"]
        assert error["runs"] == [MAIN_RUN, OTHER_RUN]


def test_run_from_the_environment(populated: Populated) -> None:
    env = {"LIGHTNING_SQL_URL": populated.url, "LIGHTNING_SQL_RUN": OTHER_RUN}
    if populated.schema is not None:
        env["LIGHTNING_SQL_SCHEMA"] = populated.schema
    rows = ok(["rollouts", "--limit", "0"], env=env)
    assert len(rows) == populated.facts[OTHER_RUN].rollouts


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert invoke(["rollouts", "--url", f"sqlite:///{tmp_path / 'x.db'}"], env={"LIGHTNING_SQL_RUN": ""}).exit_code == 2
    assert invoke(["runs", "--url", "mysql://nope/db"]).exit_code == 2
    assert invoke(["runs", "--url", f"sqlite:///{tmp_path / 'x.db'}", "--schema", "s"]).exit_code == 2
    assert invoke(["nonsense"]).exit_code == 2


def test_missing_sqlite_file_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    result = invoke(["runs", "--url", f"sqlite:///{path}", "--json"])
    assert result.exit_code == 1 and "no database" in result.output
    assert not path.exists()


def test_unreachable_database_masks_the_password() -> None:
    url = "postgresql://alice:s3cr3t-pw@127.0.0.1:1/postgres"
    for command in (["runs"], ["db", "current"]):
        result = invoke([*command, "--url", url, "--connect-timeout", "0.5", "--json"])
        assert result.exit_code == 1, result.output
        assert "s3cr3t-pw" not in result.output
        assert "alice:***@127.0.0.1:1" in result.output
        assert "refused" in result.output.lower() or "connect" in result.output.lower()


def test_database_without_schema_names_the_upgrade_command(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    result = invoke(["runs", "--url", f"sqlite:///{path}", "--json"])
    assert result.exit_code == 1
    assert "lightning-sql db upgrade" in as_json(result)["error"]


# --- commands that write: their own database ---------------------------------------------------------


def test_db_upgrade_downgrade_current_check(fresh: Populated) -> None:
    args = fresh.cli_args()
    assert ok(["db", "upgrade", *args]) | {"url": None} == {
        "from": None, "to": HEAD_REVISION, "head": HEAD_REVISION, "url": None
    }
    assert ok(["db", "current", *args])["state"] == "up to date"
    assert ok(["db", "downgrade", "0001", "--yes", *args])["to"] == "0001"
    assert ok(["db", "current", *args])["state"] == "behind"
    failed = invoke(["db", "check", "--json", *args])
    assert failed.exit_code == 1 and as_json(failed)["ok"] is False
    refused = invoke(["db", "downgrade", "base", *args], input="n\n")
    assert refused.exit_code == 1
    assert ok(["db", "current", *args])["revision"] == "0001"
    assert ok(["db", "upgrade", *args])["from"] == "0001"
    assert ok(["db", "check", *args])["ok"] is True


def _write(spec: Populated, coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_store(spec: Populated, run: str, fn: Any) -> Any:
    store = spec.open(run=run)
    try:
        return await fn(store)
    finally:
        await store.close()


def test_sweep_expires_dead_attempts(fresh: Populated) -> None:
    async def stale(store: SqlLightningStore) -> str:
        await store.enqueue_rollout({"q": 1}, config=RolloutConfig(timeout_seconds=10.0, max_attempts=1))
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None
        return claimed.rollout_id

    rollout_id = asyncio.run(_with_store(fresh, "sweepme", stale))
    # The CLI runs on the real clock, far past the fake clock's attempt start + 10 s.
    assert ok(["sweep", "--run", "sweepme", *fresh.cli_args()]) == {"run": "sweepme", "expired_attempts": 1}
    assert ok(["sweep", "--all-runs", *fresh.cli_args()])["expired_attempts"] == 0
    shown = ok(["show", rollout_id, "--run", "sweepme", *fresh.cli_args()])
    assert shown["rollout"]["status"] == "failed" and shown["attempts"][0]["status"] == "timeout"
    unknown = invoke(["sweep", "--run", "nope", "--json", *fresh.cli_args()])
    assert unknown.exit_code == 1 and "sweepme" in unknown.output


def test_check_reports_violations(fresh: Populated) -> None:
    async def broken(store: SqlLightningStore) -> None:
        await store.enqueue_rollout({"q": 1})
        await store.enqueue_rollout({"q": 2})
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None
        from sqlalchemy import update

        from lightning_sql.store.sql import schema as s

        worker, run_id = await store._prepare()
        # A broken store: the claimed rollout also stays in the queue.
        await store._submit(
            worker,
            lambda ctx: ctx.conn.execute(
                update(s.rollouts).where(s.rollouts.c.rollout_id == claimed.rollout_id).values(queue_seq=999)
            ),
            write=True,
        )

    asyncio.run(_with_store(fresh, "broken", broken))
    result = invoke(["check", "--run", "broken", "--json", *fresh.cli_args()])
    assert result.exit_code == 1
    data = as_json(result)
    assert data["ok"] is False and data["violations"]


def test_gc_spans_before_and_delete_run(fresh: Populated) -> None:
    from tests.analysis.dataset import make_span

    async def write(store: SqlLightningStore) -> None:
        await store.enqueue_rollout({"q": 1})
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None
        spans = [
            make_span(claimed.rollout_id, claimed.attempt.attempt_id, i + 1, "step", 100.0 + i, 100.5 + i, {},
                      trace_id="ab" * 16)
            for i in range(25)
        ]
        await store.add_many_spans(spans)

    asyncio.run(_with_store(fresh, "gcme", write))
    asyncio.run(_with_store(fresh, "keep", lambda store: store.enqueue_rollout({"q": 2})))
    args = fresh.cli_args()
    dry = ok(["gc", "--spans-before", "110", "--run", "gcme", "--dry-run", *args])
    assert dry["would_delete"] == {"spans": 10}
    done = ok(["gc", "--spans-before", "110", "--run", "gcme", "--yes", "--batch-rows", "3", *args])
    assert done == {"deleted_spans": 10, "batches": 4}
    assert len(ok(["spans", "--run", "gcme", "--limit", "0", *args])) == 15

    refused = invoke(["gc", "--delete-run", "gcme", *args], input="n\n")
    assert refused.exit_code == 1
    assert ok(["gc", "--delete-run", "gcme", "--yes", *args])["deleted_run"] == "gcme"
    assert [r["name"] for r in ok(["runs", *args])] == ["keep"]
    assert invoke(["gc", *args]).exit_code == 2
    assert invoke(["gc", "--delete-run", "x", "--spans-before", "1", *args]).exit_code == 2


def test_worker_runs_rollouts_of_an_existing_run(fresh: Populated) -> None:
    async def enqueue(store: SqlLightningStore) -> None:
        for i in range(3):
            await store.enqueue_rollout({"q": i})

    asyncio.run(_with_store(fresh, "work", enqueue))
    data = ok(["worker", "--run", "work", "--agent", "tests.cli.agents:echo_agent", "-n", "1", "--max-rollouts", "3",
               "--worker-prefix", "cli", *fresh.cli_args()])
    assert data == {"run": "work", "completed_rollouts": 3}
    rows = ok(["rollouts", "--run", "work", *fresh.cli_args()])
    assert [r["status"] for r in rows] == ["succeeded"] * 3
    assert len({r["latest_worker_id"] for r in rows}) == 1 and rows[0]["latest_worker_id"].endswith("cli-0")
    missing = invoke(["worker", "--run", "nope", "--agent", "tests.cli.agents:echo_agent", "--json", *fresh.cli_args()])
    assert missing.exit_code == 1 and "work" in missing.output


def test_demo_without_the_example_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "DEMO_SCRIPT", tmp_path / "nope" / "quickstart.py")
    result = invoke(["demo", "--url", f"sqlite:///{tmp_path / 'demo.db'}"])
    assert result.exit_code == 1 and "examples/quickstart.py" in result.output
