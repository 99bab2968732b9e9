"""``Trainer``: wires store, algorithm, runners, tracer, adapter and strategy together.

Its behaviour is specified in docs/store-contract.md §3.8.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rich.console import Console

from lightning_sql.runtime.adapter import TraceAdapter, TracerTraceToTriplet
from lightning_sql.runtime.agent import LitAgent
from lightning_sql.runtime.algorithm import Algorithm, Baseline, FastAlgorithm
from lightning_sql.runtime.execution import (
    STRATEGY_REGISTRY,
    ExecutionEvent,
    ExecutionStrategy,
    InProcessExecutionStrategy,
)
from lightning_sql.runtime.fit_session import FitStart, announce_fit, prepare_fit, summarise_fit
from lightning_sql.runtime.hooks import Hook
from lightning_sql.runtime.outages import OutageLog, patience_seconds, stopped_message
from lightning_sql.runtime.progress import RunProgress
from lightning_sql.runtime.runner import LitAgentRunner, Runner
from lightning_sql.runtime.summary import FitSummary
from lightning_sql.runtime.tracer import NoopTracer, OtelTracer, Tracer
from lightning_sql.store import StoreUnavailableError, outage_patience
from lightning_sql.store.base import LightningStore, PersistentStore
from lightning_sql.types import NamedResources, RolloutConfig

__all__ = ["Trainer", "DEFAULT_ROLLOUT_CONFIG", "DEFAULT_STORE_URL", "build_component"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_STORE_URL = "sqlite:///lightning_sql.db"  # persistent by default, like MLflow's mlflow.db
DEFAULT_ROLLOUT_CONFIG = RolloutConfig(
    unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive", "timeout"]
)
"""The lease every rollout gets by default: a dead runner's work moves on within about a minute."""

STOP_POLL_INTERVAL_S = 0.1  # an algorithm-less trainer checks its stop event this often
ALGORITHM_GRACE_S = 5.0  # once runners are gone, the algorithm gets this long before it is cancelled

_TRACERS: dict[str, Callable[[], Any]] = {"otel": OtelTracer, "noop": NoopTracer}
_ADAPTERS: dict[str, Callable[..., Any]] = {
    "triplet": TracerTraceToTriplet,
    "tracer_trace_to_triplet": TracerTraceToTriplet,
}
_RUNNERS: dict[str, Callable[..., Any]] = {"agent": LitAgentRunner, "lit_agent": LitAgentRunner}
_ALGORITHMS: dict[str, Callable[..., Any]] = {"baseline": Baseline}


