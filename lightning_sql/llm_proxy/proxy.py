"""``LLMProxy``: Agent-Lightning 0.3's proxy surface over lightning_sql's own OpenAI-compatible proxy.

Code written for ``agentlightning.LLMProxy`` runs unchanged: the constructor takes the same arguments
(``litellm_config``, ``middlewares`` and ``callbacks`` are accepted for what they mean here, see
``LLMProxy``), ``start``/``stop``/``restart`` are coroutines, and ``as_resource`` returns the same
``ProxyLLM`` / ``LLM`` resources.  Importing this module needs no HTTP library: Starlette, uvicorn and
httpx (the ``proxy`` extra) are imported by ``start()``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_sql.llm_proxy.config import (
    ModelConfig,
    ProxySettings,
    UnattributedPolicy,
    parse_model_list,
)
from lightning_sql.types import LLM, ProxyLLM

if TYPE_CHECKING:
    from lightning_sql.llm_proxy.app import ProxyApp
    from lightning_sql.llm_proxy.server import LaunchMode, ProxyServer
    from lightning_sql.store.base import LightningStore

__all__ = ["LLMProxy"]

logger = logging.getLogger(__name__)

_MIDDLEWARES = ("rollout_attempt", "stream_conversion", "message_inspection")
_CALLBACKS = ("return_token_ids", "opentelemetry", "logprobs")
_LAUNCH_MODES = ("thread", "mp", "asyncio")
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _outbound_address() -> str:
    """This machine's address as other machines see it (no packet is sent); loopback when offline."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _import_server() -> Any:
    try:
        from lightning_sql.llm_proxy import server
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImportError(
            f"The LLM proxy needs Starlette, uvicorn and httpx: pip install 'lightning_sql[proxy]' ({exc})"
        ) from exc
    return server


