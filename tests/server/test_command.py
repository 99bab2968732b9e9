"""``python -m lightning_sql.server`` (the ``lightning-sql serve`` command) as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from click.testing import CliRunner

from benchmarks.server_startup import running_server, time_to_healthy
from lightning_sql.server.command import serve

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def test_serve_starts_answers_and_stops(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'served.db'}"
    # The startup benchmark's own probe: spawn, poll /healthz until 200, stop.  Its time is a figure
    # for benchmarks/server_startup.py, not asserted here.
    startup = time_to_healthy(["--url", url, "--run", "cli-run"], _env())
    assert startup.wall_s > 0 and startup.cpu_s > 0
    assert (tmp_path / "served.db").exists()


def test_serve_refuses_bad_options_with_exit_code_2(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, message in [
        (["--url", "mysql://nowhere/db"], "mysql"),
        (["--url", f"sqlite:///{tmp_path / 'x.db'}", "--schema", "other"], "schema"),
        (["--url", "sqlite://", "--port", "70000"], "70000"),
        (["--url", "sqlite://", "--max-body-mb", "0"], "max-body-mb"),
        ([], "--url"),
    ]:
        result = runner.invoke(serve, args, env={"LIGHTNING_SQL_URL": None, "LIGHTNING_SQL_TOKEN": None})
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)


def test_help_lists_the_options() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_sql.server", "--help"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    for option in ["--url", "--run", "--schema", "--host", "--port", "--token", "--read-only", "--max-body-mb", "--cors-origin"]:
        assert option in result.stdout


def test_the_token_comes_from_the_environment(tmp_path: Path) -> None:
    env = {**_env(), "LIGHTNING_SQL_TOKEN": "from-env"}
    with running_server(["--url", f"sqlite:///{tmp_path / 't.db'}"], env) as (base, _startup):
        assert httpx.get(base + "/v1/agl/health", timeout=10).status_code == 401
        answer = httpx.get(base + "/v1/agl/health", headers={"Authorization": "Bearer from-env"}, timeout=10)
        assert answer.status_code == 200


def test_read_only_refuses_a_missing_sqlite_file(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here.db"
    result = CliRunner().invoke(serve, ["--url", f"sqlite:///{missing}", "--read-only"], env={"LIGHTNING_SQL_TOKEN": None})
    assert result.exit_code == 2, result.output
    assert "no SQLite database" in result.output and str(missing) in result.output.replace("\n", "")
    assert not missing.exists() and list(tmp_path.iterdir()) == []
