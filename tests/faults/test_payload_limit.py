"""Guarantee: the JSON payload limit is configurable (LIGHTNING_SQL_MAX_JSON_BYTES) and a value over it
gets a clear error naming the field, its size and the limit, and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from lightning_sql import SqlLightningStore
    from lightning_sql.types import MAX_JSON_BYTES

    async def main():
        assert MAX_JSON_BYTES == 1000, MAX_JSON_BYTES
        async with SqlLightningStore(sys.argv[1], run="limit") as store:
            await store.enqueue_rollout({"small": "x" * 100})
            try:
                await store.enqueue_rollout({"big": "x" * 2000})
            except ValueError as exc:
                print("ERROR:", exc)
            print("ROLLOUTS:", (await store.statistics())["total_rollouts"])

    asyncio.run(main())
    """
)


def test_payload_limit_is_configurable_and_enforced(tmp_path: Path) -> None:
    env = dict(os.environ, LIGHTNING_SQL_MAX_JSON_BYTES="1000")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, f"sqlite:///{tmp_path / 'limit.db'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "ERROR: input: encoded size 2010 bytes exceeds the limit of 1000 bytes" in out
    assert "ROLLOUTS: 1" in out  # the rejected call wrote nothing


def test_a_bad_limit_is_refused_clearly() -> None:
    env = dict(os.environ, LIGHTNING_SQL_MAX_JSON_BYTES="lots")
    result = subprocess.run(
        [sys.executable, "-c", "import lightning_sql"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "LIGHTNING_SQL_MAX_JSON_BYTES must be a positive integer number of bytes, got 'lots'" in result.stderr
