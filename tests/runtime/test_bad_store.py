"""A Trainer pointed at a database it cannot open says so in words, once, and exits non-zero: no
traceback per runner, heartbeat and thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from lightning_sql import Baseline, SqlLightningStore, Trainer, rollout

@rollout
def solver(task, prompt_template):
    return 1.0

store = SqlLightningStore(sys.argv[1], run="bad", connect_deadline_seconds=1)
Trainer(store=store, n_runners=2, algorithm=Baseline(n_epochs=1)).fit(solver, [{"q": 1}] * 4, [{"q": 2}] * 2)
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sqlite:////nonexistent-folder-of-lightning-sql/run.db", "the folder /nonexistent-folder-of-lightning-sql does not exist"),
        ("postgresql://postgres@127.0.0.1:{port}/postgres", "connection refused at 127.0.0.1:"),
    ],
)
def test_an_unreachable_store_is_one_error_in_words(tmp_path: Path, url: str, says: str) -> None:
    url = url.format(port=_closed_port())  # here, not at collection: every xdist worker collects alike
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    output = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1, output
    assert "Traceback" not in done.stderr
    assert output[-1].startswith("lightning_sql: cannot open the store:") and says in output[-1], output
    assert len(output) <= 2, output  # the error, and for PostgreSQL the one "retrying" line before it
