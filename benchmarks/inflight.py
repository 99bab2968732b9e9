"""Whether the client and the server take turns: W1's runners on PostgreSQL, statements in flight.

``python -m benchmarks.inflight [--runners 8] [--n 2000] [--repeat 2]``

Runs W1's runners' phase (claim, sequence ids, ``add_many_spans``, succeed; the queue filled
first, no read-back) on a fresh PostgreSQL schema and reports, per lifecycle, the wall time and
the client process's CPU, the share of the wall time during which at least one statement is in
flight (from asyncpg's ``Connection.fetch`` being called to its return), and each kind of
statement: how many ran and how long each was in flight on average.  A share near 70% with
exactly four statements per turn of R lifecycles is lock-step: every runner waits on the same
statement, so the client works while the server waits and the reverse; near 95%, the runners fell
into cohorts that overlap.

It wraps ``asyncpg.Connection.fetch`` (what the store's batches call) for the duration of the measurement (a
timer around the driver's call, the call itself unchanged) and restores it after.  The correctness
check of W1 (every rollout claimed once) runs on every repetition.  No figure is asserted anywhere:
this is a diagnostic.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks import targets as tg
from benchmarks.payload import SpanFactory
from benchmarks.percall import process_cpu
from benchmarks.workloads import check_claims, runner_loop


@dataclass
class Flight:
    """What the wrapped ``fetch`` saw: the time with a statement in flight, and per statement kind
    (its first words) the count and the summed time in flight."""

    busy: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)
    _open: int = 0
    _since: float = 0.0

    def started(self) -> float:
        now = time.perf_counter()
        if self._open == 0:
            self._since = now
        self._open += 1
        return now

    def ended(self, kind: str, started: float) -> None:
        now = time.perf_counter()
        self._open -= 1
        if self._open == 0:
            self.busy += now - self._since
        self.counts[kind] += 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + now - started


def _kind(query: str) -> str:
    return " ".join(query.split()[:3])[:40]


@contextlib.contextmanager
def watching(flight: Flight) -> Iterator[None]:
    """``flight`` records every asyncpg ``Connection.fetch`` of this process meanwhile."""
    from asyncpg import Connection

    original = Connection.fetch

    async def fetch(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        started = flight.started()
        try:
            return await original(self, query, *args, **kwargs)
        finally:
            flight.ended(_kind(query), started)

    Connection.fetch = fetch  # type: ignore[method-assign]
    try:
        yield
    finally:
        Connection.fetch = original  # type: ignore[method-assign]


@dataclass
class Measured:
    n: int
    wall: float
    cpu: float
    flight: Flight
    problems: list[str]


async def measure(*, runners: int, n: int) -> Measured:
    """One repetition: a fresh schema, ``n`` rollouts queued, ``runners`` runners until empty."""
    with tempfile.TemporaryDirectory(prefix="inflight-") as workdir:
        async with tg.open_target("postgres", workdir) as target:
            store = target.store
            factory = SpanFactory(target.span_cls, False)
            await store.enqueue_many_rollouts([target.request_cls(input={"i": i}) for i in range(n)])
            claimed: list[str] = []
            flight = Flight()
            gc.collect()
            with watching(flight):
                started, cpu = time.perf_counter(), process_cpu()
                await asyncio.gather(
                    *(runner_loop(store, factory, f"runner-{i}", 10, True, claimed) for i in range(runners))
                )
                wall, cpu = time.perf_counter() - started, process_cpu() - cpu
            return Measured(n, wall, cpu, flight, check_claims(claimed, n, "inflight"))


def report(results: Sequence[Measured], runners: int) -> list[str]:
    lines = [f"W1's runners on postgres, R={runners}: per lifecycle, and the statements in flight"]
    for k, m in enumerate(results, 1):
        lines.append(
            f"  repetition {k}: {1e6 * m.wall / m.n:,.0f} µs of wall time, {1e6 * m.cpu / m.n:,.0f} µs of client CPU;"
            f" a statement in flight {100 * m.flight.busy / m.wall:.0f}% of the time"
        )
        for kind, count in m.flight.counts.most_common():
            mean = 1e6 * m.flight.seconds[kind] / count
            lines.append(f"    {count:6,d} x {mean:8,.0f} µs in flight  {kind}")
        lines += [f"  PROBLEM: {p}" for p in m.problems]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--n", type=int, default=2000, help="lifecycles per repetition")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)

    async def all_repetitions() -> list[Measured]:
        return [await measure(runners=args.runners, n=args.n) for _ in range(args.repeat)]

    results = asyncio.run(all_repetitions())
    for line in report(results, args.runners):
        print(line)
    return 1 if any(m.problems for m in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
