"""Runs the cases, interleaving targets inside each repetition, and reports medians and ratios."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from benchmarks import targets as tg
from benchmarks.workloads import (
    SIZES,
    Case,
    CollectorTime,
    Measurement,
    RssSampler,
    Size,
    cases,
    median,
    scaled,
)

# (workload, case label prefix, target, reference) -> (comparison, goal)
GOALS: dict[tuple[str, str, str, str], tuple[str, float]] = {
    ("W1", "", "sqlite", "B1"): (">=", 1.3),
    ("W1", "lifecycle-batch R=8", "postgres", "B1"): (">=", 0.8),
    ("W1", "lifecycle-batch R=32", "postgres", "B1"): (">=", 1.0),
    ("W2", "", "sqlite", "B1"): (">=", 1.0),
    ("W2", "", "postgres", "B1"): (">=", 0.6),
    ("W4", "dequeue R=8", "postgres", "P0"): (">=", 1.0),
    ("W4", "dequeue R=8", "sqlite", "P0"): (">=", 1.0),
    # docs/performance.md's two read-backs (the long trace read a page at a time is a case of ours: no goal)
    ("W6", "query_spans x", "sqlite", "P0"): (">=", 0.5),
    ("W6", "query_spans x", "postgres", "P0"): (">=", 0.5),
    ("W6", "query_rollouts", "sqlite", "B1"): (">=", 0.5),
    ("W6", "query_rollouts", "postgres", "B1"): (">=", 0.5),
    ("W7", "scale-out P=4", "postgres", "B2"): (">=", 10.0),
    ("W8", "", "sqlite", "growth"): ("<=", 1.2),
    ("W8", "", "postgres", "growth"): ("<=", 1.2),
}


def goal_for(case: Case, target: str, reference: str) -> tuple[str, float] | None:
    for (workload, prefix, t, r), goal in GOALS.items():
        if workload == case.workload and case.label.startswith(prefix) and t == target and r == reference:
            return goal
    return None


@dataclass
class CaseResult:
    case: Case
    # target -> one Measurement per repetition (with "peak_rss_mb" added)
    runs: dict[str, list[Measurement]] = field(default_factory=dict)

    def medians(self, target: str) -> dict[str, float]:
        runs = self.runs.get(target, [])
        keys = list(runs[0].metrics) if runs else []
        return {k: median([m.metrics[k] for m in runs if k in m.metrics]) for k in keys}

    def ratio(self, target: str, reference: str) -> float | None:
        """Median over repetitions of target headline / reference headline (same repetition)."""
        if reference == "growth":
            runs = self.runs.get(target, [])
            return median([m.metrics["rss_growth"] for m in runs]) if runs else None
        ref = f"P0-{target}" if reference == "P0" else reference
        mine, theirs = self.runs.get(target, []), self.runs.get(ref, [])
        if not mine or not theirs:
            return None
        key = next(iter(mine[0].metrics))
        per_rep = [
            a.metrics[key] / b.metrics[key] for a, b in zip(mine, theirs, strict=False) if b.metrics.get(key)
        ]
        return median(per_rep) if per_rep else None

    def references(self) -> list[str]:
        refs = list(self.case.references)
        if self.case.workload == "W8":
            refs = ["growth"]
        return [r.replace("P0-sqlite", "P0").replace("P0-postgres", "P0") for r in dict.fromkeys(refs)]


@dataclass
class Report:
    size: str
    repeat: int
    results: list[CaseResult]
    notes: list[str]
    problems: list[str]
    started: str
    machine: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "size": self.size,
            "repeat": self.repeat,
            "started": self.started,
            "machine": self.machine,
            "notes": self.notes,
            "problems": self.problems,
            "cases": [],
        }
        for res in self.results:
            entry: dict[str, Any] = {"workload": res.case.workload, "case": res.case.label, "targets": {}, "ratios": {}}
            for target in res.runs:
                entry["targets"][target] = {"median": res.medians(target), "runs": [m.metrics for m in res.runs[target]]}
            for target in tg.SQL_TARGETS:
                for ref in res.references():
                    r = res.ratio(target, ref)
                    if r is not None:
                        entry["ratios"][f"{target}/{ref}"] = {"value": r, "goal": goal_for(res.case, target, ref)}
            out["cases"].append(entry)
        return out


def machine_info() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }


@contextlib.contextmanager
def _collector_settled(freeze: bool, collect: bool = True) -> Any:
    """Before each measurement, outside its timing: a full collection (``collect``, the default),
    so that every target starts from the same heap and pays only for the collections its own
    allocations trigger; with ``freeze`` (``--freeze-gc``) what then lives is also frozen out of
    the collector's reach for the measurement.

    This process holds ~0.7 million objects before any store exists (agentlightning's import graph:
    litellm, openai, ...).  Every full collection walks them, about half a second, and CPython starts one
    when the objects promoted since the last one exceed a quarter of the heap.  Without a collection
    between targets, what the previous target left (B1 keeps every span it was given; B2's server
    as much, plus its HTTP objects) counts towards that quarter, and the full collection lands in
    whichever target allocates next, and that target looks slower for work it did not do.
    ``--no-collect`` measures that way.  A real process of either store holds its imports too, so
    even the default measures with them; frozen, a collection during a measurement walks only what
    the measurement made (a diagnostic)."""
    if freeze or collect:
        gc.collect()
    if not freeze:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _run_one(
    case: Case, target_name: str, size: Size, workdir: str, *, freeze_gc: bool = False, collect_gc: bool = True
) -> Measurement:
    with _collector_settled(freeze_gc, collect_gc):
        return await _run_one_settled(case, target_name, size, workdir)


async def _run_one_settled(case: Case, target_name: str, size: Size, workdir: str) -> Measurement:
    if not case.opens_store:
        placeholder = tg.Target(target_name, None, object, object)
        with RssSampler() as rss:
            m = await case.run(placeholder, size)
        return m
    open_name = target_name.removeprefix("P0-")
    async with tg.open_target(open_name, workdir) as target:
        with RssSampler() as rss, CollectorTime() as collector:
            if target_name.startswith("P0-"):
                if case.p0 is None:
                    raise ValueError(f"{case.workload} {case.label} has no P0 run")
                m = await case.p0(target, size)
            else:
                m = await case.run(target, size)
    m.metrics["peak_rss_mb"] = rss.peak_mb
    if case.in_process:
        # The whole case (its set-up and checks too): what the collector cost the target's process.
        m.metrics["gc_young_ms"] = collector.young * 1000
        m.metrics["gc_full_ms"] = collector.full * 1000
    return m


def _fmt(value: float) -> str:
    if value != value:
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def format_case(res: CaseResult) -> list[str]:
    lines = [f"{res.case.workload} {res.case.label}"]
    keys: list[str] = []
    for target in res.runs:
        for k in res.medians(target):
            if k not in keys:
                keys.append(k)
    lines.append("  " + f"{'target':<12}" + "".join(f"{k:>16}" for k in keys))
    for target in res.runs:
        med = res.medians(target)
        lines.append("  " + f"{target:<12}" + "".join(f"{_fmt(med.get(k, float('nan'))):>16}" for k in keys))
    ratios = []
    for target in tg.SQL_TARGETS:
        for ref in res.references():
            r = res.ratio(target, ref)
            if r is None:
                continue
            goal = goal_for(res.case, target, ref)
            text = f"{target}/{ref} = {r:.2f}x"
            if goal is not None:
                op, value = goal
                met = r >= value if op == ">=" else r <= value
                text += f" (goal {op} {value}: {'met' if met else 'MISSED'})"
            ratios.append(text)
    if ratios:
        lines.append("  ratios (median of per-repetition ratios): " + "; ".join(ratios))
    for target, runs in res.runs.items():
        for note in dict.fromkeys(n for m in runs for n in m.notes):
            lines.append(f"  note [{target}]: {note}")
    return lines


async def run_benchmarks(
    workloads: Sequence[str] = (),
    backend: str = "all",
    repeat: int = 3,
    size: str = "small",
    *,
    scale: float = 1.0,
    baselines: bool = True,
    freeze_gc: bool = False,
    collect_gc: bool = True,
    echo: Callable[[str], None] = print,
) -> Report:
    """Run the workloads and return the report (``report.problems`` lists every failed check)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    knobs = scaled(SIZES[size], scale)
    all_cases = cases(knobs)
    selected = [w.upper() for w in workloads] or list(all_cases)
    unknown = [w for w in selected if w not in all_cases]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(all_cases)}")
    notes: list[str] = []
    available: set[str] = set()
    if backend in ("sqlite", "all"):
        available |= {"sqlite", "P0-sqlite"}
    if backend in ("postgres", "all"):
        ok, why = await tg.postgres_available()
        if ok:
            available |= {"postgres", "P0-postgres"}
        elif backend == "postgres":
            raise RuntimeError(why)
        else:
            notes.append(f"PostgreSQL skipped: {why}")
    if baselines:
        ok, why = tg.agentlightning_available()
        if ok:
            available |= {"B1", "B2"}
        else:
            notes.append(f"Baselines B1/B2 skipped: {why}")
    else:
        notes.append("Baselines B1/B2 skipped: disabled by the caller")
    if freeze_gc:
        notes.append("collector: a full collection, then the living objects frozen, before each measurement (--freeze-gc)")
    elif not collect_gc:
        notes.append("collector: no full collection between measurements (--no-collect)")
    else:
        notes.append("collector: a full collection before each measurement (outside its timing)")
    for note in notes:
        echo(f"note: {note}")

    results = {(c.workload, c.label): CaseResult(c) for w in selected for c in all_cases[w]}
    problems: list[str] = []
    started = datetime.datetime.now().isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="lightning-sql-bench-") as workdir:
        for rep in range(repeat):
            for w in selected:
                for case in all_cases[w]:
                    names = [t for t in case.targets if t in available]
                    if not names:
                        continue
                    shift = rep % len(names)  # interleave: a different target goes first each repetition
                    for name in names[shift:] + names[:shift]:
                        try:
                            m = await _run_one(case, name, knobs, workdir, freeze_gc=freeze_gc, collect_gc=collect_gc)
                        except Exception as exc:  # noqa: BLE001 - a crash is a failed check, not a hang
                            m = Measurement({}, [f"crashed: {type(exc).__name__}: {exc}"])
                        results[(case.workload, case.label)].runs.setdefault(name, []).append(m)
                        for problem in m.problems:
                            problems.append(f"[rep {rep + 1}] {case.workload} {case.label} on {name}: {problem}")
                        head = next(iter(m.metrics.items()), ("-", float("nan")))
                        flag = "" if not m.problems else "  CHECK FAILED: " + "; ".join(m.problems[:3])
                        echo(f"[rep {rep + 1}/{repeat}] {case.workload} {case.label:<40} {name:<12} {head[0]}={_fmt(head[1])}{flag}")
    label = size if scale == 1 else f"{size} x{scale:g}"
    report = Report(label, repeat, list(results.values()), notes, problems, started, machine_info())
    for res in report.results:
        if res.runs:
            echo("")
            for line in format_case(res):
                echo(line)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help="W1..W8 (default: all)")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "all"), default="all")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every work count of the size")
    parser.add_argument("--no-baselines", action="store_true", help="skip B1/B2 even if agentlightning is installed")
    parser.add_argument("--json", metavar="PATH", help="also write the full results as JSON")
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="collect, then freeze the living objects before each measurement (diagnostic: no full "
        "collection over the process's imports lands in a measurement)",
    )
    parser.add_argument(
        "--no-collect",
        action="store_true",
        help="no full collection before each measurement: a target may pay for the garbage of the one "
        "measured before it",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    try:
        report = asyncio.run(
            run_benchmarks(
                args.workloads,
                args.backend,
                args.repeat,
                args.size,
                scale=args.scale,
                baselines=not args.no_baselines,
                freeze_gc=args.freeze_gc,
                collect_gc=not args.no_collect,
            )
        )
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report.to_json(), fh, indent=2)
    if report.problems:
        print(f"\n{len(report.problems)} correctness check(s) FAILED:", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print("\nall correctness checks passed")
    return 0
