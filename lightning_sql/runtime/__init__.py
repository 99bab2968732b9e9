"""The runtime around the store: trainer, algorithms, agents, runners, tracers, adapters.

Their behaviour is specified in docs/store-contract.md §3.
"""

from lightning_sql.runtime.adapter import (
    Adapter,
    RewardMatchPolicy,
    TraceAdapter,
    TracerTraceToTriplet,
    TraceTree,
)
from lightning_sql.runtime.agent import FunctionalLitAgent, LitAgent, llm_rollout, prompt_rollout, rollout
from lightning_sql.runtime.algorithm import Algorithm, Baseline, FastAlgorithm, with_store
from lightning_sql.runtime.base import ParallelWorkerBase
from lightning_sql.runtime.execution import (
    ExecutionEvent,
    ExecutionStrategy,
    InProcessExecutionStrategy,
    ProcessExecutionStrategy,
)
from lightning_sql.runtime.fingerprint import RunChangedError
from lightning_sql.runtime.hooks import Hook
from lightning_sql.runtime.prompt_search import PromptSearch
from lightning_sql.runtime.runner import LitAgentRunner, Runner, system_snapshot
from lightning_sql.runtime.summary import FitSummary
from lightning_sql.runtime.tracer import (
    NoopTracer,
    OtelTracer,
    Tracer,
    emit_message,
    emit_object,
    emit_reward,
    get_active_tracer,
)
from lightning_sql.runtime.trainer import DEFAULT_ROLLOUT_CONFIG, Trainer
from lightning_sql.runtime.worker import run_worker, run_worker_async

__all__ = [
    "Adapter",
    "TraceAdapter",
    "TracerTraceToTriplet",
    "TraceTree",
    "RewardMatchPolicy",
    "LitAgent",
    "FunctionalLitAgent",
    "rollout",
    "llm_rollout",
    "prompt_rollout",
    "Algorithm",
    "FastAlgorithm",
    "Baseline",
    "PromptSearch",
    "with_store",
    "ParallelWorkerBase",
    "ExecutionEvent",
    "ExecutionStrategy",
    "InProcessExecutionStrategy",
    "ProcessExecutionStrategy",
    "Hook",
    "Runner",
    "LitAgentRunner",
    "system_snapshot",
    "Tracer",
    "OtelTracer",
    "NoopTracer",
    "emit_reward",
    "emit_message",
    "emit_object",
    "get_active_tracer",
    "Trainer",
    "FitSummary",
    "RunChangedError",
    "DEFAULT_ROLLOUT_CONFIG",
    "run_worker",
    "run_worker_async",
]
