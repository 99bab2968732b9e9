"""The benchmark code runs end to end (so it cannot rot); its figures are never asserted here."""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import weakref

import pytest

from benchmarks import p0
from benchmarks import targets as tg
from benchmarks.runner import CaseResult, _collector_settled, format_case, run_benchmarks
from benchmarks.workloads import (
    SIZES,
    Case,
    CollectorTime,
    Measurement,
    check_sequence_ids,
    dequeue_contention,
    lifecycle,
    p0_claims,
    p0_readback,
    readback_spans,
    trace_pages,
)
from tests.conftest import BackendSpec

TINY = dataclasses.replace(SIZES["small"], lifecycle_n=20, spans_per_rollout=3, dequeue_n=40, readback_rollouts=12)


async def test_lifecycle_workload_runs_and_checks_on_sqlite() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target("sqlite", workdir) as target:
            m = await lifecycle(target, TINY, runners=4, batch=True)
    assert m.problems == []
    assert m.metrics["rollouts/s"] > 0
    assert m.metrics["spans/s"] == pytest.approx(m.metrics["rollouts/s"] * 3)


async def test_dequeue_workload_and_p0_agree_on_what_was_claimed() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target("sqlite", workdir) as target:
            store_run = await dequeue_contention(target, TINY, claimers=4)
        async with tg.open_target("sqlite", workdir) as target:
            raw_run = await p0_claims(target, TINY)
    for m in (store_run, raw_run):
        assert m.problems == []
        assert m.metrics["duplicates"] == 0
        assert m.metrics["claims/s"] > 0


async def test_readback_workload_and_p0_read_the_same_spans() -> None:
    """W6's P0 (the raw driver's SELECT) returns, rollout by rollout, the sequence ids that
    ``query_spans(rid, "latest")`` returns, and both runs pass their checks."""
    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target("sqlite", workdir) as target:
            store_run = await readback_spans(target, TINY)
        async with tg.open_target("sqlite", workdir) as target:
            raw_run = await p0_readback(target, TINY)
            rollouts = await target.store.query_rollouts()
            ids = [r.rollout_id for r in rollouts]
            raw = p0.sqlite_readback_loop(target.extra["path"], await p0.run_id_of(target), ids)
            for rid in ids:
                spans = await target.store.query_spans(rid, "latest")
                assert raw["sequences"][rid] == [sp.sequence_id for sp in spans] == [1, 2, 3]
    assert len(ids) == TINY.readback_rollouts
    for m in (store_run, raw_run):
        assert m.problems == []
        assert m.metrics["rollouts/s"] > 0


class _OffsetIgnoringStore:
    """A store whose ``query_spans`` drops the offset: the first page for any page."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def query_spans(self, *args: object, offset: int = 0, **kwargs: object) -> object:
        return await self._inner.query_spans(*args, **kwargs)  # type: ignore[attr-defined]


async def _check_trace_pages(backend: str) -> None:
    """W6's long trace read a page at a time: each page is checked against its offset and the
    trace's total; a store that ignores the offset is reported."""
    size = dataclasses.replace(TINY, trace_spans=60, trace_pages=6)
    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target(backend, workdir) as target:
            good = await trace_pages(target, size)
        async with tg.open_target(backend, workdir) as target:
            target.store = _OffsetIgnoringStore(target.store)
            bad = await trace_pages(target, size)
    assert good.problems == [] and good.metrics["pages/s"] > 0
    assert bad.problems and all(p.startswith("page at offset") for p in bad.problems), bad.problems


async def test_trace_pages_workload_checks_every_page_on_sqlite() -> None:
    await _check_trace_pages("sqlite")


@pytest.mark.postgres
async def test_trace_pages_workload_checks_every_page_on_postgres(pg_backend: BackendSpec) -> None:
    """(``pg_backend``: PostgreSQL must answer; a page at an offset reads its ids first there.)"""
    await _check_trace_pages("postgres")


def test_sequence_checks_report_missing_and_unordered_spans() -> None:
    assert check_sequence_ids([1, 2, 3], 3, "ro-1") is None
    assert "returned 2 spans, expected 3" in (check_sequence_ids([1, 2], 3, "ro-1") or "")
    assert "not in sequence_id order" in (check_sequence_ids([2, 1, 3], 3, "ro-1") or "")


