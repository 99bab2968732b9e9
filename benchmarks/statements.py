"""Statements PostgreSQL receives per lifecycle, counted by the server, and cross-thread wake-ups per call.

``python -m benchmarks.statements [--runners 1,8] [--n 300]`` (the server at
``LIGHTNING_SQL_BENCH_POSTGRES_URL`` must load ``pg_stat_statements``:
``shared_preload_libraries = 'pg_stat_statements'``; docs/performance.md has a throwaway cluster)

For each R it fills a queue of N rollouts on a fresh schema, resets ``pg_stat_statements``, runs
W1's lifecycle with R runners (claim, sequence ids, ``add_many_spans`` of 10, succeed) and reads
every rollout's spans back (``query_spans(rid, "latest")``), then reports the statements the
server executed per lifecycle (every statement of this database, sweeps, waits and LISTEN included;
``BEGIN``/``COMMIT`` count as statements) and the most frequent ones.  It also counts the
``call_soon_threadsafe`` wake-ups of every event loop of the process meanwhile (the callers' loop
waking the I/O thread, and the I/O thread settling callers), per store call.  The wrapper is
installed for the measurement only and calls the original.  No figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import asyncpg

from benchmarks import targets as tg
from benchmarks.payload import SpanFactory
from benchmarks.workloads import check_claims, runner_loop

CALLS_PER_LIFECYCLE = 5  # dequeue, sequence ids, add_many_spans, update_attempt, query_spans


@contextlib.contextmanager
def counting_wakeups(counter: list[int]) -> Iterator[None]:
    """``counter[0]`` counts every ``call_soon_threadsafe`` of any event loop meanwhile."""
    original = asyncio.BaseEventLoop.call_soon_threadsafe

    def wrapped(self: Any, callback: Any, *args: Any, context: Any = None) -> Any:
        counter[0] += 1
        return original(self, callback, *args, context=context)

    asyncio.BaseEventLoop.call_soon_threadsafe = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        asyncio.BaseEventLoop.call_soon_threadsafe = original  # type: ignore[method-assign]


async def _server_counts(conn: Any) -> list[tuple[str, int]]:
    rows = await conn.fetch(
        "SELECT query, calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
        " WHERE d.datname = current_database() AND query NOT ILIKE '%pg_stat_statements%'"
        " ORDER BY calls DESC"
    )
    return [(row["query"], int(row["calls"])) for row in rows]


async def measure(runners: int, n: int) -> list[str]:
    dsn = tg.pg_dsn()
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        with tempfile.TemporaryDirectory(prefix="statements-") as workdir:
            async with tg.open_target("postgres", workdir) as target:
                store = target.store
                factory = SpanFactory(target.span_cls, False)
                await store.enqueue_many_rollouts([target.request_cls(input={"i": i}) for i in range(n)])
                claimed: list[str] = []
                wakeups = [0]
                await admin.execute("SELECT pg_stat_statements_reset()")
                with counting_wakeups(wakeups):
                    await asyncio.gather(
                        *(runner_loop(store, factory, f"runner-{i}", 10, True, claimed) for i in range(runners))
                    )
                    for rid in claimed:
                        await store.query_spans(rid, "latest")
                counts = await _server_counts(admin)
    finally:
        await admin.close()
    total = sum(calls for _query, calls in counts)
    lines = [
        f"R={runners}, N={n}: {total / n:.2f} statements per lifecycle (server-counted),"
        f" {wakeups[0] / (n * CALLS_PER_LIFECYCLE):.2f} cross-thread wake-ups per call"
    ]
    for query, calls in counts[:8]:
        lines.append(f"  {calls / n:6.2f} x  {' '.join(query.split())[:110]}")
    lines += [f"  PROBLEM: {p}" for p in check_claims(claimed, n, "statements")]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.statements", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", default="1,8", help="comma-separated runner counts")
    parser.add_argument("--n", type=int, default=300, help="lifecycles per runner count")
    args = parser.parse_args(argv)
    for runners in (int(r) for r in args.runners.split(",")):
        print("\n".join(asyncio.run(measure(runners, args.n))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
