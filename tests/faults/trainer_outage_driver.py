"""A trainer process for tests/faults/test_trainer_outage.py:
``python -m tests.faults.trainer_outage_driver URL RUN N GATE DEADLINE OUTAGE_TIMEOUT``.

Two in-process runners run ``GatedSteps``, an algorithm shaped like an RL loop: the first half of the
N samples, then a training step (``update_resources``), then the second half.  Before the step it
waits for the file GATE, so the test can make the database unavailable first: the algorithm's next
store call (the step, a write) meets the outage, whatever the backend.  The store's
``connect_deadline_seconds`` is DEADLINE; OUTAGE_TIMEOUT is the Trainer's (``none``: None).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sql import Baseline, LitAgentRunner, PromptTemplate, Trainer
from lightning_sql.runtime.algorithm import sample_keys
from tests.runtime.agents import slow_agent

GATE_POLL_S = 0.05


class GatedSteps(Baseline):
    def __init__(self, gate: Path) -> None:
        super().__init__(max_queue_length=2, polling_interval=0.2, span_verbosity="none")
        self.gate = gate

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        samples = [("train", s) for s in train_dataset or []]
        half = len(samples) // 2
        keys = sample_keys(0, samples)
        await self.run_batch(store, keys[:half], samples[:half], None, label="First half")  # type: ignore[arg-type]
        while not self.gate.exists():
            await asyncio.sleep(GATE_POLL_S)
        await store.update_resources("policy", {"prompt": PromptTemplate(template="step 1 {x}", engine="f-string")})
        await self.run_batch(store, keys[half:], samples[half:], "policy", label="Second half")  # type: ignore[arg-type]


def main() -> None:
    url, run, n, gate, deadline, timeout = sys.argv[1:7]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    trainer = Trainer(
        store={"url": url, "connect_deadline_seconds": float(deadline), "scan_debounce_seconds": 1.0},
        run=run,
        n_runners=2,
        algorithm=GatedSteps(Path(gate)),
        runner=LitAgentRunner(poll_interval=0.2, heartbeat_interval=0.5),
        outage_timeout=None if timeout == "none" else float(timeout),
        progress=False,
        summary=False,
    )
    trainer.fit(slow_agent, [{"x": i} for i in range(int(n))])


if __name__ == "__main__":
    main()
