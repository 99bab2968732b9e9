"""``lightning-sql worker``: runners on this host for an existing run."""

from __future__ import annotations

import os
import sys

import click

from lightning_sql.cli.options import (
    common_options,
    database,
    fail,
    handled,
    need_run,
    run_option,
    store_options,
)
from lightning_sql.cli.output import emit, printable


def put_on_import_path(directory: str) -> None:
    """Let ``--agent module:attr`` name a module in ``directory``, as ``python -m`` and uvicorn do."""
    path = os.path.abspath(directory)
    if path not in sys.path:
        sys.path.insert(0, path)


@click.command("worker")
@run_option()
@click.option("--agent", "agent_spec", required=True, help="The agent as module:attr.")
@click.option("-n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Runners in this process.")
@click.option("--worker-prefix", help="Worker id prefix (default <host>-<pid>).")
@click.option("--max-rollouts", type=click.IntRange(min=0), help="Stop each runner after this many rollouts.")
@click.option(
    "--forever",
    is_flag=True,
    help="Keep waiting for work after the run is finished (default: exit 0 once it is finished and drained).",
)
@click.option(
    "--app-dir",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False, exists=True),
    help="Import the agent's module from this folder first.",
)
@common_options
@handled
def worker_command(
    run: str | None,
    agent_spec: str,
    n: int,
    worker_prefix: str | None,
    max_rollouts: int | None,
    forever: bool,
    app_dir: str,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Run N runners against an existing run (external workers, any host, shared PostgreSQL).

    Exits 0 once the run is marked finished and none of its rollouts is queued or running
    (--forever: only on SIGTERM / Ctrl-C).  SIGTERM or the first Ctrl-C lets current rollouts finish.
    """
    name = need_run(run)
    db = database(url, schema)
    db.require_existing_file()
    try:
        from lightning_sql.runtime.worker import run_worker
    except ImportError as exc:
        fail(as_json, f"external workers are not available in this installation ({exc})")
    put_on_import_path(app_dir)
    options = store_options(schema, connect_timeout)
    if max_rollouts is not None:
        options["max_rollouts"] = max_rollouts

    def started(line: str) -> None:
        click.echo(printable(line), err=True)

    completed = run_worker(
        db.url, name, agent_spec, n=n, worker_prefix=worker_prefix, forever=forever, on_start=started, **options
    )
    data = {"run": name, "completed_rollouts": completed}
    emit(as_json, data, lambda c: c.print(f"Worker stopped after {completed} rollout(s)."))
