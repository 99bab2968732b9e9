"""The examples run as a newcomer would run them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_sql import SqlLightningStore

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_runs_then_reports_the_finished_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'quick.db'}"
    cmd = [sys.executable, str(EXAMPLES / "quickstart.py"), "--url", url, "--runners", "4"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "240/240" in first.stdout and "train" in first.stdout and "spans stored: 480" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is complete" in again.stdout and "spans stored: 480" in again.stdout

    async def check() -> None:
        store = SqlLightningStore(url, run="quickstart", read_only=True)
        rollouts = list(await store.query_rollouts())
        assert len(rollouts) == 240 and {r.status for r in rollouts} == {"succeeded"}
        assert (await store.get_run("quickstart")).status == "finished"  # type: ignore[union-attr]
        await store.close()

    asyncio.run(check())


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
