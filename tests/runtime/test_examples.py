"""The examples run as a newcomer would run them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import make_url

from lightning_sql import FINISHED_STATUSES, SqlLightningStore
from lightning_sql.runtime.summary import FitSummary, collect_summary
from tests.conftest import PG_URL, require_postgres
from tests.helpers import pg_execute

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


N_QUICKSTART_ROLLOUTS = 416  # 32 train samples x 11 search stages + 32 val samples x 2
N_QUICKSTART_VERSIONS = 12


def _quickstart(url: str, cwd: Path) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(EXAMPLES / "quickstart.py"), "--url", url, "--runners", "4"]
    # PYTHONFAULTHANDLER: a run that does not end in time is aborted with every thread's stack shown.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)


def _output(process: subprocess.Popen[str], timeout: float) -> str:
    """The process's output once it has ended; past ``timeout`` the test fails with the stacks of its
    threads (SIGABRT makes faulthandler print them)."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            out = process.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            out = process.communicate()[0]
        pytest.fail(f"the quickstart had not ended after {timeout} s; its output and stacks:\n{out}")


async def _finished(url: str) -> int:
    store = SqlLightningStore(url, run="quickstart", read_only=True)
    try:
        return (await store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)).total
    except Exception:  # noqa: BLE001 - the database or the run does not exist yet
        return 0
    finally:
        await store.close()


async def _learning(url: str) -> tuple[FitSummary, int | None, Counter[str | None]]:
    store = SqlLightningStore(url, run="quickstart", read_only=True)
    try:
        summary = await collect_summary(store, "quickstart")
        latest = await store.get_resources_by_id("prompt-search")
        keys = Counter(r.idempotency_key for r in await store.query_rollouts())
        return summary, latest.version if latest else None, keys
    finally:
        await store.close()


def test_quickstart_learns_across_versions_and_reports_the_finished_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'quick.db'}"
    first = _quickstart(url, tmp_path)
    out = _output(first, 180)
    assert first.returncode == 0, out
    assert f"{N_QUICKSTART_ROLLOUTS}/{N_QUICKSTART_ROLLOUTS}" in out
    assert "what the prompt search learned" in out and "the best prompt, on val" in out
    assert "SELECT resources_version, mode" in out  # the SQL compares versions

    summary, latest, keys = asyncio.run(_learning(url))
    assert latest == N_QUICKSTART_VERSIONS and set(keys.values()) == {1}
    train = {v.version: v.mean_reward for v in summary.versions if v.mode == "train"}
    val = {v.version: v.mean_reward for v in summary.versions if v.mode == "val"}
    assert sorted(val) == [1, N_QUICKSTART_VERSIONS]
    assert val[N_QUICKSTART_VERSIONS] > val[1] + 0.3  # the best prompt beats the initial one on val
    assert max(train.values()) > train[1] + 0.3

    again = _quickstart(url, tmp_path)
    out = _output(again, 180)
    assert again.returncode == 0, out
    assert "is complete" in out and "The run was already complete: nothing ran" in out
    assert asyncio.run(_learning(url))[1] == N_QUICKSTART_VERSIONS  # nothing published again


def test_quickstart_resumes_mid_search(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'quick.db'}"
    first = _quickstart(url, tmp_path)
    deadline = time.monotonic() + 120
    while asyncio.run(_finished(url)) < 100:  # past stage 0 (64 rollouts): inside the search
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    out = _output(first, 60)
    assert first.returncode == 130, out
    assert "Run the same command again to resume" in out
    interrupted = asyncio.run(_finished(url))
    assert interrupted < N_QUICKSTART_ROLLOUTS

    again = _quickstart(url, tmp_path)
    out = _output(again, 180)
    assert again.returncode == 0, out
    assert "Resuming run quickstart" in out
    summary, latest, keys = asyncio.run(_learning(url))
    assert sum(keys.values()) == N_QUICKSTART_ROLLOUTS and set(keys.values()) == {1}
    assert summary.count(status="succeeded") == N_QUICKSTART_ROLLOUTS
    assert latest == N_QUICKSTART_VERSIONS  # the resumed search published no candidate twice
    assert summary.new_this_fit == N_QUICKSTART_ROLLOUTS - summary.finished_before


@pytest.mark.skipif(
    not (os.environ.get("OPENAI_BASE_URL") and os.environ.get("OPENAI_API_KEY")),
    reason="needs OPENAI_BASE_URL and OPENAI_API_KEY",
)
def test_openai_agent_stores_llm_spans(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    url = f"sqlite:///{tmp_path / 'openai.db'}"
    cmd = [sys.executable, str(EXAMPLES / "openai_agent.py"), "--url", url, "--train", "2", "--val", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr

    async def check() -> None:
        store = SqlLightningStore(url, run="openai-agent", read_only=True)
        rollouts = list(await store.query_rollouts())
        assert len(rollouts) == 3 and {r.status for r in rollouts} == {"succeeded"}
        for r in rollouts:
            names = [s.name for s in await store.query_spans(r.rollout_id)]
            assert "openai.chat.completion" in names and "agentlightning.annotation" in names
        await store.close()

    asyncio.run(check())


def test_quickstart_on_postgresql_ends_without_a_traceback(tmp_path: Path) -> None:
    """Connections are closed on the loop that owns them, before it closes: a run on PostgreSQL
    ends cleanly (it used to print "Exception terminating connection ... Event loop is closed")."""
    require_postgres()
    database = f"quickstart_{uuid.uuid4().hex[:10]}"
    asyncio.run(pg_execute(PG_URL, f'CREATE DATABASE "{database}"'))
    try:
        url = make_url(PG_URL).set(database=database).render_as_string(hide_password=False)
        run = _quickstart(url, tmp_path)
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 0, out
        assert f"{N_QUICKSTART_ROLLOUTS}/{N_QUICKSTART_ROLLOUTS}" in out
        assert "Traceback" not in out and "Event loop is closed" not in out and "ERROR" not in out, out
    finally:
        asyncio.run(pg_execute(PG_URL, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
