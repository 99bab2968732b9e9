"""Export round trips (JSONL, CSV, Parquet), time ranges, keyset chunks and flat memory.

The memory test streams a run of LIGHTNING_SQL_EXPORT_SPANS spans (default 6000) and checks that the
export's peak allocation does not grow with the run: a fixed multiple of one chunk, far below the
size of the whole run.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from lightning_sql import analysis
from tests.analysis.dataset import MAIN_RUN, OTHER_RUN, make_span
from tests.analysis.fixtures import Populated

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")


def _spans_of(populated: Populated, run: str) -> dict[str, dict[str, Any]]:
    frame = analysis.spans(populated.url, run, schema=populated.schema)
    return {row["span_id"]: row for row in frame.to_dict("records")}


def _read_back(path: Path, fmt: str) -> list[dict[str, Any]]:
    if fmt == "jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if fmt == "csv":
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    return pd.read_parquet(path).to_dict("records")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_spans_round_trip(populated: Populated, tmp_path: Path, fmt: str) -> None:
    expected = _spans_of(populated, MAIN_RUN)
    result = analysis.export_run(
        populated.url, MAIN_RUN, tmp_path, format=fmt, tables=["spans", "rollouts", "rollout_summary_v1"],
        chunk_rows=16, schema=populated.schema,
    )
    assert result.rows["spans"] == len(expected) == populated.facts[MAIN_RUN].spans
    assert result.chunks >= len(expected) // 16
    rows = _read_back(result.files["spans"], fmt)
    assert len(rows) == len(expected)
    assert len({r["span_id"] for r in rows}) == len(rows), "keyset paging neither repeats nor skips rows"
    for row in rows:
        original = expected[row["span_id"]]
        attributes = row["attributes"] if fmt == "jsonl" else json.loads(row["attributes"])
        assert attributes == original["attributes"]
        assert float(row["start_time"]) == pytest.approx(original["start_time"])
        assert int(row["sequence_id"]) == original["sequence_id"]
        assert row["rollout_id"] == original["rollout_id"]
        expected_parent = original["parent_id"] if isinstance(original["parent_id"], str) else None
        parent = row["parent_id"] if isinstance(row["parent_id"], str) and row["parent_id"] else None
        assert parent == expected_parent
    summary = _read_back(result.files["rollout_summary_v1"], fmt)
    rewards = {r["rollout_id"]: r["final_reward"] for r in summary if r["status"] == "succeeded"}
    assert {k: float(v) for k, v in rewards.items()} == pytest.approx(populated.facts[MAIN_RUN].final_rewards)
    assert len(_read_back(result.files["rollouts"], fmt)) == populated.facts[MAIN_RUN].rollouts


def test_every_table_and_view_exports(populated: Populated, tmp_path: Path) -> None:
    result = analysis.export_run(
        populated.url, OTHER_RUN, tmp_path, format="parquet", tables=list(analysis.EXPORTABLE), chunk_rows=5,
        schema=populated.schema,
    )
    facts = populated.facts[OTHER_RUN]
    assert result.rows["llm_calls_v1"] == facts.llm_calls
    assert result.rows["rewards_v1"] == facts.rewards
    assert result.rows["attempts"] == result.rows["attempts_v1"] > 0
    for name, path in result.files.items():
        assert len(pd.read_parquet(path)) == result.rows[name], name


def test_time_range(populated: Populated, tmp_path: Path) -> None:
    everything = analysis.spans(populated.url, MAIN_RUN, schema=populated.schema)
    times = sorted(everything["start_time"])
    since, until = times[len(times) // 4], times[3 * len(times) // 4]
    expected = int(((everything["start_time"] >= since) & (everything["start_time"] < until)).sum())
    assert 0 < expected < len(times)
    result = analysis.export_run(
        populated.url, MAIN_RUN, tmp_path, tables=["spans"], since=since, until=until, chunk_rows=10,
        schema=populated.schema,
    )
    rows = _read_back(result.files["spans"], "jsonl")
    assert len(rows) == expected
    assert all(since <= r["start_time"] < until for r in rows)


def test_bad_arguments(populated: Populated, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="format='xml'"):
        analysis.export_run(populated.url, MAIN_RUN, tmp_path, format="xml", schema=populated.schema)
    with pytest.raises(ValueError, match="nope"):
        analysis.export_run(populated.url, MAIN_RUN, tmp_path, tables=["nope"], schema=populated.schema)
    with pytest.raises(analysis.UnknownRunError, match=OTHER_RUN):
        analysis.export_run(populated.url, "missing", tmp_path, schema=populated.schema)
    with pytest.raises(ValueError, match="not a time"):
        analysis.export_run(populated.url, MAIN_RUN, tmp_path, since="yesterday", schema=populated.schema)


def test_dataframe_helpers(populated: Populated) -> None:
    facts = populated.facts[MAIN_RUN]
    runs = analysis.runs(populated.url, schema=populated.schema)
    assert list(runs["name"]) == [MAIN_RUN, OTHER_RUN]
    assert len(analysis.rollouts(populated.url, MAIN_RUN, schema=populated.schema)) == facts.rollouts
    assert len(analysis.llm_calls(populated.url, MAIN_RUN, schema=populated.schema)) == facts.llm_calls
    assert len(analysis.rewards(populated.url, MAIN_RUN, schema=populated.schema)) == facts.rewards
    attempts = analysis.attempts(populated.url, MAIN_RUN, schema=populated.schema)
    assert set(attempts["error_type"].dropna()) == set(facts.error_types.values())
    rollout_id = facts.rollout_ids[0]
    one = analysis.spans(populated.url, MAIN_RUN, rollout_id=rollout_id, schema=populated.schema)
    assert sorted(one["span_id"]) == sorted(facts.span_ids[rollout_id])
    frame = analysis.read_sql(
        populated.url, "SELECT COUNT(*) AS n FROM rollout_summary_v1 WHERE run_name = :run", {"run": MAIN_RUN},
        schema=populated.schema,
    )
    assert int(frame["n"][0]) == facts.rollouts


async def test_dataframe_helpers_inside_a_running_loop(populated: Populated) -> None:
    """Notebooks run a loop: the sync helpers must still work there."""
    frame = analysis.rollouts(populated.url, OTHER_RUN, schema=populated.schema)
    assert len(frame) == populated.facts[OTHER_RUN].rollouts


def test_missing_pandas_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, populated: Populated) -> None:
    import builtins

    real_import = builtins.__import__

    def no_pandas(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("No module named 'pandas'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    with pytest.raises(ImportError, match=r"pip install 'lightning_sql\[analysis\]'"):
        analysis.rollouts(populated.url, MAIN_RUN, schema=populated.schema)


# --- constant memory -----------------------------------------------------------------------------

N_SPANS = int(os.environ.get("LIGHTNING_SQL_EXPORT_SPANS", "6000"))
CHUNK = 250
PAYLOAD_BYTES = 4_000  # the run's data dwarfs fixed overheads (drivers, pyarrow)


def _big_run(populated: Populated, run: str, n_spans: int) -> None:
    async def write() -> None:
        store = populated.open(run=run)
        try:
            await store.enqueue_rollout({"q": "big"})
            claimed = await store.dequeue_rollout(worker_id="w")
            assert claimed is not None
            payload = "x" * PAYLOAD_BYTES
            for start in range(0, n_spans, 1000):
                batch = [
                    make_span(claimed.rollout_id, claimed.attempt.attempt_id, i + 1, "step", float(i), float(i) + 0.5,
                              {"i": i, "payload": payload}, trace_id="cd" * 16)
                    for i in range(start, min(n_spans, start + 1000))
                ]
                await store.add_many_spans(batch)
        finally:
            await store.close()

    asyncio.run(write())


def _peak_export_bytes(populated: Populated, run: str, directory: Path) -> tuple[int, int]:
    database = analysis.AnalysisDatabase(populated.url, schema=populated.schema)
    try:
        database.run_id(run)  # connect outside the measurement
        tracemalloc.start()
        try:
            result = analysis.export_run(database, run, directory, tables=["spans"], chunk_rows=CHUNK, format="parquet")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        database.close()
    return peak, result.rows["spans"]


@pytest.mark.slow
def test_export_memory_stays_flat(populated: Populated, tmp_path: Path) -> None:
    small, big = f"mem-small-{populated.kind}", f"mem-big-{populated.kind}"
    _big_run(populated, small, N_SPANS // 4)
    _big_run(populated, big, N_SPANS)
    small_peak, small_rows = _peak_export_bytes(populated, small, tmp_path / "small")
    big_peak, big_rows = _peak_export_bytes(populated, big, tmp_path / "big")
    assert (small_rows, big_rows) == (N_SPANS // 4, N_SPANS)
    whole_run_bytes = N_SPANS * PAYLOAD_BYTES
    print(f"export peak: {small_peak / 1e6:.1f} MB for {small_rows} spans, {big_peak / 1e6:.1f} MB for {big_rows}")
    # Streaming: four times the spans, (about) the same peak (loading everything would make it ~4x),
    # and a fraction of the run's size.
    assert big_peak < 1.5 * small_peak
    assert big_peak < whole_run_bytes / 2
