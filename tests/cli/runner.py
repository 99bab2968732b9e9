"""Running `lightning-sql` in-process through click's CliRunner, its `--json` output parsed."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner, Result

from lightning_sql import cli


def invoke(args: list[str], *, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    runner = CliRunner()
    # Wide enough that rich does not fold ids in human output.
    return runner.invoke(cli.cli, args, input=input, env={"COLUMNS": "250", **(env or {})}, catch_exceptions=False)


def as_json(result: Result) -> Any:
    assert result.stdout.strip(), result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def ok(args: list[str], **kwargs: Any) -> Any:
    result = invoke([*args, "--json"], **kwargs)
    assert result.exit_code == 0, (result.exit_code, result.output)
    return as_json(result)


async def with_store(spec: Any, run: str, fn: Any, **kwargs: Any) -> Any:
    """``await fn(store)`` on a store of ``spec`` (a Populated) bound to ``run``, closed after."""
    store = spec.open(run=run, **kwargs)
    try:
        return await fn(store)
    finally:
        await store.close()