class LLMProxy:
    """An OpenAI-compatible proxy that records every model call, with its token ids, into the store.

    Args:
        port: TCP port; a free one is picked now when None (so ``as_resource`` works before ``start``).
        model_list: LiteLLM-style entries ``{"model_name": ..., "litellm_params": {"model":
            "hosted_vllm/<name>" | "openai/<name>", "api_base": ..., "api_key": ...}}``; several entries
            with one ``model_name`` are balanced (fewest calls in flight first).
        store: where calls are recorded; the Trainer sets its own.
        host: address to bind; default ``127.0.0.1``.  ``0.0.0.0`` serves other machines and advertises
            this machine's outbound address in ``as_resource``.
        litellm_config: LiteLLM proxy settings; ``litellm_settings.num_retries`` and
            ``litellm_settings.request_timeout`` are honoured, the rest is ignored (with a warning).
        num_retries: retries of a call on connection errors and 5xx answers.
        num_workers: only 1 (one server process) is supported.
        launch_mode: ``"thread"`` (default), ``"mp"`` or ``"asyncio"`` (see ``lightning_sql.llm_proxy.server``).
        middlewares: Agent-Lightning's middleware aliases, accepted for compatibility: routing by rollout
            and attempt is built in, and streams are always passed through as streams.
        callbacks: Agent-Lightning's callback aliases: ``"logprobs"`` asks upstreams for log-probabilities;
            token ids (``"return_token_ids"``) and recording (``"opentelemetry"``) are built in.
        unattributed: ``"record"`` (default) stores calls of unknown rollout attempts under the proxy's
            unattributed rollout; ``"refuse"`` answers them 404.
        request_timeout: seconds an upstream may take to answer (between chunks, for a stream).
        connect_timeout: seconds to connect to an upstream.
        retry_backoff: seconds before the first retry, doubled each retry.
        logprobs: ask upstreams for log-probabilities unless the client says otherwise.
        startup_timeout: seconds ``start()`` waits for the server.
        token: when set, every call needs ``Authorization: Bearer <token>``; ``as_resource`` puts it in
            the resource's ``api_key``, which the OpenAI SDK sends so.  Without one, anyone who can
            reach the port can call the model and write into rollouts: binding another address than
            loopback without a token logs a warning.
        max_body_bytes: largest request body (413 beyond); default 16 MiB.
        allowed_hosts: ``Host`` names served besides loopback and the bound address (``"*"``: any).
    """

    def __init__(
        self,
        port: int | None = None,
        model_list: list[ModelConfig] | None = None,
        store: LightningStore | None = None,
        host: str | None = None,
        litellm_config: dict[str, Any] | None = None,
        num_retries: int = 0,
        num_workers: int = 1,
        launch_mode: LaunchMode = "thread",
        middlewares: Sequence[str] | None = None,
        callbacks: Sequence[str] | None = None,
        *,
        unattributed: UnattributedPolicy = "record",
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        retry_backoff: float = 0.1,
        logprobs: bool = False,
        startup_timeout: float = 30.0,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        allowed_hosts: Sequence[str] = (),
    ) -> None:
        if launch_mode not in _LAUNCH_MODES:
            raise ValueError(f"launch_mode must be one of {_LAUNCH_MODES}, got {launch_mode!r}")
        if num_workers != 1:
            raise ValueError(f"num_workers must be 1 (one proxy server process), got {num_workers!r}")
        for alias in middlewares or ():
            if alias not in _MIDDLEWARES:
                raise ValueError(f"Invalid middleware alias: {alias!r}. Available aliases are: {list(_MIDDLEWARES)}")
        for alias in callbacks or ():
            if alias not in _CALLBACKS:
                raise ValueError(f"Invalid callback alias: {alias!r}. Available aliases are: {list(_CALLBACKS)}")
        settings = dict((litellm_config or {}).get("litellm_settings") or {})
        num_retries = int(settings.pop("num_retries", num_retries))
        request_timeout = float(settings.pop("request_timeout", request_timeout))
        ignored = sorted(settings) + sorted(k for k in (litellm_config or {}) if k != "litellm_settings")
        if ignored:
            logger.warning("LLMProxy ignores these LiteLLM settings: %s", ignored)
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port must be an int in 1..65535 or None, got {port!r}")
        self.host = host or "127.0.0.1"
        self.port = port if port is not None else _free_port(self.host)
        self.access_host = _outbound_address() if self.host in ("0.0.0.0", "::") else self.host
        self.launch_mode: LaunchMode = launch_mode
        self.store = store
        self.model_list: list[ModelConfig] = list(model_list or [])
        self._settings = ProxySettings(
            upstreams=parse_model_list(self.model_list),
            num_retries=num_retries,
            retry_backoff=retry_backoff,
            request_timeout=request_timeout,
            connect_timeout=connect_timeout,
            unattributed=unattributed,
            logprobs=logprobs or "logprobs" in (callbacks or ()),
            max_body_bytes=max_body_bytes,
            token=token,
            host=self.host,
            allowed_hosts=tuple(allowed_hosts),
        )
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = 10.0
        self._server: ProxyServer | None = None
        self._app: ProxyApp | None = None
        self._unattributed_target: tuple[str, str] | None = None

    def __repr__(self) -> str:
        return f"LLMProxy({self.endpoint!r}, models={[m['model_name'] for m in self.model_list]}, {self.launch_mode})"

    # --- configuration ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://host:port``: the base every resource endpoint starts with."""
        return f"http://{self.access_host}:{self.port}"

    def get_store(self) -> LightningStore | None:
        return self.store

    def set_store(self, store: LightningStore) -> None:
        """Record into ``store`` (in ``thread``/``asyncio`` mode from the next call on)."""
        self.store = store

    def update_model_list(self, model_list: list[ModelConfig]) -> None:
        """Replace the model list (validated now; a running ``mp`` server uses it after ``restart()``).

        Raises:
            ValueError: an entry is malformed (the current list stays).
        """
        upstreams = parse_model_list(model_list)
        self.model_list = list(model_list)
        self._settings.upstreams = upstreams
        if self._app is not None:
            self._app.update_upstreams(upstreams)
        logger.info("LLMProxy model list: %s", [m["model_name"] for m in self.model_list])

    # --- life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving; returns once the server accepts connections.

        Raises:
            ValueError: no store is set.
            RuntimeError: the store cannot be used in this launch mode, or the server did not start.
        """
        if self.store is None:
            raise ValueError("Store is not set. Please set the store before starting the LLMProxy.")
        if self.is_running():
            logger.warning("LLMProxy is already running at %s", self.endpoint)
            return
        capabilities = self.store.capabilities
        if self.launch_mode == "mp" and not capabilities.get("zero_copy", False):
            raise RuntimeError("The store cannot be shared with another process (not zero_copy): use thread mode")
        if self.launch_mode == "thread" and not capabilities.get("thread_safe", False):
            raise RuntimeError("The store is not thread-safe: use asyncio mode")
        server = _import_server()
        from lightning_sql.llm_proxy.app import ProxyApp

        if not _is_loopback(self.host) and self._settings.token is None:
            logger.warning(
                "LLMProxy serves %s without a token: anyone who can reach port %d can call the model and "
                "add calls to rollouts (LLMProxy(token=...))", self.host, self.port,
            )

        def make_app() -> ProxyApp:
            self._app = ProxyApp(self._settings, self.get_store, self._unattributed_target)
            return self._app

        self._server = await server.start_server(
            self.launch_mode, make_app, self._settings, self.store, self.host, self.port, self.access_host,
            self.startup_timeout, self.shutdown_timeout,
        )
        logger.info("LLMProxy serving %s at %s (%s mode)", [m["model_name"] for m in self.model_list],
                    self.endpoint, self.launch_mode)

    async def stop(self) -> None:
        """Stop serving: calls in flight finish (up to the shutdown timeout), their spans are stored."""
        if self._server is None:
            logger.warning("LLMProxy is not running. Nothing to stop.")
            return
        server, self._server = self._server, None
        await server.stop()
        if self._app is not None:
            self._unattributed_target = self._app.recorder.unattributed_target
            self._app = None

    async def restart(self) -> None:
        """Stop if running, then start (picks up a new model list in ``mp`` mode)."""
        if self.is_running():
            await self.stop()
        await self.start()

    def is_running(self) -> bool:
        return self._server is not None and self._server.is_running()

    @property
    def server_pid(self) -> int | None:
        """The id of the process serving the proxy (this one, except in ``mp`` mode), None when stopped."""
        return self._server.pid if self._server is not None else None

    # --- resources -------------------------------------------------------------------------------

    def as_resource(
        self,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        model: str | None = None,
        sampling_parameters: dict[str, Any] | None = None,
    ) -> LLM:
        """An LLM resource pointing at this proxy.

        Without ids: a ``ProxyLLM`` (runners route it to their attempt).  With both ids: an ``LLM`` whose
        endpoint is ``http://host:port/rollout/<rid>/attempt/<aid>``.

        Raises:
            ValueError: only one id is given, or ``model`` is None while the list has several names.
        """
        if model is None:
            names = {m["model_name"] for m in self.model_list}
            if not names:
                raise ValueError("No models found in model_list. Please specify the model.")
            if len(names) > 1:
                raise ValueError(f"Multiple models found in model_list: {sorted(names)}. Please specify the model.")
            model = next(iter(names))
        if rollout_id is None and attempt_id is None:
            return ProxyLLM(
                endpoint=self.endpoint, model=model, sampling_parameters=dict(sampling_parameters or {}),
                api_key=self._settings.token,
            )
        if rollout_id is not None and attempt_id is not None:
            return LLM(
                endpoint=f"{self.endpoint}/rollout/{rollout_id}/attempt/{attempt_id}",
                model=model,
                sampling_parameters=dict(sampling_parameters or {}),
                api_key=self._settings.token,
            )
        raise ValueError("Either rollout_id and attempt_id must be provided, or neither.")
