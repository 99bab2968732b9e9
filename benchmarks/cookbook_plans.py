"""The cookbook's queries on one big run, with ``run_id`` unsampled (revision 0003) and sampled.

``python -m benchmarks.cookbook_plans [--samples 3000] [--repeat 5]``  (PostgreSQL, superuser)

Revision 0003 leaves ``run_id`` (and ``rollouts.queue_seq``) out of ANALYZE so that the store's
statements never plan a new run as empty (ADR 0007).  The price is that a query filtering by run is
planned for a run of the default 0.5% of the table, even when one run is the whole table.  This
writes a small run (``quickstart-b``) and a big quickstart-like run (``quickstart``, ``--samples``
samples per epoch, two epochs, through the store: tests/analysis/dataset.py) in a schema of its own,
then runs every PostgreSQL block of docs/analysis.md with ``EXPLAIN (ANALYZE)`` under both settings,
freshly analysed and alternating between the two every round, and prints each block's execution time
(median of ``--repeat`` rounds), the ratio and whether the plan's shape (its node types) differs.
Deleting the columns' statistics needs a superuser, as the revision's own clean-up does.
No figure is asserted: this is a diagnostic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg

from benchmarks.targets import drop_schema, pg_dsn, pg_url
from lightning_sql import SqlLightningStore
from lightning_sql.store.sql.schema import UNSAMPLED_COLUMNS

SETTINGS = (("unsampled", 0), ("sampled", -1))  # (label, statistics target of UNSAMPLED_COLUMNS)
TABLES = ("rollouts", "attempts", "spans", "workers", "resources")


async def _write(schema: str, samples: int) -> None:
    from tests.analysis.dataset import populate_run
    from tests.helpers import FakeClock

    clock = FakeClock(1_800_000_000.0)
    try:
        for name, n in (("quickstart-b", 12), ("quickstart", samples)):
            store = SqlLightningStore(
                pg_url(), schema=schema, run=name, clock=clock, clock_sync=False, scan_debounce_seconds=0
            )
            try:
                await populate_run(
                    store, clock, name=name, n_samples=n, epochs=2,
                    reward_of=lambda epoch, index: 0.3 + 0.1 * epoch + 0.01 * (index % 7),
                )
            finally:
                await store.close()
    finally:
        clock.remove()


async def _execute(conn: Any, sql: str) -> tuple[float, str]:
    """(execution ms, the plan's shape: its node types, nested) of one ``EXPLAIN (ANALYZE)``."""
    plan = json.loads(await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql))[0]
    return float(plan["Execution Time"]), _shape(plan["Plan"])


def _shape(node: dict[str, Any]) -> str:
    children = ",".join(_shape(child) for child in node.get("Plans", ()))
    return f"{node['Node Type']}({children})" if children else str(node["Node Type"])


async def _analyse_with(conn: Any, schema: str, target: int) -> None:
    for table, columns in UNSAMPLED_COLUMNS.items():
        for column in columns:
            await conn.execute(f'ALTER TABLE "{schema}"."{table}" ALTER COLUMN "{column}" SET STATISTICS {target}')
    await conn.execute(
        "DELETE FROM pg_catalog.pg_statistic WHERE starelid IN "
        "(SELECT oid FROM pg_catalog.pg_class WHERE relnamespace = $1::regnamespace)",
        schema,
    )
    await conn.execute("ANALYZE " + ", ".join(f'"{schema}"."{t}"' for t in TABLES))
    sampled = await conn.fetchval(
        "SELECT count(*) FROM pg_catalog.pg_stats WHERE schemaname = $1 AND tablename = ANY($2) AND attname = 'run_id'",
        schema,
        list(UNSAMPLED_COLUMNS),
    )
    if bool(sampled) != (target != 0):  # the comparison is only worth something if the setting took
        raise RuntimeError(f"statistics target {target}: {sampled} of the tables of UNSAMPLED_COLUMNS have run_id statistics")


async def run(samples: int, repeat: int) -> tuple[dict[str, int], dict[str, dict[str, float]]]:
    """(rows per table, {block: {setting: execution ms, "same plan": 1.0 or 0.0}}) for the PostgreSQL
    cookbook blocks: medians of ``repeat`` rounds, each setting analysed afresh in every round."""
    from tests.analysis.test_cookbook import BLOCKS

    schema = f"bench_cookbook_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_dsn())
    try:
        await _write(schema, samples)
        await conn.execute(f'SET search_path = "{schema}"')
        sizes = {t: int(await conn.fetchval(f'SELECT count(*) FROM "{schema}"."{t}"'))  # noqa: S608 - our names
                 for t in ("rollouts", "spans")}
        blocks = [(b, sql.strip().rstrip(";")) for b, dialect, sql in BLOCKS if dialect in ("both", "postgresql")]
        times: dict[str, dict[str, list[float]]] = {b: {label: [] for label, _ in SETTINGS} for b, _ in blocks}
        shapes: dict[str, dict[str, set[str]]] = {b: {label: set() for label, _ in SETTINGS} for b, _ in blocks}
        for k in range(repeat):  # the settings alternate, so the machine's drift falls on both
            for label, target in SETTINGS if k % 2 == 0 else SETTINGS[::-1]:
                await _analyse_with(conn, schema, target)
                for b, sql in blocks:
                    ms, shape = await _execute(conn, sql)
                    times[b][label].append(ms)
                    shapes[b][label].add(shape)
        out = {
            b: {**{label: statistics.median(ms) for label, ms in by.items()},
                "same plan": float(shapes[b]["unsampled"] == shapes[b]["sampled"])}
            for b, by in times.items()
        }
        return sizes, out
    finally:
        await conn.close()
        await drop_schema(schema)


def report(sizes: dict[str, int], results: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"rows: {sizes}", f"{'block':22} {'unsampled ms':>13} {'sampled ms':>11} {'ratio':>6}  plan"]
    totals = dict.fromkeys((label for label, _ in SETTINGS), 0.0)
    for block, ms in results.items():
        for label in totals:
            totals[label] += ms[label]
        plan = "same" if ms["same plan"] else "differs"
        lines.append(
            f"{block:22} {ms['unsampled']:13.2f} {ms['sampled']:11.2f} {ms['unsampled'] / ms['sampled']:6.2f}  {plan}"
        )
    changed = sum(1 for ms in results.values() if not ms["same plan"])
    lines.append(
        f"{'total':22} {totals['unsampled']:13.2f} {totals['sampled']:11.2f} "
        f"{totals['unsampled'] / totals['sampled']:6.2f}  {changed} of {len(results)} plans differ"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cookbook_plans", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=3000, help="samples per epoch of the big run (2 epochs)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the settings alternate")
    args = parser.parse_args(argv)
    sizes, results = asyncio.run(run(args.samples, args.repeat))
    print("\n".join(report(sizes, results)))


if __name__ == "__main__":
    main()
