"""``lightning-sql``: inspect, export, maintain and serve lightning_sql runs from a terminal.

Every command takes ``--url`` (or ``LIGHTNING_SQL_URL``; without either, the Trainer's default store
``sqlite:///lightning_sql.db``), ``--schema`` for PostgreSQL (or ``LIGHTNING_SQL_SCHEMA``; default
``lightning_sql``), ``--run`` (or ``LIGHTNING_SQL_RUN``) where a run applies, and ``--json`` for
machine-readable output.  Exit codes: 0 ok, 1 failed (check found violations, run or rollout not
found, database unreachable or at the wrong revision), 2 usage.

Read commands open the database read-only (no migration, no sweep, no run created); writing
commands (``sweep``, ``gc``, ``worker``) never create a run and never migrate: only ``db upgrade``
changes the schema.

One module per command group: :mod:`.db`, :mod:`.runs` (runs, status), :mod:`.rollouts` (rollouts,
show, spans), :mod:`.export`, :mod:`.maintenance` (sweep, check, gc), :mod:`.worker`; their SQL is in
:mod:`.queries`, their printing in :mod:`.output`.  ``serve`` comes from ``lightning_sql.server``
(the ``server`` extra) and is imported only when it is run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import click

from lightning_sql.cli.db import db
from lightning_sql.cli.export import export_command
from lightning_sql.cli.maintenance import check_command, gc_command, sweep_command
from lightning_sql.cli.options import EXIT_FAILED, Failed
from lightning_sql.cli.queue import cancel_command, pause_command, resume_command
from lightning_sql.cli.rollouts import rollouts_command, show_command, spans_command
from lightning_sql.cli.runs import runs_command, status_command
from lightning_sql.cli.worker import worker_command

__all__ = ["cli", "main"]

DEMO_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"

# Commands whose module needs an optional extra: name -> (module:attr, extra).
LAZY_COMMANDS = {"serve": ("lightning_sql.server.command:serve", "server")}


def _missing_extra_command(name: str, extra: str, reason: str) -> click.Command:
    """A stand-in that says which extra to install, whatever arguments it is given."""

    def explain() -> None:
        click.echo(
            f"`lightning-sql {name}` needs the {extra} extra: pip install 'lightning_sql[{extra}]' ({reason})",
            err=True,
        )
        sys.exit(EXIT_FAILED)

    return click.Command(
        name,
        callback=explain,
        help=f"(needs pip install 'lightning_sql[{extra}]')",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    )


class LightningSqlGroup(click.Group):
    """The command group; commands of optional extras are imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        path, extra = LAZY_COMMANDS[cmd_name]
        module_name, _, attr = path.partition(":")
        try:
            command: Any = getattr(importlib.import_module(module_name), attr)
        except ImportError as exc:
            return _missing_extra_command(cmd_name, extra, str(exc))
        if not isinstance(command, click.Command):
            raise TypeError(f"{path} is a {type(command).__qualname__}, not a click command")
        return command


@click.group(cls=LightningSqlGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="lightning_sql")
def cli() -> None:
    """Inspect, export and maintain lightning_sql runs (SQLite or PostgreSQL)."""


@cli.command("demo")
@click.option("--url", envvar="LIGHTNING_SQL_URL", default="sqlite:///quickstart.db", show_default=True)
@click.option("--runners", type=int, default=4, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the demo run and start over.")
def demo_command(url: str, runners: int, fresh: bool) -> None:
    """Run the offline quickstart (examples/quickstart.py): a small run to explore with the other commands."""
    if not DEMO_SCRIPT.is_file():
        raise Failed(
            f"the demo needs examples/quickstart.py from a source checkout of lightning_sql (looked at {DEMO_SCRIPT})"
        )
    spec = importlib.util.spec_from_file_location("lightning_sql_quickstart", DEMO_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        raise Failed(f"{DEMO_SCRIPT} has no main()")
    argv = [str(DEMO_SCRIPT), "--url", url, "--runners", str(runners)] + (["--fresh"] if fresh else [])
    saved = sys.argv
    sys.argv = argv
    try:
        module.main()
    finally:
        sys.argv = saved


for _command in (
    db,
    runs_command,
    status_command,
    rollouts_command,
    show_command,
    spans_command,
    export_command,
    sweep_command,
    check_command,
    gc_command,
    worker_command,
    cancel_command,
    pause_command,
    resume_command,
):
    cli.add_command(_command)


def main() -> None:
    """The ``lightning-sql`` entry point."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    cli(prog_name="lightning-sql")