def _import_path(path: str) -> Any:
    """Import ``package.module:attr`` or ``package.module.attr``."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not an import path (module:attr or module.attr)")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _accepted_kwargs(factory: Callable[..., Any], candidates: dict[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(candidates)
    return {k: v for k, v in candidates.items() if k in params}


def build_component(
    spec: Any,
    *,
    name: str,
    expected: type[T] | tuple[type, ...],
    registry: dict[str, Callable[..., Any]] | None = None,
    inject: dict[str, Any] | None = None,
    dict_default_type: Callable[..., Any] | None = None,
) -> T:
    """Build a component from an instance, class, zero-argument factory, registry name, import path or dict.

    Raises:
        TypeError: the result is not of the expected type (the message names the component).
        ValueError: the spec cannot be used (the message names the component).
    """
    registry = registry or {}
    inject = inject or {}
    kwargs: dict[str, Any] = {}
    target: Any = spec
    if isinstance(spec, dict):
        kwargs = dict(spec)
        type_spec = kwargs.pop("type", None)
        if type_spec is None:
            if dict_default_type is None:
                raise ValueError(f"{name}: a dict spec needs a 'type' key, got {spec!r}")
            target = dict_default_type
        else:
            target = type_spec
    if isinstance(target, str):
        if target in registry:
            target = registry[target]
        else:
            try:
                target = _import_path(target)
            except (ImportError, AttributeError) as exc:
                known = f" (registry names: {sorted(registry)})" if registry else ""
                raise ValueError(f"{name}: cannot resolve {target!r}{known}: {exc}") from exc
    if isinstance(target, type):
        if not _is_subclass(target, expected):
            raise TypeError(f"{name} must be a {_names(expected)}, got the class {target.__qualname__}")
        instance = target(**{**_accepted_kwargs(target, inject), **kwargs})
    elif _is_instance(target, expected):
        if kwargs:
            raise ValueError(f"{name}: a dict spec's 'type' must be a class or name, not an instance")
        return target  # type: ignore[return-value]
    elif callable(target):
        instance = target(**kwargs) if kwargs else target()
    else:
        raise ValueError(f"{name}: cannot build a component from {spec!r}")
    if not _is_instance(instance, expected):
        raise TypeError(f"{name} must be a {_names(expected)}, got {type(instance).__qualname__}")
    return instance  # type: ignore[return-value]


def _is_subclass(cls: type, expected: type | tuple[type, ...]) -> bool:
    return issubclass(cls, expected)


def _is_instance(obj: Any, expected: type | tuple[type, ...]) -> bool:
    return isinstance(obj, expected)


def _names(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def _build_store(
    spec: Any, run: str | None, rollout_config: RolloutConfig | None
) -> LightningStore:
    from lightning_sql.store import SqlLightningStore

    if spec is None:
        spec = os.environ.get("LIGHTNING_SQL_URL") or DEFAULT_STORE_URL
    if isinstance(spec, str) and "://" in spec:
        return SqlLightningStore(spec, run=run, default_rollout_config=rollout_config or DEFAULT_ROLLOUT_CONFIG)
    if isinstance(spec, dict) and "url" in spec and "type" not in spec:
        options = dict(spec)
        options.setdefault("run", run)
        options.setdefault("default_rollout_config", rollout_config or DEFAULT_ROLLOUT_CONFIG)
        return SqlLightningStore(options.pop("url"), **options)
    store = build_component(spec, name="store", expected=LightningStore, registry={"sql": SqlLightningStore})
    if not isinstance(store, PersistentStore):
        return store
    bound = store.run
    if run is not None and bound is not None and bound != run:
        raise ValueError(f"store is bound to run {bound!r}, but the Trainer was given run={run!r}")
    if rollout_config is not None:
        store.default_rollout_config = rollout_config
    elif store.default_rollout_config is None:
        store.default_rollout_config = DEFAULT_ROLLOUT_CONFIG
    return store


def _build_llm_proxy(spec: Any, store: LightningStore) -> Any:
    """The Trainer's ``llm_proxy`` (instance, class, dict, name or import path), recording into ``store``."""
    if spec is None:
        return None
    from lightning_sql.llm_proxy import LLMProxy

    proxy = build_component(
        spec, name="llm_proxy", expected=LLMProxy, registry={"llm_proxy": LLMProxy},
        inject={"store": store}, dict_default_type=LLMProxy,
    )
    proxy.set_store(store)
    return proxy


