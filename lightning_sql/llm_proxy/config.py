"""The model list: Agent-Lightning's ``model_list`` entries, validated, and balanced across upstreams.

An entry is ``{"model_name": <name clients ask for>, "litellm_params": {"model": "<provider>/<upstream
model>", "api_base": ..., "api_key": ...}}``, as in LiteLLM's proxy config.  Only OpenAI-compatible
providers are served (``hosted_vllm/`` and ``openai/``): the proxy forwards requests unchanged apart from
the model name, so any server speaking OpenAI's HTTP API (vLLM, SGLang, OpenAI) works.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

__all__ = [
    "ModelConfig",
    "Upstream",
    "ModelRouter",
    "ProxySettings",
    "UnattributedPolicy",
    "parse_model_list",
    "PROVIDERS",
]

PROVIDERS = ("hosted_vllm", "openai")
"""Provider prefixes of ``litellm_params.model`` the proxy serves (OpenAI-compatible upstreams)."""

DEFAULT_OPENAI_BASE = "https://api.openai.com/v1"

# litellm_params keys the proxy interprets; any other key is a default request parameter
# (e.g. ``temperature``), sent unless the client sets it, as LiteLLM does.
_CONNECTION_KEYS = frozenset({"model", "api_base", "api_key", "timeout", "stream_timeout", "extra_headers"})
# Keys LiteLLM knows that make no sense for a pass-through proxy: accepted and ignored.
_IGNORED_KEYS = frozenset({"rpm", "tpm", "max_retries", "num_retries", "custom_llm_provider", "api_version"})

UnattributedPolicy = Literal["record", "refuse"]
"""What happens to a call whose rollout/attempt is unknown (or that names none).

