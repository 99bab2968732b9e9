"""Imports a test module needs: a skip on a laptop without the extra, a failure in CI.

``LIGHTNING_SQL_REQUIRE_SERVER=1`` (the ``[server]`` and ``[proxy]`` extras) and
``LIGHTNING_SQL_REQUIRE_AGENTLIGHTNING=1`` are set by ``.ci/run``, like ``LIGHTNING_SQL_REQUIRE_POSTGRES``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

SERVER = "LIGHTNING_SQL_REQUIRE_SERVER"
AGENTLIGHTNING = "LIGHTNING_SQL_REQUIRE_AGENTLIGHTNING"


def required_import(module: str, variable: str) -> ModuleType:
    """``module``, imported; when it cannot be, a skip, or a failure when ``variable`` is ``1``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get(variable) == "1":
            pytest.fail(f"{module} is required ({variable}=1) but cannot be imported: {exc}", pytrace=False)
        pytest.skip(f"{module} is not importable: {exc}", allow_module_level=True)
