"""`lightning-sql worker` as a user starts it: from the agent's folder, in its own process.

Issue 34 item 8: the current folder is on the import path; one start line names the masked URL,
the run, n and the agent; the worker exits 0 once the run is marked finished and nothing is
queued or running; `--forever` keeps waiting; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from sqlalchemy import make_url

import lightning_sql
from lightning_sql import SqlLightningStore
from tests.analysis.fixtures import Populated
from tests.cli.runner import with_store

AGENT_MODULE = '''
from lightning_sql import LitAgent


class Solver(LitAgent):
    def rollout(self, task, resources, rollout):
        return float(task["x"])


solver = Solver()
'''
# Generous: the worker notices a finished run within its poll interval (5 s).
EXIT_TIMEOUT_S = 60.0
PASSWORD = "hunter2-not-shown"


def _url_with_password(spec: Populated) -> str:
    if not spec.is_postgres:
        return spec.url
    return make_url(spec.url).set(password=PASSWORD).render_as_string(hide_password=False)


def _start_worker(spec: Populated, folder: Path, run: str, *extra: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    (folder / "myagent.py").write_text(AGENT_MODULE)
    args = ["--url", _url_with_password(spec), "--run", run, "--agent", "myagent:solver", "-n", "2", *extra]
    if spec.schema is not None:
        args += ["--schema", spec.schema]
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_SQL_URL", "LIGHTNING_SQL_RUN")}
    env["PYTHONPATH"] = str(Path(lightning_sql.__file__).resolve().parents[1])  # lightning_sql, not the folder
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_sql.cli", "worker", *args],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)

    assert process.stderr is not None
    threading.Thread(target=pump, args=(process.stderr,), daemon=True).start()
    return process, lines


def _start_line(process: subprocess.Popen[str], lines: queue.Queue[str]) -> str:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            assert process.poll() is None or not lines.empty(), "".join(seen)
            continue
        seen.append(line)
        if line.startswith("Worker "):
            return line
    raise AssertionError(f"no start line: {''.join(seen)}")


def _finish(spec: Populated, run: str) -> None:
    asyncio.run(with_store(spec, run, lambda store: store.mark_run_finished()))


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_worker_runs_an_agent_from_its_folder_and_exits_when_the_run_is_done(fresh: Populated, tmp_path: Path) -> None:
    async def prepare(store: SqlLightningStore) -> None:
        for x in (1, 0):
            await store.enqueue_rollout({"x": x})
        await store.mark_run_finished()  # finished, but two rollouts still queued

    asyncio.run(with_store(fresh, "drain", prepare))
    process, lines = _start_worker(fresh, tmp_path, "drain")
    try:
        line = _start_line(process, lines)
        out, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        _stop(process)
    assert process.returncode == 0, out
    assert "run 'drain'" in line and "2 runner(s)" in line and "agent myagent:solver" in line
    assert PASSWORD not in line
    if fresh.is_postgres:
        assert ":***@" in line
    assert "Worker stopped after 2 rollout(s)." in out

    async def statuses(store: SqlLightningStore) -> list[str]:
        return sorted(r.status for r in await store.query_rollouts())

    assert asyncio.run(with_store(fresh, "drain", statuses)) == ["succeeded", "succeeded"]


def test_worker_waits_while_the_run_is_active(fresh: Populated, tmp_path: Path) -> None:
    asyncio.run(with_store(fresh, "active", lambda store: store.statistics()))
    process, lines = _start_worker(fresh, tmp_path, "active")
    try:
        _start_line(process, lines)
        time.sleep(2.0)
        assert process.poll() is None  # an active run may still get work
        _finish(fresh, "active")
        out, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        _stop(process)
    assert process.returncode == 0 and "Worker stopped after 0 rollout(s)." in out


def test_worker_forever_keeps_waiting_until_sigterm(fresh: Populated, tmp_path: Path) -> None:
    asyncio.run(with_store(fresh, "done", lambda store: store.mark_run_finished()))
    process, lines = _start_worker(fresh, tmp_path, "done", "--forever")
    try:
        line = _start_line(process, lines)
        assert "exits when the run is finished" not in line
        time.sleep(2.0)
        assert process.poll() is None  # a finished, empty run: it would have exited without --forever
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        _stop(process)
    assert process.returncode == 0, out
    assert "Worker stopped after 0 rollout(s)." in out


@pytest.mark.parametrize("missing", ["nosuchmodule:solver", "myagent:nosuchattr"])
def test_worker_names_an_agent_it_cannot_import(fresh: Populated, tmp_path: Path, missing: str) -> None:
    asyncio.run(with_store(fresh, "r", lambda store: store.statistics()))
    (tmp_path / "myagent.py").write_text(AGENT_MODULE)
    args = ["--url", fresh.url, "--run", "r", "--agent", missing]
    if fresh.schema is not None:
        args += ["--schema", fresh.schema]
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_SQL_URL", "LIGHTNING_SQL_RUN")}
    env["PYTHONPATH"] = str(Path(lightning_sql.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-m", "lightning_sql.cli", "worker", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
    )
    assert done.returncode == 2, done.stderr
    assert missing in done.stderr and "Traceback" not in done.stderr
