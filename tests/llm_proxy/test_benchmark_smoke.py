"""``benchmarks/proxy.py`` runs end to end at a tiny size and its checks pass; its figures are not asserted."""

from __future__ import annotations

from benchmarks.proxy import SIZES, format_results, run


async def test_proxy_benchmark_runs_and_every_call_is_stored() -> None:
    results, problems = await run(SIZES["tiny"], None, None)
    assert problems == []
    assert results["streams"]["errors"] == 0 and results["recording"]["errors"] == 0
    assert results["recording"]["calls"] == SIZES["tiny"].record_calls
    assert results["recorder"]["calls"] == SIZES["tiny"].record_calls
    assert "calls/s recorded" in format_results(results)
