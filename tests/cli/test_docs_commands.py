"""Every `lightning-sql` command in README.md and docs/ runs against the quickstart's database.

Commands are read from the Markdown at collection time, so a command added to the docs is tested
without touching this file: each line of a fenced block that starts with ``lightning-sql`` (with its
``\\`` continuation lines), and each inline code span that starts with ``lightning-sql``.

How a command is run:

* in this process through click's runner (commands that run until stopped: in a process of
  their own), in a folder holding a fresh copy of the quickstart's ``quickstart.db`` (examples/quickstart.py,
  run once per module), so ``--url sqlite:///quickstart.db`` works as written, and a command that
  writes or deletes cannot disturb the next one; ``y`` answers a confirmation prompt;
* the docs' example databases and names stand for the quickstart's: any other ``--url`` (a
  PostgreSQL host, ``runs.db``, ``...``) becomes ``sqlite:///quickstart.db`` (``--schema`` dropped),
  any other ``--run`` becomes ``quickstart``, and ``<rollout>`` one of its rollout ids;
* ``--agent module:attr`` finds ``module.py`` in the folder (a trivial agent written by this test),
  as it would in the user's project folder;
* a span that names a command without arguments (``lightning-sql sweep``) refers to the command:
  ``--help`` must succeed;
* commands that run until stopped (RUNS_UNTIL_STOPPED: ``serve``, ``status --watch`` without
  ``--count``, ``worker --forever``) run in a process of their own: once they print something they
  must still be running STILL_RUNNING_S seconds later, and stop on SIGTERM; ``serve`` without the ``server`` extra must say what to install.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import lightning_sql
from lightning_sql import cli

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
QUICKSTART = REPO / "examples" / "quickstart.py"
QUICKSTART_URL = "sqlite:///quickstart.db"
QUICKSTART_RUN = "quickstart"
ROLLOUT_PLACEHOLDER = re.compile(r"^<[^>]*rollout[^>]*>$|^ROLLOUT(_ID)?$", re.IGNORECASE)
COMMAND_TIMEOUT_S = 120.0
STILL_RUNNING_S = 3.0

AGENT_MODULE = '''
from lightning_sql import LitAgent


class _Agent(LitAgent):
    def rollout(self, task, resources, rollout):
        return 1.0


{attr} = _Agent()
'''


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str


def _fenced_commands(path: Path, lines: list[str]) -> list[DocCommand]:
    found: list[DocCommand] = []
    in_fence, pending, start = False, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_fence, pending = not in_fence, ""
            continue
        stripped = line.strip()
        if not in_fence or not (pending or stripped.startswith("lightning-sql")):
            continue
        if not pending:
            start = number
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            found.append(DocCommand(f"{path.relative_to(REPO)}:{start}", pending.strip()))
            pending = ""
    return found


def _inline_commands(path: Path, lines: list[str]) -> list[DocCommand]:
    found: list[DocCommand] = []
    in_fence = False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if not in_fence:
            for match in re.finditer(r"`(lightning-sql(?: [^`]*)?)`", line):
                found.append(DocCommand(f"{path.relative_to(REPO)}:{number}", match.group(1)))
    return found


def doc_commands() -> list[DocCommand]:
    commands: list[DocCommand] = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        commands += _fenced_commands(path, lines) + _inline_commands(path, lines)
    return commands


COMMANDS = doc_commands()


def test_the_docs_have_commands() -> None:
    assert len(COMMANDS) >= 10 and any(c.where.startswith("README.md") for c in COMMANDS)


def command_path(args: list[str]) -> list[str]:
    """The words naming the command (``db upgrade``), before the first option or argument."""
    path: list[str] = []
    for word in args:
        if word.startswith("-") or (path and path[0] != "db") or len(path) == 2:
            break
        path.append(word)
    return path


def as_run_here(args: list[str], rollout_id: str) -> list[str]:
    """``args`` with the docs' example database, run and rollout replaced by the quickstart's."""
    out: list[str] = []
    words = iter(args)
    for word in words:
        if word == "--url":
            next(words, None)
            out += ["--url", QUICKSTART_URL]
        elif word == "--schema":
            next(words, None)
        elif word == "--run":
            next(words, None)
            out += ["--run", QUICKSTART_RUN]
        elif ROLLOUT_PLACEHOLDER.match(word):
            out.append(rollout_id)
        else:
            out.append(word)
    return out


def first_output(process: subprocess.Popen[str]) -> None:
    """Wait until the process has printed something (started, or failed) on stdout or stderr."""
    lines: queue.Queue[str] = queue.Queue()
    for stream in (process.stdout, process.stderr):
        assert stream is not None
        threading.Thread(target=lambda s=stream: lines.put(s.readline()), daemon=True).start()
    lines.get(timeout=COMMAND_TIMEOUT_S)


def runs_until_stopped(args: list[str]) -> bool:
    name = args[0] if args else ""
    return (
        name == "serve"
        or (name == "status" and "--watch" in args and "--count" not in args)
        or (name == "worker" and "--forever" in args)
    )


@pytest.fixture(scope="module")
def quickstart_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quickstart")
    done = subprocess.run(
        [sys.executable, str(QUICKSTART), "--url", QUICKSTART_URL],
        cwd=folder, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "quickstart.db"


@pytest.fixture(scope="module")
def rollout_id(quickstart_db: Path) -> str:
    import sqlite3

    with sqlite3.connect(quickstart_db) as conn:
        (found,) = conn.execute(
            "SELECT r.rollout_id FROM rollouts r JOIN runs USING (run_id) WHERE runs.name = ? ORDER BY r.create_seq LIMIT 1",
            (QUICKSTART_RUN,),
        ).fetchone()
    return str(found)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_SQL_")}
    env["PYTHONPATH"] = str(Path(lightning_sql.__file__).resolve().parents[1])
    return env


def _without_port(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
        elif word == "--port":
            skip = True
        elif not word.startswith("--port="):
            out.append(word)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text}" for c in COMMANDS])
def test_documented_command_runs(
    command: DocCommand, quickstart_db: Path, rollout_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = shlex.split(command.text, comments=True)
    assert words[0] == "lightning-sql", command
    args = words[1:]
    if not args or args == command_path(args):
        args = [*args, "--help"]
    else:
        args = as_run_here(args, rollout_id)
    shutil.copy(quickstart_db, tmp_path / "quickstart.db")
    for spec in [args[i + 1] for i, word in enumerate(args[:-1]) if word == "--agent"]:
        module, _, attr = spec.partition(":")
        (tmp_path / f"{module}.py").write_text(AGENT_MODULE.format(attr=attr or "agent"))
    argv = [sys.executable, "-m", "lightning_sql.cli", *args]
    shown = f"{command.where}: lightning-sql {shlex.join(args)}"

    if runs_until_stopped(args):
        if args[0] == "serve" and importlib.util.find_spec("lightning_sql.server") is None:
            done = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
            assert done.returncode == 1 and "pip install 'lightning_sql[server]'" in done.stderr, (shown, done.stderr)
            return
        if args[0] == "serve":  # on a free port: the docs' commands run side by side
            argv = [*argv[: argv.index("serve") + 1], *_without_port(args[1:]), "--port", str(_free_port())]
        process = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first_output(process)
            time.sleep(STILL_RUNNING_S)
            if process.poll() is not None:
                out, err = process.communicate()
                raise AssertionError(f"{shown} stopped by itself ({process.returncode}): {out}{err}")
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=COMMAND_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        return

    # Everything else runs in this process (click's runner): the same entry point, without a
    # Python start-up per command.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the worker puts the folder on it
    for variable in [v for v in os.environ if v.startswith("LIGHTNING_SQL_")]:
        monkeypatch.delenv(variable)
    try:
        done = CliRunner().invoke(cli.cli, args, input="y\n", catch_exceptions=True)
    finally:
        for module in [name for name, m in sys.modules.items() if str(tmp_path) in str(getattr(m, "__file__", ""))]:
            del sys.modules[module]
    assert done.exception is None or isinstance(done.exception, SystemExit), (shown, done.exc_info)
    assert done.exit_code == 0, f"{shown} exited {done.exit_code}:\n{done.output}"


def test_a_command_that_runs_until_stopped_must_keep_running(
    quickstart_db: Path, rollout_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness itself: `status --watch` keeps running; one that stops by itself is reported."""
    watch = DocCommand("(this test)", "lightning-sql status --watch --url sqlite:///quickstart.db --run quickstart")
    assert runs_until_stopped(shlex.split(watch.text)[1:])
    test_documented_command_runs(watch, quickstart_db, rollout_id, tmp_path, monkeypatch)
    stops = DocCommand("(this test)", "lightning-sql status --watch --interval soon --url sqlite:///quickstart.db")
    with pytest.raises(AssertionError, match="stopped by itself"):
        test_documented_command_runs(stops, quickstart_db, rollout_id, tmp_path, monkeypatch)


def test_folders_the_docs_export_to_are_ignored_by_git() -> None:
    """A user who runs the docs' export commands inside a checkout does not see their output as changes."""
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    folders = set()
    for command in COMMANDS:
        words = shlex.split(command.text, comments=True)
        folders |= {words[i + 1] for i, word in enumerate(words[:-1]) if word == "--to" and "/" not in words[i + 1]}
    assert folders, "no documented export command"
    assert {f"{folder}/" for folder in folders} <= ignored
