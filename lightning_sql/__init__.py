"""lightning_sql: a persistent, SQL-backed coordination store for training AI agents.

The public API, re-exported: the models of ``lightning_sql.types``, the store and its errors, and
(when imported) the runtime.
"""

from lightning_sql.store import LightningStore, SqlLightningStore, StoreUnavailableError
from lightning_sql.types import *  # noqa: F403
from lightning_sql.types import __all__ as _types_all

__version__ = "0.1.0"

# The runtime (trainer, runners, tracers: psutil, the OTel SDK processor) is imported on first use,
# so `import lightning_sql` stays cheap for analysts and the CLI.
_RUNTIME_NAMES = (
    "Adapter", "TraceAdapter", "TracerTraceToTriplet", "TraceTree", "RewardMatchPolicy",
    "LitAgent", "FunctionalLitAgent", "rollout", "llm_rollout", "prompt_rollout",
    "Algorithm", "FastAlgorithm", "Baseline", "PromptSearch", "with_store", "ParallelWorkerBase",
    "ExecutionEvent", "ExecutionStrategy", "InProcessExecutionStrategy", "ProcessExecutionStrategy",
    "Hook", "Runner", "LitAgentRunner", "system_snapshot",
    "Tracer", "OtelTracer", "NoopTracer", "emit_reward", "emit_message", "emit_object", "get_active_tracer",
    "Trainer", "FitSummary", "RunChangedError", "DEFAULT_ROLLOUT_CONFIG", "run_worker", "run_worker_async",
)  # fmt: skip

__all__ = [  # noqa: F405 - LLMProxy and the runtime names come from __getattr__
    "LightningStore", "SqlLightningStore", "StoreUnavailableError", "LLMProxy", *_types_all, *_RUNTIME_NAMES,
]


def __getattr__(name: str) -> object:
    if name in _RUNTIME_NAMES:
        from lightning_sql import runtime

        return getattr(runtime, name)
    if name == "LLMProxy":  # its HTTP stack (the `proxy` extra) is imported only when it starts
        from lightning_sql.llm_proxy import LLMProxy

        return LLMProxy
    raise AttributeError(f"module 'lightning_sql' has no attribute {name!r}")
