"""A trainer process for the kill-and-resume test: ``python -m tests.runtime.resume_driver URL RUN N [SCHEMA]``.

Runs Baseline over N train samples with 2 runner processes (``processes`` strategy) and short leases.
"""

from __future__ import annotations

import logging
import sys

from lightning_sql import Baseline, LitAgentRunner, RolloutConfig, SqlLightningStore, Trainer
from tests.runtime.agents import slow_agent


def main() -> None:
    url, run, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = {"schema": sys.argv[4]} if len(sys.argv) > 4 else {}
    logging.basicConfig(level=logging.WARNING)
    store = SqlLightningStore(url, run=run, scan_debounce_seconds=1.0, **options)
    trainer = Trainer(
        store=store,
        n_runners=2,
        strategy="processes",
        algorithm=Baseline(max_queue_length=4, polling_interval=0.5, span_verbosity="none"),
        runner=LitAgentRunner(poll_interval=0.5, heartbeat_interval=0.5),
        rollout_config=RolloutConfig(unresponsive_seconds=3, max_attempts=5, retry_condition=["unresponsive", "timeout"]),
    )
    trainer.fit(slow_agent, [{"x": i} for i in range(n)])


if __name__ == "__main__":
    main()
