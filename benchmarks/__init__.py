"""Benchmarks of lightning_sql against Agent-Lightning 0.3's stores (docs/performance.md).

``python -m benchmarks [WORKLOAD ...] --backend sqlite|postgres|all [--repeat N] [--size small|full]``

Results are printed (and optionally written as JSON), never asserted; a failed correctness check
(double claim, a rollout that did not succeed, a wrong span count or order) makes the run exit 1.
"""

from benchmarks.runner import Report, main, run_benchmarks

__all__ = ["Report", "main", "run_benchmarks"]
