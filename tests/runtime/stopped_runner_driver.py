"""A trainer for the stopped-runner test: ``python -m tests.runtime.stopped_runner_driver URL RUN N STRATEGY [SCHEMA]``.

Two runners (``STRATEGY``: inprocess or processes) work through N slow samples under a lease far longer
than the test's deadline, so only the hand-back of a gone runner's attempts lets a rerun finish in time.
"""

from __future__ import annotations

import logging
import sys

from lightning_sql import Baseline, LitAgentRunner, RolloutConfig, SqlLightningStore, Trainer
from tests.runtime.agents import slow_agent

LEASE_S = 600


def main() -> None:
    url, run, n, strategy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    options = {"schema": sys.argv[5]} if len(sys.argv) > 5 else {}
    logging.basicConfig(level=logging.WARNING)
    store = SqlLightningStore(url, run=run, **options)
    trainer = Trainer(
        store=store,
        n_runners=2,
        strategy=strategy,
        algorithm=Baseline(max_queue_length=4, polling_interval=0.5, span_verbosity="none"),
        runner=LitAgentRunner(poll_interval=0.5, heartbeat_interval=0.5),
        rollout_config=RolloutConfig(unresponsive_seconds=LEASE_S, max_attempts=3, retry_condition=["unresponsive"]),
    )
    trainer.fit(slow_agent, [{"x": i} for i in range(n)])


if __name__ == "__main__":
    main()