async def test_checks_catch_a_store_that_double_claims() -> None:
    """The correctness checks are live: a store that hands one rollout to two runners is reported."""

    class DoubleClaimingStore:
        def __init__(self, inner: object) -> None:
            self._inner = inner
            self._last = None

        def __getattr__(self, name: str) -> object:
            return getattr(self._inner, name)

        async def dequeue_rollout(self, worker_id: str | None = None) -> object:
            ar = await self._inner.dequeue_rollout(worker_id=worker_id)  # type: ignore[attr-defined]
            if ar is None and self._last is not None:
                ar, self._last = self._last, None  # hand the last rollout out once more
                return ar
            self._last = ar
            return ar

    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target("sqlite", workdir) as target:
            target.store = DoubleClaimingStore(target.store)
            m = await lifecycle(target, TINY, runners=1, batch=True)
    assert any("claimed more than once" in p for p in m.problems), m.problems


async def test_runner_reports_medians_ratios_and_failed_checks() -> None:
    lines: list[str] = []
    report = await run_benchmarks(["W4"], backend="sqlite", repeat=1, size="small", baselines=False, echo=lines.append)
    assert report.problems == []
    w4_r8 = next(r for r in report.results if r.case.label == "dequeue R=8")
    assert set(w4_r8.runs) == {"sqlite", "P0-sqlite"}
    ratio = w4_r8.ratio("sqlite", "P0")
    assert ratio is not None and ratio > 0
    assert any("sqlite/P0 =" in line for line in lines)
    assert "note: collector: a full collection before each measurement (outside its timing)" in lines
    assert all(m.metrics["gc_young_ms"] >= 0 and m.metrics["gc_full_ms"] >= 0 for m in w4_r8.runs["sqlite"])

    failing = CaseResult(Case("W1", "fake", lifecycle, ("sqlite",)))
    failing.runs["sqlite"] = [Measurement({"rollouts/s": 1.0}, ["boom"])]
    assert format_case(failing)[0] == "W1 fake"


def test_collector_time_counts_young_and_full_collections_apart() -> None:
    with CollectorTime() as collector:
        _cyclic_garbage()
        gc.collect(0)
        young = collector.young
        gc.collect()
    assert young > 0 and collector.young == young and collector.full > 0
    gc.collect()
    assert (collector.young, collector.full) == (young, collector.full)  # stopped with its block


