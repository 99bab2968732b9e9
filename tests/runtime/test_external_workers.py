"""External workers (own OS processes, `run_worker`) complete a run whose trainer has no runners."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import Baseline, PromptTemplate, SqlLightningStore, Trainer
from lightning_sql.runtime.worker import load_agent, run_worker
from tests.runtime import agents

ROOT = Path(__file__).resolve().parents[2]
N_SAMPLES = int(os.environ.get("LIGHTNING_SQL_TEST_WORKER_SAMPLES", "12"))

WORKER_CODE = """
import sys
from lightning_sql.runtime.worker import run_worker
n = run_worker(sys.argv[1], sys.argv[2], "tests.runtime.agents:async_agent", n=2, schema=sys.argv[3],
               poll_interval=1.0, heartbeat_interval=0.5)
print("reported", n, flush=True)
"""


def _worker(url: str, run: str, schema: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER_CODE, url, run, schema], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def test_external_workers_complete_a_run(pg_backend: Any) -> None:
    run = "external"
    store = pg_backend.open(run=run)
    trainer = Trainer(
        store=store,
        n_runners=0,
        algorithm=Baseline(max_queue_length=4, polling_interval=0.5, span_verbosity="none"),
        initial_resources={"p": PromptTemplate(template="{x}", engine="f-string")},
    )
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit(agents.async_agent, [{"x": i, "sleep": 0.05} for i in range(N_SAMPLES)])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=fit)
    thread.start()
    observer = SqlLightningStore(pg_backend.url, run=run, create_run=False, schema=pg_backend.schema)
    workers: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(observer.get_run(run)) is None:  # workers join an existing run only
            assert time.monotonic() < deadline
            time.sleep(0.05)
        workers = [_worker(pg_backend.url, run, pg_backend.schema) for _ in range(2)]
        thread.join(120)
        assert not thread.is_alive() and not errors, errors
        for w in workers:
            w.send_signal(signal.SIGTERM)  # graceful: the worker finishes its current rollout and exits 0
        outputs = [w.communicate(timeout=60)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0]
        reported = [int(line.split()[1]) for out in outputs for line in out.splitlines() if line.startswith("reported")]
        assert sum(reported) == N_SAMPLES

        async def check() -> None:
            rollouts = list(await observer.query_rollouts())
            assert len(rollouts) == N_SAMPLES and {r.status for r in rollouts} == {"succeeded"}
            worker_ids = {r.attempt.worker_id for r in rollouts}  # type: ignore[union-attr]
            pids = {str(w.pid) for w in workers}
            # ids embed host name and pid, so workers of many hosts never share a row
            assert all(wid.startswith("Worker-") and wid.rsplit("-", 2)[1] in pids for wid in worker_ids)
            assert (await observer.get_run(run)).status == "finished"  # type: ignore[union-attr]
            spans = await observer.query_spans(rollouts[0].rollout_id)
            assert [s.name for s in spans] == ["openai.chat.completion", "agentlightning.annotation"]

        asyncio.run(check())
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        asyncio.run(observer.close())
        asyncio.run(store.close())


def test_worker_refuses_an_unknown_run(pg_backend: Any) -> None:
    asyncio.run(_create_run(pg_backend, "exists"))
    with pytest.raises(ValueError, match="exists"):
        run_worker(pg_backend.url, "typo", "tests.runtime.agents:async_agent", schema=pg_backend.schema)
    with pytest.raises(ValueError, match="run is required"):
        run_worker(pg_backend.url, None, "tests.runtime.agents:async_agent", schema=pg_backend.schema)


async def _create_run(pg_backend: Any, name: str) -> None:
    store = pg_backend.open(run=name)
    await store.statistics()
    await store.close()


def test_load_agent_specs() -> None:
    assert load_agent("tests.runtime.agents:async_agent") is agents.async_agent
    assert isinstance(load_agent("tests.runtime.agents:FlakyAgent"), agents.FlakyAgent)
    with pytest.raises(ValueError, match="module:attr"):
        load_agent("tests.runtime.agents.async_agent")
    with pytest.raises(ValueError, match="Cannot import"):
        load_agent("tests.runtime.agents:nope")