class _AlgorithmBundle:
    """``algorithm(store, event)``: sets up and runs the algorithm (or waits for the stop event)."""

    def __init__(
        self,
        trainer: Trainer,
        algorithm: Algorithm | None,
        train_dataset: Any,
        val_dataset: Any,
        progress: RunProgress | None = None,
    ) -> None:
        self.trainer = trainer
        self.algorithm = algorithm
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.progress = progress

    async def __call__(self, store: LightningStore, event: ExecutionEvent) -> None:
        if self.progress is None:
            await self._run(store, event)
            return
        stop = asyncio.Event()
        bar = asyncio.ensure_future(self.progress.show(stop))
        try:
            await self._run(store, event)
        finally:
            stop.set()
            await asyncio.gather(bar, return_exceptions=True)

    async def _run(self, store: LightningStore, event: ExecutionEvent) -> None:
        # A proxy in "asyncio" launch mode serves from this loop; the other modes were started by _execute.
        proxy = self.trainer.llm_proxy
        own_proxy = proxy is not None and proxy.launch_mode == "asyncio" and not proxy.is_running()
        if own_proxy:
            await proxy.start()
        try:
            await self._run_algorithm(store, event)
        finally:
            if own_proxy:
                await proxy.stop()

    async def _run_algorithm(self, store: LightningStore, event: ExecutionEvent) -> None:
        algorithm = self.algorithm
        if algorithm is None:
            while not event.is_set():
                await asyncio.sleep(STOP_POLL_INTERVAL_S)
            return
        algorithm.set_trainer(self.trainer)
        algorithm.set_store(store)
        algorithm.set_adapter(self.trainer.adapter)
        algorithm.set_initial_resources(self.trainer.initial_resources)
        algorithm.set_llm_proxy(self.trainer.llm_proxy)
        outages = OutageLog(store, self.trainer.run, self.trainer.outage_timeout)
        # The algorithm's task (and the threads and tasks it starts) copies this context: its store
        # calls wait an outage out for outage_timeout, as runners do, instead of connect_deadline_seconds.
        with outage_patience(patience_seconds(self.trainer.outage_timeout)):
            if algorithm.is_async():
                work = asyncio.ensure_future(algorithm.run(self.train_dataset, self.val_dataset))
            else:
                work = asyncio.ensure_future(asyncio.to_thread(algorithm.run, self.train_dataset, self.val_dataset))
        try:
            while not work.done():
                await asyncio.wait({work}, timeout=STOP_POLL_INTERVAL_S)
                outages.check()
                if event.is_set() and not work.done():
                    await asyncio.wait({work}, timeout=ALGORITHM_GRACE_S)
                    if not work.done():
                        logger.warning("Stopping: the algorithm did not finish after the runners stopped")
                        work.cancel()
            work.result()
            outages.check(answered=True)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)


class _RunnerBundle:
    """``runner(store, worker_id, event)``: one runner's life; picklable for the processes strategy."""

    def __init__(self, runner: Runner[Any], agent: LitAgent[Any], hooks: list[Hook]) -> None:
        self.runner = runner
        self.agent = agent
        self.hooks = hooks

    async def __call__(self, store: LightningStore, worker_id: int | str, event: ExecutionEvent) -> None:
        # Each worker gets its own runner and tracer (their state is per attempt).
        runner = copy.copy(self.runner)
        if isinstance(getattr(runner, "tracer", None), Tracer):
            runner.tracer = copy.copy(runner.tracer)  # type: ignore[attr-defined]
        runner.init(self.agent, hooks=self.hooks)
        runner.init_worker(worker_id, store)
        try:
            await runner.iter(event=event)
        finally:
            runner.teardown_worker(worker_id)
            runner.teardown()


