"""The longest stall of the runners' event loop while a long trace is read beside W1.

``python -m benchmarks.stall [--backend sqlite|postgres|all] [--n 2000] [--trace-spans 10000]``

One event loop runs W1's lifecycle with 8 runners (claim, sequence ids, ``add_many_spans`` of 10,
succeed) and a probe that sleeps 1 ms at a time and records how late each wake-up comes.  Meanwhile
a reader on the same loop reads a ``--trace-spans`` trace whole with ``query_spans`` again and
again.  Reported: the longest and the 99th-percentile lateness of the probe, with the reader and
without it (the same lifecycle alone, same process), and how many trace reads ran.  The goal
(docs/performance.md) is a longest stall of at most 20 ms.  No figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import targets as tg
from benchmarks.payload import SpanFactory
from benchmarks.workloads import check_claims, runner_loop

PROBE_S = 0.001


async def _probe(stop: asyncio.Event, late: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        late.append(time.perf_counter() - started - PROBE_S)


async def _trace(store: Any, factory: SpanFactory, request_cls: Any, spans: int) -> tuple[str, str]:
    (rollout,) = await store.enqueue_many_rollouts([request_cls(input={"trace": True})])
    claimed = await store.dequeue_rollout(worker_id="tracer")
    rid, aid = claimed.rollout_id, claimed.attempt.attempt_id
    for start in range(0, spans, 500):
        await store.add_many_spans([factory.make(rid, aid, seq) for seq in range(start + 1, min(start + 500, spans) + 1)])
    await store.update_attempt(rid, aid, status="succeeded")
    assert rollout.rollout_id == rid
    return rid, aid


async def measure(backend: str, n: int, trace_spans: int, with_reader: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stall-") as workdir:
        async with tg.open_target(backend, workdir) as target:
            store = target.store
            factory = SpanFactory(target.span_cls, False)
            rid, _aid = await _trace(store, factory, target.request_cls, trace_spans)
            await store.enqueue_many_rollouts([target.request_cls(input={"i": i}) for i in range(n)])
            stop = asyncio.Event()
            late: list[float] = []
            reads = 0

            async def reader() -> None:
                nonlocal reads
                while not stop.is_set():
                    page = await store.query_spans(rid, "latest")
                    assert len(page) == trace_spans
                    reads += 1

            claimed: list[str] = []
            probe = asyncio.create_task(_probe(stop, late))
            background = asyncio.create_task(reader()) if with_reader else None
            await asyncio.gather(*(runner_loop(store, factory, f"runner-{i}", 10, True, claimed) for i in range(8)))
            stop.set()
            await probe
            if background is not None:
                await background
            late.sort()
            return {
                "max_ms": 1e3 * late[-1],
                "p99_ms": 1e3 * late[int(0.99 * (len(late) - 1))],
                "reads": reads,
                "problems": check_claims(claimed, n, "stall"),
            }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres", "all"], default="all")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--trace-spans", type=int, default=10_000)
    args = parser.parse_args(argv)
    backends = ["sqlite", "postgres"] if args.backend == "all" else [args.backend]
    status = 0
    for backend in backends:
        for with_reader in (False, True):
            m = asyncio.run(measure(backend, args.n, args.trace_spans, with_reader))
            what = f"with {m['reads']} reads of a {args.trace_spans:,}-span trace" if with_reader else "W1 alone"
            print(f"{backend:8} {what:40} longest stall {m['max_ms']:6.1f} ms, p99 {m['p99_ms']:5.1f} ms")
            for problem in m["problems"]:
                print(f"  PROBLEM: {problem}")
                status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
