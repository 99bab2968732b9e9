"""Per-call cost of the lifecycle's calls: where a W1/W2 gap to B1 comes from.

``python -m benchmarks.percall [--backend sqlite|postgres|all] [--runners 8] [--n 2000] [--repeat 3]``

For each target (the store on each backend, and B1 when agentlightning is installed) it fills a
queue of N rollouts, then runs each call of the lifecycle as its own phase with R concurrent callers
(every caller loops over its share of the claimed rollouts): ``dequeue_rollout``,
``get_many_span_sequence_ids`` (11 ids), ``add_many_spans`` (10 spans), ``add_span``,
``update_attempt`` and ``query_spans(rid, "latest")``.  It prints, per call, the throughput, the
wall time per call (1 / throughput: what a lifecycle adds up) and the process CPU per call, with
the medians of the repetitions and the ratio of each target's wall time per call to B1's.  Targets
alternate inside each repetition.  No figure is asserted anywhere: this is a diagnostic.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks import targets as tg
from benchmarks.payload import SpanFactory
from benchmarks.workloads import median

CALLS = ("dequeue_rollout", "span_sequence_ids(11)", "add_many_spans(10)", "add_span", "update_attempt", "query_spans")


def process_cpu() -> float:
    """This process's CPU time so far (user + system), in seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _phase(callers: int, calls: Sequence[Callable[[], Awaitable[Any]]]) -> tuple[float, float]:
    """Run ``calls`` with ``callers`` concurrent loops; (calls per second, CPU seconds per call)."""
    pending = iter(calls)

    async def loop() -> None:
        for call in pending:
            await call()

    cpu, started = process_cpu(), time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(callers)))
    elapsed, used = time.perf_counter() - started, process_cpu() - cpu
    return len(calls) / elapsed, used / len(calls)


async def measure(target: tg.Target, n: int, callers: int) -> dict[str, tuple[float, float]]:
    """Each call's (calls/s, CPU s per call) on ``target``; checks that every rollout was claimed once."""
    store = target.store
    factory = SpanFactory(target.span_cls, False)
    await store.enqueue_many_rollouts([target.request_cls(input={"task": i}) for i in range(n)])
    claimed: list[Any] = []
    sequence_ids: dict[str, list[int]] = {}

    async def claim() -> None:
        ar = await store.dequeue_rollout(worker_id="percall")
        if ar is not None:
            claimed.append(ar)

    out = {"dequeue_rollout": await _phase(callers, [claim] * n)}
    ids = [ar.rollout_id for ar in claimed]
    if len(claimed) != n or len(set(ids)) != n:
        raise RuntimeError(f"percall: {len(set(ids))} distinct rollouts claimed of {n}")
    pairs = [(ar.rollout_id, ar.attempt.attempt_id) for ar in claimed]

    def reserve(pair: tuple[str, str]) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            sequence_ids[pair[0]] = list(await store.get_many_span_sequence_ids([pair] * 11))

        return call

    out["span_sequence_ids(11)"] = await _phase(callers, [reserve(p) for p in pairs])

    def spans(pair: tuple[str, str], first: int, count: int) -> list[Any]:
        return [factory.make(pair[0], pair[1], seq) for seq in sequence_ids[pair[0]][first : first + count]]

    batches = [spans(p, 0, 10) for p in pairs]
    out["add_many_spans(10)"] = await _phase(callers, [lambda b=b: store.add_many_spans(b) for b in batches])
    singles = [spans(p, 10, 1)[0] for p in pairs]
    out["add_span"] = await _phase(callers, [lambda s=s: store.add_span(s) for s in singles])
    out["update_attempt"] = await _phase(
        callers, [lambda p=p: store.update_attempt(p[0], p[1], status="succeeded") for p in pairs]
    )
    read: list[int] = []

    async def query(rid: str) -> None:
        read.append(len(await store.query_spans(rid, "latest")))

    out["query_spans"] = await _phase(callers, [lambda r=r: query(r) for r in ids])
    if read != [11] * n:
        raise RuntimeError(f"percall: query_spans returned {sorted(set(read))} spans, expected 11 each")
    return out


async def run(backends: Sequence[str], n: int, callers: int, repeat: int) -> dict[str, dict[str, list[tuple[float, float]]]]:
    names = list(backends)
    available, _why = tg.agentlightning_available()
    if available:
        names.append("B1")
    if "postgres" in names:
        ok, why = await tg.postgres_available()
        if not ok:
            print(f"note: PostgreSQL skipped ({why})")
            names.remove("postgres")
    results: dict[str, dict[str, list[tuple[float, float]]]] = {name: {call: [] for call in CALLS} for name in names}
    with tempfile.TemporaryDirectory(prefix="percall-") as workdir:
        for _ in range(repeat):
            for name in names:  # targets alternate inside each repetition
                async with tg.open_target(name, workdir) as target:
                    for call, figures in (await measure(target, n, callers)).items():
                        results[name][call].append(figures)
    return results


def report(results: dict[str, dict[str, list[tuple[float, float]]]], callers: int, n: int) -> list[str]:
    lines = [f"per-call cost, {callers} concurrent callers, N={n} (medians of the repetitions)"]
    reference = results.get("B1")
    for name, calls in results.items():
        lines.append(f"  {name}")
        lines.append(f"    {'call':24s} {'calls/s':>9s} {'wall us':>8s} {'cpu us':>7s} {'wall / B1':>9s}")
        total = ref_total = 0.0
        for call, figures in calls.items():
            rate = median([f[0] for f in figures])
            cpu = median([f[1] for f in figures]) * 1e6
            wall = 1e6 / rate
            ratio = ""
            if reference is not None:
                ref_wall = 1e6 / median([f[0] for f in reference[call]])
                ratio = f"{wall / ref_wall:8.2f}x"
                if call != "add_span":
                    ref_total += ref_wall
            if call != "add_span":
                total += wall
            lines.append(f"    {call:24s} {rate:9,.0f} {wall:8.0f} {cpu:7.0f} {ratio:>9s}")
        tail = f" (B1 {ref_total:.0f} us: {ref_total / total:.2f}x of B1's rate)" if reference is not None else ""
        lines.append(f"    W1 lifecycle (all but add_span): {total:.0f} us of wall time per rollout{tail}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.percall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres", "all"), default="all")
    parser.add_argument("--runners", type=int, default=8, help="concurrent callers")
    parser.add_argument("--n", type=int, default=2000, help="rollouts (calls per phase)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    backends = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]
    results = asyncio.run(run(backends, args.n, args.runners, args.repeat))
    print("\n".join(report(results, args.runners, args.n)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