class _Garbage:
    """An object in a reference cycle: only a collection of the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cyclic_garbage() -> weakref.ref[_Garbage]:
    return weakref.ref(_Garbage())


@pytest.mark.parametrize("collect", [True, False])
def test_each_measurement_starts_from_a_collected_heap_unless_told_not_to(collect: bool) -> None:
    """What the target measured before leaves behind is collected before the next measurement
    starts (outside its timing); ``--no-collect`` leaves it for the next target to pay."""
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free the cycle behind the test's back
    try:
        left_behind = _cyclic_garbage()
        assert left_behind() is not None
        with _collector_settled(freeze=False, collect=collect):
            assert (left_behind() is None) is collect
    finally:
        if enabled:
            gc.enable()


async def test_the_report_says_when_the_collector_was_left_alone() -> None:
    lines: list[str] = []
    await run_benchmarks(["W3"], backend="sqlite", repeat=1, size="small", baselines=False, collect_gc=False, echo=lines.append)
    assert "note: collector: no full collection between measurements (--no-collect)" in lines


async def test_per_call_diagnostic_runs_and_reports() -> None:
    from benchmarks import percall

    with tempfile.TemporaryDirectory() as workdir:
        async with tg.open_target("sqlite", workdir) as target:
            figures = await percall.measure(target, 12, 3)
    assert list(figures) == list(percall.CALLS)
    assert all(rate > 0 and cpu >= 0 for rate, cpu in figures.values())
    lines = percall.report({"sqlite": {call: [f] for call, f in figures.items()}}, 3, 12)
    assert lines[1].strip() == "sqlite" and "W1 lifecycle" in lines[-1]


@pytest.mark.parametrize("batch", [False, True])
async def test_growth_diagnostic_runs_its_phases_and_checks_them(batch: bool) -> None:
    from benchmarks import growth

    results = await growth.run("sqlite", analyze=True, phases=2, per_phase=8, runners=3, batch=batch)
    assert [size for size, _rate, _problems in results] == [8, 16]
    assert all(rate > 0 and problems == [] for _size, rate, problems in results)


@pytest.mark.postgres
async def test_growth_diagnostic_after_an_earlier_run(pg_backend: BackendSpec) -> None:
    """(``pg_backend``: PostgreSQL must answer; the benchmark makes its own schema.)"""
    from benchmarks import growth

    results = await growth.run("postgres", analyze=True, after_run=12, phases=1, per_phase=8, runners=3, batch=False)
    assert [size for size, _rate, _problems in results] == [8]  # the earlier run is not counted
    assert all(rate > 0 and problems == [] for _size, rate, problems in results)


@pytest.mark.postgres
async def test_cookbook_plans_diagnostic_times_every_block_both_ways(pg_backend: BackendSpec) -> None:
    """(``pg_backend``: PostgreSQL must answer; the diagnostic makes and drops its own schema.)"""
    from benchmarks import cookbook_plans
    from tests.analysis.test_cookbook import BLOCKS

    sizes, results = await cookbook_plans.run(samples=6, repeat=2)
    assert sizes["rollouts"] > 12 and sizes["spans"] > 0
    assert set(results) == {b for b, dialect, _ in BLOCKS if dialect in ("both", "postgresql")}
    assert all(set(ms) == {"unsampled", "sampled", "same plan"} and min(ms.values()) >= 0 for ms in results.values())
    lines = cookbook_plans.report(sizes, results)
    assert lines[-1].startswith("total") and len(lines) == len(results) + 3


@pytest.mark.postgres
async def test_inflight_diagnostic_counts_the_statements_and_restores_the_driver(pg_backend: BackendSpec) -> None:
    """(``pg_backend``: PostgreSQL must answer; the benchmark makes its own schema.)"""
    from asyncpg.prepared_stmt import PreparedStatement

    from benchmarks import inflight

    original = PreparedStatement.fetch
    measured = await inflight.measure(runners=3, n=12)
    assert PreparedStatement.fetch is original
    assert measured.problems == [] and measured.wall > 0 and measured.cpu > 0
    assert 0 < measured.flight.busy <= measured.wall
    # Every lifecycle's claim, sequence ids, spans and update went through a fetch.
    assert sum(measured.flight.counts.values()) >= 12
    assert all(measured.flight.seconds[kind] > 0 for kind in measured.flight.counts)
    lines = inflight.report([measured], 3)
    assert "R=3" in lines[0] and "in flight" in lines[1]


async def test_phases_diagnostic_times_each_phase_and_checks_the_claims() -> None:
    from benchmarks import phases

    measured = await phases.measure("sqlite", runners=3, n=12, spans=3)
    assert measured.problems == [] and list(measured.phases) == list(phases.PHASES)
    assert all(p.wall > 0 and p.client >= 0 and p.young_gc >= 0 for p in measured.phases.values())
    lines = phases.report([measured], 3)
    assert "R=3" in lines[0] and lines[1].split()[0] == "sqlite" and "read-back" in lines[1]


@pytest.mark.parametrize("with_reader", [False, True])
async def test_the_stall_probe_runs_beside_the_lifecycle(with_reader: bool) -> None:
    from benchmarks import stall

    m = await stall.measure("sqlite", 20, 300, with_reader)
    assert m["problems"] == []
    assert m["max_ms"] >= m["p99_ms"] >= 0
    assert (m["reads"] > 0) == with_reader


def test_the_wakeup_counter_counts_and_restores() -> None:
    import asyncio

    from benchmarks.statements import counting_wakeups

    original = asyncio.BaseEventLoop.call_soon_threadsafe
    counter = [0]

    async def two_wakeups() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        loop.call_soon_threadsafe(lambda: None)
        loop.call_soon_threadsafe(done.set)
        await done.wait()

    with counting_wakeups(counter):
        asyncio.run(two_wakeups())
    assert counter[0] >= 2
    assert asyncio.BaseEventLoop.call_soon_threadsafe is original
