"""Whether a call's cost grows with the run: W1 / W2's lifecycle in phases on ONE growing run.

``python -m benchmarks.growth [--backend sqlite|postgres] [--phases 8] [--per-phase 1000]
[--runners 8] [--batch] [--no-analyze] [--after-run N]``

One store, one run: each phase enqueues ``--per-phase`` rollouts and runs ``--runners`` runners
(W2's single-span adds, or W1's ``add_many_spans`` with ``--batch``) until the queue is empty, and
prints the phase's rollouts/s and the run's size.  A flat line means a call costs the same at any
size of the run; a falling one, that something scans the run.  ``--no-analyze`` opens the store with
``analyze_check_seconds=None`` (PostgreSQL: no ANALYZE of the run tables by the store, ADR 0006).
``--after-run N`` first runs an earlier run of N rollouts in the same database and analyses the
tables (PostgreSQL, as autovacuum would), so the measured run starts in tables whose statistics
know only the earlier run (ADR 0007).
The correctness checks of W1 (every rollout claimed once) run on every phase.  No figure is
asserted anywhere: this is a diagnostic.
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


async def phases(
    store: Any, span_cls: Any, request_cls: Any, *, phases: int, per_phase: int, runners: int, batch: bool
) -> list[tuple[int, float, list[str]]]:
    """Each phase's (rollouts in the run after it, rollouts/s, problems)."""
    factory = SpanFactory(span_cls, False)
    out = []
    for k in range(phases):
        claimed: list[str] = []
        started = time.perf_counter()
        requests = [request_cls(input={"phase": k, "i": i}) for i in range(per_phase)]
        await store.enqueue_many_rollouts(requests)
        await asyncio.gather(*(runner_loop(store, factory, f"runner-{i}", 10, batch, claimed) for i in range(runners)))
        rate = per_phase / (time.perf_counter() - started)
        out.append(((k + 1) * per_phase, rate, check_claims(claimed, per_phase, f"phase {k}")))
    return out


async def run(
    backend: str, *, analyze: bool, after_run: int = 0, **kwargs: Any
) -> list[tuple[int, float, list[str]]]:
    with tempfile.TemporaryDirectory(prefix="growth-") as workdir:
        options = {} if analyze else {"analyze_check_seconds": None}
        async with tg.open_target(backend, workdir, **options) as target:
            if after_run:
                await _earlier_run(target, after_run, runners=kwargs["runners"], batch=kwargs["batch"])
            return await phases(target.store, target.span_cls, target.request_cls, **kwargs)


async def _earlier_run(target: tg.Target, n: int, *, runners: int, batch: bool) -> None:
    """Run ``n`` rollouts to the end in another run of the target's database, then (PostgreSQL)
    ANALYZE the run tables, as autovacuum would."""
    from lightning_sql import SqlLightningStore

    _kind, url, schema = target.remote or ("", "", None)
    options = {"schema": schema} if schema else {}
    async with SqlLightningStore(url, run="earlier", analyze_check_seconds=None, **options) as earlier:
        await phases(earlier, target.span_cls, target.request_cls, phases=1, per_phase=n, runners=runners, batch=batch)
    if schema:
        import asyncpg

        conn = await asyncpg.connect(tg.pg_dsn(url))
        try:
            await conn.execute(f'ANALYZE "{schema}".rollouts, "{schema}".attempts, "{schema}".spans')
        finally:
            await conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.growth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="postgres")
    parser.add_argument("--phases", type=int, default=8)
    parser.add_argument("--per-phase", type=int, default=1000)
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--batch", action="store_true", help="W1's add_many_spans instead of W2's add_span")
    parser.add_argument("--no-analyze", action="store_true", help="analyze_check_seconds=None (ADR 0006)")
    parser.add_argument("--after-run", type=int, default=0, metavar="N", help="an earlier, analysed run of N first")
    args = parser.parse_args(argv)
    results = asyncio.run(
        run(
            args.backend,
            analyze=not args.no_analyze,
            after_run=args.after_run,
            phases=args.phases,
            per_phase=args.per_phase,
            runners=args.runners,
            batch=args.batch,
        )
    )
    kind = "W1 (add_many_spans)" if args.batch else "W2 (add_span)"
    after = f", after an analysed run of {args.after_run:,d}" if args.after_run else ""
    print(f"{kind} on {args.backend}, {args.runners} runners, one run growing by {args.per_phase} per phase{after}")
    problems = []
    for size, rate, found in results:
        print(f"  run of {size:7,d} rollouts: {rate:8.1f} rollouts/s")
        problems += found
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
