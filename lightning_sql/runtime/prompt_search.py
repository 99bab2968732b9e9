"""``PromptSearch``: a small offline prompt optimiser — greedy search over instruction edits.

Starting from the prompt template in the initial resources, each round proposes one variant per
remaining edit (the edit's text put in front of the current best template), publishes each variant
as a new version of one resources id, runs it on the train split and keeps the best.  The search
stops when a round brings no improvement or no edits are left; the initial template and the final
best one also run on the val split.  Every rollout records the resources version it ran with, so
the run's reward by version is its learning curve (``FitSummary.versions``, or SQL over
``rollout_summary_v1``).

Resumable like ``Baseline``: each stage's samples are keyed ``<stage>:<mode>:<content hash>``; a
rerun walks the same stages, finds finished ones in the store (their rewards decide as before) and
continues where the previous process stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_sql.runtime.algorithm import Baseline, publish_resources, sample_keys
from lightning_sql.runtime.summary import final_reward, gather_chunked
from lightning_sql.types import NamedResources, PromptTemplate, RolloutMode

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["PromptSearch", "SearchStage", "DEFAULT_EDITS"]

logger = logging.getLogger(__name__)

DEFAULT_EDITS: tuple[str, ...] = (
    "Work step by step.",
    "Answer with the number only.",
    "Double-check your answer.",
)


@dataclass(frozen=True)
class SearchStage:
    """One evaluated (template, split) of the search."""

    stage: int
    version: int | None
    """The resources version the stage's rollouts ran with."""
    template: str
    edit: str | None
    """The edit this stage's template added to the best template before it (None: not a proposal)."""
    mode: str
    mean_reward: float | None
    rollouts: int