class Trainer:
    """Runs an agent with an algorithm over a store.

    Components (``algorithm``, ``runner``, ``tracer``, ``adapter``, ``strategy``, ``store``) accept an
    instance, a class, a zero-argument factory, a registry name, an import path or a dict with a
    ``"type"`` and constructor kwargs.  ``store`` also takes a URL (default ``LIGHTNING_SQL_URL`` or
    ``sqlite:///lightning_sql.db``); ``run`` names the run (the same name resumes it);
    ``rollout_config`` is the lease of every rollout enqueued without its own config.

    ``fit`` shows a progress bar (``progress``) and prints the run's summary (``summary``); either can
    be turned off, and ``fit`` returns the :class:`FitSummary` regardless.  A run remembers the
    datasets, initial resources and algorithm of its first ``fit``; resuming it with other ones raises
    ``RunChangedError`` unless ``accept_changes=True``.

    ``llm_proxy`` (an ``LLMProxy``, its class, a dict of its arguments, or a name / import path) records
    the agents' model calls: the Trainer gives it its store, starts it before the runners, hands it to the
    algorithm (``set_llm_proxy``) and stops it when ``fit`` ends.

    A database outage (a stopped server, a full disk) is waited out: runners retry, and each store call
    of the algorithm (and of ``fit``'s own book-keeping at the end) waits up to ``outage_timeout``
    seconds for the database, default None: as long as it takes, logging every
    ``connect_deadline_seconds`` that it waits and since when.  Past the bound ``fit`` stops with
    ``SystemExit`` naming the run, which stays active and resumes with the same ``fit``.
    """

    def __init__(
        self,
        *,
        dev: bool = False,
        n_runners: int | None = None,
        max_rollouts: int | None = None,
        initial_resources: NamedResources | None = None,
        tracer: Any = None,
        adapter: Any = None,
        store: Any = None,
        runner: Any = None,
        strategy: Any = None,
        algorithm: Any = None,
        hooks: Hook | Sequence[Hook] | None = None,
        run: str | None = None,
        rollout_config: RolloutConfig | None = None,
        n_workers: int | None = None,
        max_tasks: int | None = None,
        triplet_exporter: Any = None,
        progress: bool = True,
        summary: bool = True,
        accept_changes: bool = False,
        llm_proxy: Any = None,
        outage_timeout: float | None = None,
    ) -> None:
        if n_workers is not None:
            warnings.warn("Trainer(n_workers=...) is deprecated; use n_runners", DeprecationWarning, stacklevel=2)
            if n_runners is None:
                n_runners = n_workers
        if max_tasks is not None:
            warnings.warn("Trainer(max_tasks=...) is deprecated; use max_rollouts", DeprecationWarning, stacklevel=2)
            if max_rollouts is None:
                max_rollouts = max_tasks
        if triplet_exporter is not None:
            warnings.warn("Trainer(triplet_exporter=...) is deprecated; use adapter", DeprecationWarning, stacklevel=2)
            if adapter is None:
                adapter = triplet_exporter
        if dev:
            warnings.warn("Trainer(dev=True) is deprecated; call trainer.dev(...)", DeprecationWarning, stacklevel=2)
        if rollout_config is not None and not isinstance(rollout_config, RolloutConfig):
            raise TypeError(f"rollout_config must be a RolloutConfig or None, got {rollout_config!r}")
        if run is not None and (not isinstance(run, str) or not run):
            raise ValueError(f"run must be a non-empty str or None, got {run!r}")
        if outage_timeout is not None and (
            isinstance(outage_timeout, bool) or not isinstance(outage_timeout, (int, float)) or not outage_timeout >= 0
        ):
            raise ValueError(f"outage_timeout must be a number of seconds >= 0 or None, got {outage_timeout!r}")
        self.outage_timeout = None if outage_timeout is None else float(outage_timeout)
        self.dev_mode = dev
        self.n_runners = 1 if n_runners is None else n_runners
        if self.n_runners < 0:
            raise ValueError(f"n_runners must be >= 0, got {self.n_runners!r}")
        self.max_rollouts = max_rollouts
        self.initial_resources = initial_resources
        self.rollout_config = rollout_config
        self.progress = progress
        self.summary = summary
        self.accept_changes = accept_changes

        self.tracer: Tracer = build_component(
            tracer if tracer is not None else OtelTracer, name="tracer", expected=Tracer, registry=_TRACERS
        )
        self.adapter: TraceAdapter[Any] = build_component(
            adapter if adapter is not None else TracerTraceToTriplet,
            name="adapter",
            expected=TraceAdapter,
            registry=_ADAPTERS,
            dict_default_type=TracerTraceToTriplet,
        )
        self.runner: Runner[Any] = build_component(
            runner if runner is not None else LitAgentRunner,
            name="runner",
            expected=Runner,
            registry=_RUNNERS,
            inject={"tracer": self.tracer, "max_rollouts": max_rollouts},
        )
        if isinstance(getattr(self.runner, "tracer", None), Tracer):
            self.tracer = self.runner.tracer  # type: ignore[attr-defined]
        self.strategy: ExecutionStrategy = build_component(
            strategy if strategy is not None else InProcessExecutionStrategy,
            name="strategy",
            expected=ExecutionStrategy,
            registry=dict(STRATEGY_REGISTRY),
            inject={"n_runners": self.n_runners},
        )
        self.algorithm: Algorithm | None = (
            None
            if algorithm is None
            else build_component(algorithm, name="algorithm", expected=Algorithm, registry=_ALGORITHMS)
        )
        if hooks is None:
            self.hooks: list[Hook] = []
        elif isinstance(hooks, Hook):
            self.hooks = [hooks]
        else:
            self.hooks = [build_component(h, name="hooks", expected=Hook) for h in hooks]
        self.store: LightningStore = _build_store(store, run, rollout_config)
        self.llm_proxy = _build_llm_proxy(llm_proxy, self.store)

    @property
    def run(self) -> str | None:
        """The name of the run this trainer works on."""
        return self.store.run if isinstance(self.store, PersistentStore) else None

    def fit(self, agent: LitAgent[Any], train_dataset: Any = None, val_dataset: Any = None) -> FitSummary:
        """Run the algorithm (if any) and the runners until the algorithm is done; return the run's summary.

        Raises:
            RunChangedError: the run was started with other datasets, initial resources or algorithm
                (and ``accept_changes`` is false); nothing was enqueued.
            SystemExit: the store cannot be opened at the start, or a store call of the algorithm found
                the database unavailable for longer than ``outage_timeout`` (the message names the run,
                which stays active, and how to resume it).
        """
        if self.dev_mode:
            return self.dev(agent, train_dataset, val_dataset)
        return self._execute(agent, train_dataset, val_dataset, self.algorithm)

    def dev(self, agent: LitAgent[Any], train_dataset: Any = None, val_dataset: Any = None) -> FitSummary:
        """A quick end-to-end check with a ``FastAlgorithm`` (default ``Baseline()``)."""
        algorithm = self.algorithm if self.algorithm is not None else Baseline()
        if not isinstance(algorithm, FastAlgorithm):
            raise TypeError(
                f"Trainer.dev() needs a FastAlgorithm (e.g. Baseline), got {type(algorithm).__qualname__}"
            )
        return self._execute(agent, train_dataset, val_dataset, algorithm)

    def _execute(self, agent: Any, train_dataset: Any, val_dataset: Any, algorithm: Algorithm | None) -> FitSummary:
        agent = self._resolve_agent(agent)
        agent.set_trainer(self)
        where = self.store.url if isinstance(self.store, PersistentStore) else self.store
        logger.info("Trainer: store %s, run %s", where, self.run)
        console = Console() if self.progress or self.summary else None
        try:
            start = asyncio.run(
                prepare_fit(
                    self.store, self.run, algorithm, train_dataset, val_dataset, self.initial_resources,
                    accept_changes=self.accept_changes,
                )
            )
        except StoreUnavailableError as exc:
            # Nothing has started yet: one line that names the problem, not a traceback per thread.
            raise SystemExit(f"lightning_sql: cannot open the store: {exc}") from None
        announce_fit(start, console)
        progress = None
        if self.progress and console is not None:
            expected = algorithm.expected_rollouts(train_dataset, val_dataset) if algorithm is not None else None
            progress = RunProgress(self.store, self.run, expected, console)
        algorithm_bundle = _AlgorithmBundle(self, algorithm, train_dataset, val_dataset, progress)
        runner_bundle = _RunnerBundle(self.runner, agent, self.hooks)
        proxy = self.llm_proxy
        own_proxy = proxy is not None and proxy.launch_mode != "asyncio" and not proxy.is_running()
        if own_proxy:  # up before the first runner can claim a rollout
            asyncio.run(proxy.start())
        try:
            try:
                self.strategy.execute(algorithm_bundle, runner_bundle, self.store)
            finally:
                if own_proxy:
                    asyncio.run(proxy.stop())
            summary = asyncio.run(self._finish(start))
        except StoreUnavailableError as exc:  # past outage_timeout, or a database that went away
            raise SystemExit(stopped_message(self.store, self.run, self.outage_timeout, exc)) from exc
        if self.summary and console is not None:
            console.print(summary)
        return summary

    async def _finish(self, start: FitStart) -> FitSummary:
        with outage_patience(patience_seconds(self.outage_timeout)):
            if isinstance(self.store, PersistentStore):
                await self.store.mark_run_finished()
            return await summarise_fit(self.store, start)

    @staticmethod
    def _resolve_agent(agent: Any) -> LitAgent[Any]:
        if isinstance(agent, LitAgent):
            return agent
        if isinstance(agent, str):
            agent = _import_path(agent)
            if isinstance(agent, LitAgent):
                return agent
        if isinstance(agent, type) and issubclass(agent, LitAgent):
            return agent()
        raise TypeError(f"agent must be a LitAgent (or @rollout function), got {type(agent).__qualname__}")
