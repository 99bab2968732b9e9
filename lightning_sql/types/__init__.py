"""Pydantic models and helpers shared by the store and the runtime (docs/store-contract.md §1)."""

from .core import *  # noqa: F403
from .core import __all__ as _core_all
from .jsonvalue import *  # noqa: F403
from .jsonvalue import __all__ as _jsonvalue_all
from .resources import *  # noqa: F403
from .resources import __all__ as _resources_all
from .tracer import *  # noqa: F403
from .tracer import __all__ as _tracer_all

__all__ = [*_core_all, *_tracer_all, *_resources_all, *_jsonvalue_all]
