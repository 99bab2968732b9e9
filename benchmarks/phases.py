"""Where W1's time goes, by phase: the enqueue, the runners, the read-back.

``python -m benchmarks.phases [--runners 32] [--n 2000] [--repeat 2] [--targets B1,postgres]``

Runs W1 (``enqueue_many_rollouts`` of N, R runners until the queue is empty, then
``query_spans(rid, "latest")`` for every rollout) once per target and repetition, targets
alternating inside each repetition, each on a fresh store (a fresh schema on PostgreSQL), and
reports per lifecycle and per phase: the wall time, this process's CPU, the database server's CPU
(PostgreSQL: every process named ``postgres`` on this machine, read from ``/proc`` by psutil, so
run it where nothing else uses that server), and the collector's time by generation (``gc.callbacks``:
the young collections a store's objects in flight lengthen). A full
collection runs before each target, outside the timings.  The correctness check of W1 (every
rollout claimed once) runs on every repetition.  No figure is asserted anywhere: this is a
diagnostic.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from benchmarks import targets as tg
from benchmarks.payload import SpanFactory
from benchmarks.percall import process_cpu
from benchmarks.workloads import CollectorTime, check_claims, runner_loop

PHASES = ("enqueue", "runners", "read-back")


def server_cpu() -> float:
    """The CPU seconds so far of every PostgreSQL server process on this machine (0 without any)."""
    total = 0.0
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "postgres":
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # ended meanwhile, or not ours to read
            continue
    return total


@dataclass
class Phase:
    wall: float
    client: float
    server: float
    young_gc: float
    full_gc: float


@dataclass
class Measured:
    target: str
    n: int
    phases: dict[str, Phase] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.n / sum(p.wall for p in self.phases.values())


async def measure(target_name: str, *, runners: int, n: int, spans: int = 10) -> Measured:
    """One W1 run on a fresh ``target_name`` store, timed by phase."""
    measured = Measured(target_name, n)
    with tempfile.TemporaryDirectory(prefix="phases-") as workdir:
        async with tg.open_target(target_name, workdir) as target:
            store = target.store
            factory = SpanFactory(target.span_cls, False)
            claimed: list[str] = []
            ids: list[str] = []

            async def enqueue() -> None:
                requests = [target.request_cls(input={"task": i}) for i in range(n)]
                ids.extend(r.rollout_id for r in await store.enqueue_many_rollouts(requests))

            async def run() -> None:
                await asyncio.gather(
                    *(runner_loop(store, factory, f"runner-{i}", spans, True, claimed) for i in range(runners))
                )

            async def read_back() -> None:
                for rid in ids:
                    await store.query_spans(rid, "latest")

            gc.collect()
            for name, phase in zip(PHASES, (enqueue, run, read_back), strict=True):
                with CollectorTime() as collector:
                    wall, client, server = time.perf_counter(), process_cpu(), server_cpu()
                    await phase()
                    measured.phases[name] = Phase(
                        time.perf_counter() - wall,
                        process_cpu() - client,
                        server_cpu() - server,
                        collector.young,
                        collector.full,
                    )
            measured.problems = check_claims(claimed, n, "phases")
    return measured


def report(results: Sequence[Measured], runners: int) -> list[str]:
    lines = [
        f"W1 by phase, R={runners}: µs per lifecycle of wall time / client CPU / server CPU,"
        " and the collector's young / full collections"
    ]
    for m in results:
        cells = []
        for name in PHASES:
            p = m.phases[name]
            per = 1e6 / m.n
            cells.append(
                f"{name} {p.wall * per:,.0f} / {p.client * per:,.0f} / {p.server * per:,.0f}"
                f" (gc {p.young_gc * per:,.0f} / {p.full_gc * per:,.0f})"
            )
        lines.append(f"  {m.target:<9} {m.rate:8,.0f} rollouts/s   " + "   ".join(cells))
        lines += [f"  PROBLEM: {p}" for p in m.problems]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--n", type=int, default=2000, help="lifecycles per run")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--targets", default="B1,postgres", help="comma-separated: sqlite, postgres, B1")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.targets.split(",") if name.strip()]
    if "B1" in names:
        available, why = tg.agentlightning_available()  # imports it offline, as the harness does
        if not available:
            parser.error(f"B1: {why}")

    async def all_runs() -> list[Measured]:
        return [await measure(name, runners=args.runners, n=args.n) for _ in range(args.repeat) for name in names]

    results = asyncio.run(all_runs())
    for line in report(results, args.runners):
        print(line)
    return 1 if any(m.problems for m in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