* ``"record"``: served, and its span is stored under the proxy's own *unattributed* rollout;
* ``"refuse"``: answered with 404 before anything is forwarded; a call without a rollout prefix is refused too.
"""


class ModelConfig(TypedDict):
    """One entry of the model list (LiteLLM's ``model_list`` item)."""

    model_name: str
    litellm_params: dict[str, Any]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: the router counts calls per object
class Upstream:
    """One model server behind a model name."""

    model_name: str
    """The name clients ask for."""
    provider: str
    """``hosted_vllm`` or ``openai``."""
    upstream_model: str
    """The model name sent upstream (``litellm_params.model`` without its provider prefix)."""
    api_base: str
    """Base URL including ``/v1``; routes are appended (``/chat/completions``)."""
    api_key: str | None = None
    timeout: float | None = None
    """Read timeout of non-streaming calls (seconds); None: the proxy's default."""
    stream_timeout: float | None = None
    """Read timeout between two chunks of a stream (seconds); None: ``timeout``."""
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Request parameters sent unless the client sets them."""

    @property
    def name(self) -> str:
        """How spans and logs name this upstream: its base URL and model."""
        return f"{self.api_base}#{self.upstream_model}"

    @property
    def wants_token_ids(self) -> bool:
        """vLLM returns prompt and response token ids when asked (``return_token_ids``)."""
        return self.provider == "hosted_vllm"


def _resolve_secret(value: Any, where: str) -> str | None:
    """``os.environ/NAME`` (LiteLLM's syntax) reads the variable; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a str, got {type(value).__name__}")
    if value.startswith("os.environ/"):
        name = value.removeprefix("os.environ/")
        resolved = os.environ.get(name)
        if resolved is None:
            raise ValueError(f"{where} names the environment variable {name!r}, which is not set")
        return resolved
    return value


def _positive_float(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


def _parse_entry(index: int, entry: Any) -> Upstream:
    where = f"model_list[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict with 'model_name' and 'litellm_params', got {entry!r}")
    name = entry.get("model_name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.model_name must be a non-empty str, got {name!r}")
    params = entry.get("litellm_params")
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.litellm_params must be a dict, got {params!r}")
    model = params.get("model")
    if not isinstance(model, str) or "/" not in model:
        raise ValueError(
            f"{where}.litellm_params.model must be '<provider>/<model>' with provider one of {PROVIDERS}, "
            f"got {model!r}"
        )
    provider, _, upstream_model = model.partition("/")
    if provider not in PROVIDERS or not upstream_model:
        raise ValueError(
            f"{where}.litellm_params.model {model!r}: only OpenAI-compatible upstreams are served "
            f"(provider one of {PROVIDERS})"
        )
    api_base = params.get("api_base")
    if api_base is None and provider == "openai":
        api_base = os.environ.get("OPENAI_BASE_URL") or DEFAULT_OPENAI_BASE
    if not isinstance(api_base, str) or not api_base.startswith(("http://", "https://")):
        raise ValueError(f"{where}.litellm_params.api_base must be an http(s) URL, got {api_base!r}")
    api_key = _resolve_secret(params.get("api_key"), f"{where}.litellm_params.api_key")
    if api_key is None and provider == "openai":
        api_key = os.environ.get("OPENAI_API_KEY")
    headers = params.get("extra_headers") or {}
    if not isinstance(headers, Mapping) or not all(isinstance(v, str) for v in headers.values()):
        raise ValueError(f"{where}.litellm_params.extra_headers must be a dict of str, got {headers!r}")
    defaults = {k: v for k, v in params.items() if k not in _CONNECTION_KEYS and k not in _IGNORED_KEYS}
    return Upstream(
        model_name=name,
        provider=provider,
        upstream_model=upstream_model,
        api_base=api_base.rstrip("/"),
        api_key=api_key,
        timeout=_positive_float(params.get("timeout"), f"{where}.litellm_params.timeout"),
        stream_timeout=_positive_float(params.get("stream_timeout"), f"{where}.litellm_params.stream_timeout"),
        extra_headers=dict(headers),
        defaults=defaults,
    )


def parse_model_list(model_list: Sequence[Any] | None) -> list[Upstream]:
    """Validate a model list.

    Raises:
        ValueError: an entry is malformed or names a provider that is not OpenAI-compatible.
    """
    if model_list is None:
        return []
    if isinstance(model_list, (str, bytes)) or not isinstance(model_list, Sequence):
        raise ValueError(f"model_list must be a list of model entries, got {type(model_list).__name__}")
    return [_parse_entry(i, entry) for i, entry in enumerate(model_list)]


class ModelRouter:
    """Picks an upstream for a model name: the one with the fewest calls in flight, round-robin on ties.

    ``pick(name, avoid)`` skips upstreams in ``avoid`` when another one exists (a retry goes elsewhere).
    Thread-safe: the proxy's event loop picks, and ``LLMProxy.update_model_list`` may replace the router.
    """

    def __init__(self, upstreams: Sequence[Upstream]) -> None:
        self._by_name: dict[str, list[Upstream]] = {}
        for upstream in upstreams:
            self._by_name.setdefault(upstream.model_name, []).append(upstream)
        self._in_flight: dict[Upstream, int] = {u: 0 for u in upstreams}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    @property
    def model_names(self) -> list[str]:
        return list(self._by_name)

    def upstreams(self, model_name: str) -> list[Upstream]:
        return list(self._by_name.get(model_name, ()))

    def pick(self, model_name: str, avoid: Sequence[Upstream] = ()) -> Upstream | None:
        candidates = self._by_name.get(model_name)
        if not candidates:
            return None
        fresh = [u for u in candidates if u not in avoid] or candidates
        with self._lock:
            start = next(self._turn) % len(fresh)
            rotated = fresh[start:] + fresh[:start]
            chosen = min(rotated, key=lambda u: self._in_flight.get(u, 0))
            self._in_flight[chosen] = self._in_flight.get(chosen, 0) + 1
        return chosen

    def release(self, upstream: Upstream) -> None:
        with self._lock:
            self._in_flight[upstream] = max(self._in_flight.get(upstream, 1) - 1, 0)


@dataclass
class ProxySettings:
    """Everything the proxy's HTTP app needs besides the store (picklable, for the ``mp`` launch mode)."""

    upstreams: list[Upstream]
    num_retries: int = 0
    retry_backoff: float = 0.1
    """Seconds before the first retry; doubled each retry (capped at 5 s)."""
    request_timeout: float = 600.0
    """Default read timeout of an upstream call (seconds)."""
    connect_timeout: float = 5.0
    unattributed: UnattributedPolicy = "record"
    logprobs: bool = False
    """Ask upstreams for log-probabilities of the sampled tokens (``logprobs``) unless the client says."""
    max_connections: int = 1000
    """Connection pool size per proxy process."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body accepted (413 beyond)."""
    token: str | None = None
    """When set, every call but ``/health`` needs ``Authorization: Bearer <token>`` (the OpenAI SDK's api_key)."""
    host: str = "127.0.0.1"
    """The bound address; with ``allowed_hosts``, the ``Host`` names served (``lightning_sql.server.guard``)."""
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_retries, bool) or not isinstance(self.num_retries, int) or self.num_retries < 0:
            raise ValueError(f"num_retries must be an int >= 0, got {self.num_retries!r}")
        if self.unattributed not in ("record", "refuse"):
            raise ValueError(f"unattributed must be 'record' or 'refuse', got {self.unattributed!r}")
        for name in ("request_timeout", "connect_timeout"):
            _positive_float(getattr(self, name), name)
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {self.max_body_bytes!r}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("token must be a non-empty str or None")
        if self.retry_backoff < 0:
            raise ValueError(f"retry_backoff must be >= 0, got {self.retry_backoff!r}")
