"""``LitAgent`` and the ``@rollout`` decorators (docs/store-contract.md §3.2)."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from opentelemetry.sdk.trace import ReadableSpan

from lightning_sql.types import (
    LLM,
    AttemptedRollout,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    Rollout,
    Span,
    SpanCoreFields,
)

if TYPE_CHECKING:
    from lightning_sql.runtime.runner import Runner
    from lightning_sql.runtime.tracer import Tracer
    from lightning_sql.runtime.trainer import Trainer

__all__ = [
    "LitAgent",
    "FunctionalLitAgent",
    "RolloutRawResult",
    "rollout",
    "llm_rollout",
    "prompt_rollout",
]

T_task = TypeVar("T_task")

RolloutRawResult = None | float | int | bool | Sequence[ReadableSpan] | Sequence[Span] | Sequence[SpanCoreFields]
"""What a rollout may return: nothing (spans come from the tracer), a reward, or spans."""


def _is_overridden(instance: Any, name: str) -> bool:
    return getattr(type(instance), name) is not getattr(LitAgent, name)


class LitAgent(Generic[T_task]):
    """An agent the runner can call on one task: override ``rollout`` or ``rollout_async``.

    ``training_rollout[_async]`` and ``validation_rollout[_async]`` default to them; the runner calls
    the training variant for ``mode == "train"`` and the validation one otherwise.
    """

    def __init__(self, *, trained_agents: str | None = None) -> None:
        self.trained_agents = trained_agents
        self._trainer_ref: weakref.ReferenceType[Trainer] | None = None
        self._runner_ref: weakref.ReferenceType[Runner[Any]] | None = None

    # --- references ----------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_trainer_ref"] = None
        state["_runner_ref"] = None
        return state

    def is_async(self) -> bool:
        """True when any async rollout variant is overridden."""
        return any(
            _is_overridden(self, name)
            for name in ("rollout_async", "training_rollout_async", "validation_rollout_async")
        )

    def set_trainer(self, trainer: Trainer) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> Trainer:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise ValueError("Trainer reference is not set or has been garbage collected")
        return trainer

    @property
    def trainer(self) -> Trainer:
        return self.get_trainer()

    def set_runner(self, runner: Runner[Any]) -> None:
        self._runner_ref = weakref.ref(runner)

    def get_runner(self) -> Runner[Any]:
        runner = self._runner_ref() if self._runner_ref is not None else None
        if runner is None:
            raise ValueError("Runner reference is not set or has been garbage collected")
        return runner

    @property
    def runner(self) -> Runner[Any]:
        return self.get_runner()

    def get_tracer(self) -> Tracer:
        """The tracer of the runner running this agent."""
        return self.get_runner().get_tracer()

    @property
    def tracer(self) -> Tracer:
        return self.get_tracer()

    # --- rollouts --------------------------------------------------------------------------------------

    def rollout(self, task: T_task, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        """Run the agent on one task (sync); return None, a reward, or spans."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout() or rollout_async()")

    async def rollout_async(self, task: T_task, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        """Run the agent on one task (async); return None, a reward, or spans."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout() or rollout_async()")

    def training_rollout(self, task: T_task, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: T_task, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        return self.rollout(task, resources, rollout)

    async def training_rollout_async(
        self, task: T_task, resources: NamedResources, rollout: Rollout
    ) -> RolloutRawResult:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(
        self, task: T_task, resources: NamedResources, rollout: Rollout
    ) -> RolloutRawResult:
        return await self.rollout_async(task, resources, rollout)


class FunctionalLitAgent(LitAgent[T_task]):
    """A ``LitAgent`` made from a function ``(task, llm|prompt_template[, rollout])``, sync or async."""

    def __init__(self, rollout_func: Callable[..., Any], *, strip_proxy: bool = True) -> None:
        super().__init__()
        self._rollout_func = rollout_func
        self._strip_proxy = strip_proxy
        self._is_async = inspect.iscoroutinefunction(rollout_func)
        self._resource_kind, self._wants_rollout = _classify(rollout_func)
        functools.update_wrapper(self, rollout_func)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        # `@rollout def f` rebinds the module's `f` to this agent, so the function cannot be pickled by
        # reference; the agent itself can (children of the `processes` strategy import it back).
        func = self._rollout_func
        module = sys.modules.get(func.__module__)
        if module is not None and getattr(module, func.__qualname__, None) is self:
            module_name = func.__module__
            if module_name == "__main__":
                module_name = getattr(module.__spec__, "name", None) or "__main__"
            return (_import_attribute, (module_name, func.__qualname__))
        return (FunctionalLitAgent, (func,), {"_strip_proxy": self._strip_proxy})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly (handy in tests)."""
        return self._rollout_func(*args, **kwargs)

    def is_async(self) -> bool:
        return self._is_async

    def _arguments(self, task: Any, resources: NamedResources, rollout: Rollout) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self._resource_kind == "llm":
            llm = next((r for r in resources.values() if isinstance(r, LLM)), None)
            if llm is None:
                raise ValueError(f"{self._rollout_func.__name__} needs an LLM resource; got {sorted(resources)}")
            if self._strip_proxy and isinstance(llm, ProxyLLM):
                if type(rollout) is not AttemptedRollout:
                    raise ValueError("strip_proxy needs an AttemptedRollout to route the ProxyLLM endpoint")
                llm = llm.with_attempted_rollout(rollout)
            kwargs["llm"] = llm
        else:
            template = next((r for r in resources.values() if isinstance(r, PromptTemplate)), None)
            if template is None:
                raise ValueError(
                    f"{self._rollout_func.__name__} needs a PromptTemplate resource; got {sorted(resources)}"
                )
            kwargs["prompt_template"] = template
        if self._wants_rollout:
            kwargs["rollout"] = rollout
        return kwargs

    def rollout(self, task: Any, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        if self._is_async:
            raise RuntimeError(f"{self._rollout_func.__name__} is async: call rollout_async")
        return self._rollout_func(task, **self._arguments(task, resources, rollout))  # type: ignore[no-any-return]

    async def rollout_async(self, task: Any, resources: NamedResources, rollout: Rollout) -> RolloutRawResult:
        if not self._is_async:
            raise RuntimeError(f"{self._rollout_func.__name__} is sync: call rollout")
        return await self._rollout_func(task, **self._arguments(task, resources, rollout))  # type: ignore[no-any-return]


def _import_attribute(module_name: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _classify(func: Callable[..., Any]) -> tuple[str, bool]:
    """Return ("llm" | "prompt_template", takes_rollout) for a supported rollout signature."""
    params = list(inspect.signature(func).parameters.values())
    names = [p.name for p in params]
    if len(params) in (2, 3) and names[1] in ("llm", "prompt_template"):
        if len(params) == 2 or names[2] == "rollout":
            return names[1], len(params) == 3
    raise NotImplementedError(
        f"Unsupported rollout signature {func.__name__}{inspect.signature(func)}: expected "
        "(task, llm[, rollout]) or (task, prompt_template[, rollout])"
    )


def llm_rollout(func: Callable[..., Any] | None = None, *, strip_proxy: bool = True) -> Any:
    """Decorate ``(task, llm[, rollout])`` as a ``FunctionalLitAgent``."""

    def wrap(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        if _classify(f)[0] != "llm":
            raise NotImplementedError(f"{f.__name__} is not an LLM rollout (task, llm[, rollout])")
        return FunctionalLitAgent(f, strip_proxy=strip_proxy)

    return wrap(func) if func is not None else wrap


def prompt_rollout(func: Callable[..., Any] | None = None) -> Any:
    """Decorate ``(task, prompt_template[, rollout])`` as a ``FunctionalLitAgent``."""

    def wrap(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        if _classify(f)[0] != "prompt_template":
            raise NotImplementedError(f"{f.__name__} is not a prompt rollout (task, prompt_template[, rollout])")
        return FunctionalLitAgent(f)

    return wrap(func) if func is not None else wrap


def rollout(func: Callable[..., Any] | None = None, *, strip_proxy: bool = True) -> Any:
    """Turn a function into a ``LitAgent`` by its signature.

    ``(task, llm[, rollout])`` receives the first ``LLM`` of the resources (a ``ProxyLLM`` becomes a
    plain ``LLM`` routed to the attempt with ``strip_proxy``); ``(task, prompt_template[, rollout])``
    receives the first ``PromptTemplate``.  Sync and async functions both work; other signatures
    raise ``NotImplementedError``.
    """

    def wrap(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        _classify(f)
        return FunctionalLitAgent(f, strip_proxy=strip_proxy)

    return wrap(func) if func is not None else wrap