class PromptSearch(Baseline):
    """Greedy prompt search over ``edits``; see the module docstring.

    Args:
        edits: instruction texts a proposal puts in front of the template (literal text).
        resource_name: the initial resource to optimise (default: the only ``PromptTemplate``).
        resources_id: the resources id whose versions are the candidates.
        max_rounds: at most this many rounds (default: until no improvement or no edits left).
        min_improvement: a candidate must beat the best train reward by more than this.
        **options: ``Baseline`` options (``polling_interval``, ``max_queue_length``, ``span_verbosity``).
    """

    def __init__(
        self,
        *,
        edits: Sequence[str] = DEFAULT_EDITS,
        resource_name: str | None = None,
        resources_id: str = "prompt-search",
        max_rounds: int | None = None,
        min_improvement: float = 1e-9,
        **options: Any,
    ) -> None:
        super().__init__(n_epochs=1, **options)
        if not edits or any(not isinstance(e, str) or not e.strip() for e in edits):
            raise ValueError(f"edits must be a non-empty sequence of non-empty strings, got {edits!r}")
        if len(set(edits)) != len(edits):
            raise ValueError("edits must be distinct")
        if max_rounds is not None and max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0 or None, got {max_rounds!r}")
        self.edits = tuple(edits)
        self.resource_name = resource_name
        self.resources_id = resources_id
        self.max_rounds = max_rounds
        self.min_improvement = float(min_improvement)
        self.stages: list[SearchStage] = []
        """Every stage evaluated (or found finished) by the last ``run``, in order."""
        self.best_template: str | None = None

    def expected_rollouts(
        self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None
    ) -> int | None:
        return None  # the number of rounds depends on the rewards

    def settings(self) -> dict[str, Any]:
        return {
            "edits": list(self.edits), "resource_name": self.resource_name, "resources_id": self.resources_id,
            "max_rounds": self.max_rounds, "min_improvement": self.min_improvement,
        }  # fmt: skip

    def _prompt(self, initial: NamedResources | None) -> tuple[str, PromptTemplate]:
        prompts = {name: r for name, r in (initial or {}).items() if isinstance(r, PromptTemplate)}
        if self.resource_name is not None:
            if self.resource_name not in prompts:
                raise ValueError(
                    f"PromptSearch: no PromptTemplate named {self.resource_name!r} in the initial resources "
                    f"(prompt templates: {sorted(prompts)})"
                )
            return self.resource_name, prompts[self.resource_name]
        if len(prompts) != 1:
            raise ValueError(
                "PromptSearch needs exactly one PromptTemplate in the initial resources, or resource_name=; "
                f"found {sorted(prompts) or 'none'}"
            )
        return next(iter(prompts.items()))

    @staticmethod
    def propose(template: PromptTemplate, edit: str) -> PromptTemplate:
        """The template with ``edit`` in front (braces escaped for the f-string engine)."""
        text = edit.replace("{", "{{").replace("}", "}}") if template.engine == "f-string" else edit
        return PromptTemplate(template=f"{text} {template.template}", engine=template.engine)

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        initial = dict(self.get_initial_resources() or {})
        name, start = self._prompt(initial)
        train: list[tuple[RolloutMode, Any]] = [("train", s) for s in train_dataset or []]
        val: list[tuple[RolloutMode, Any]] = [("val", s) for s in val_dataset or []]
        if not train:
            raise ValueError("PromptSearch needs a train dataset: candidates are compared on it")
        self.stages = []

        async def evaluate(stage: int, template: PromptTemplate, edit: str | None, splits: list[Any]) -> float | None:
            resources: NamedResources = {**initial, name: template}
            scores, version = await self._evaluate(store, stage, resources, splits)
            for mode, (mean, count) in scores.items():
                self.stages.append(SearchStage(stage, version, template.template, edit, mode, mean, count))
            return scores["train"][0] if "train" in scores else None

        best, best_score = start, await evaluate(0, start, None, train + val)
        stage, remaining, rounds = 0, list(self.edits), 0
        while remaining and (self.max_rounds is None or rounds < self.max_rounds):
            rounds += 1
            round_best: tuple[float, PromptTemplate, str] | None = None
            for edit in remaining:
                stage += 1
                candidate = self.propose(best, edit)
                score = await evaluate(stage, candidate, edit, train)
                if score is not None and (round_best is None or score > round_best[0]):
                    round_best = (score, candidate, edit)
            if round_best is None or (best_score is not None and round_best[0] <= best_score + self.min_improvement):
                logger.info("PromptSearch: round %d brought no improvement; stopping", rounds)
                break
            best_score, best, chosen = round_best
            remaining.remove(chosen)
            logger.info("PromptSearch: round %d keeps %r (train reward %.3f)", rounds, chosen, best_score)
        self.best_template = best.template
        if best is not start and val:
            await evaluate(stage + 1, best, None, val)

    async def _evaluate(
        self, store: LightningStore, stage: int, resources: NamedResources, samples: list[tuple[RolloutMode, Any]]
    ) -> tuple[dict[str, tuple[float | None, int]], int | None]:
        """Run ``samples`` with ``resources`` as stage ``stage``: mean reward and rollout count by mode, and
        the resources version the rollouts ran with.

        The mean is over all the stage's rollouts of a mode: a failed rollout, or one without a
        reward, counts 0 (a candidate that breaks the agent must not win).
        """
        keys = sample_keys(stage, samples)
        known = await self._existing(store, keys)
        if len(known) < len(keys):
            # Not (fully) enqueued yet: these resources must be the current version of the id, so that
            # the rollouts enqueued now record it; identical to the latest version, nothing is published.
            await publish_resources(store, self.resources_id, resources)
        finished = await self.run_batch(store, keys, samples, self.resources_id, label=f"Stage {stage}")
        succeeded = [r for r in finished if r.status == "succeeded"]
        values = await gather_chunked([final_reward(store, r) for r in succeeded])
        rewards = {r.rollout_id: value for r, value in zip(succeeded, values, strict=True)}
        scores: dict[str, tuple[float | None, int]] = {}
        for mode in dict.fromkeys(m for m, _ in samples):
            of_mode = [r for r in finished if r.mode == mode]
            total = sum(rewards.get(r.rollout_id) or 0.0 for r in of_mode)
            scores[mode] = (total / len(of_mode) if of_mode else None, len(of_mode))
        version = next((r.resources_version for r in finished if r.resources_version is not None), None)
        return scores, version
