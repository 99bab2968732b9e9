"""What keeps a web page from driving a server on this machine: the ``Host``, ``Origin`` and
``Content-Type`` rules shared by ``lightning-sql serve`` and the LLM proxy.

A page on another site can make the browser send requests to ``127.0.0.1`` (cross-site request
forgery), and a name it controls can be re-pointed at ``127.0.0.1`` (DNS rebinding).  So:

* ``Host`` must name this server: a loopback name or address, the address it is bound to (any IP
  address when it is bound to all of them), or a name the operator allows (``allowed_hosts``; ``*``
  turns the check off).  A rebinding page's requests carry its own name, and get a 421.
* A request with a (non-empty) body must declare it: JSON for the APIs (``application/json``), the endpoint's own
  types elsewhere (OTLP's protobuf, the login form).  Browsers can send ``text/plain`` and forms to
  any site without asking; they cannot send JSON without a CORS preflight, which the server refuses
  to foreign origins.  Anything else gets a 415.
* A state-changing request (not GET, HEAD or OPTIONS) whose ``Origin`` is neither this server's own
  nor an allowed CORS origin gets a 403: browsers always send ``Origin`` on such requests, programs
  do not send one at all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from lightning_sql.server.errors import error_response

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1"})
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
JSON_TYPE = "application/json"


def host_name(value: str) -> str:
    """The host part of a ``Host`` header or ``host:port`` text, lower case, without brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.rsplit(":", 1)[0] if ":" in value else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def media_type(headers: dict[bytes, bytes]) -> str:
    return headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()


class HostPolicy:
    """Which ``Host`` names a server bound to ``bind_host`` answers."""

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = ()) -> None:
        allowed = {host_name(h) for h in allowed_hosts if h.strip()}
        self.any = "*" in allowed
        bound = host_name(bind_host)
        self.any_ip = bound in WILDCARD_ADDRESSES
        self.names = frozenset(LOOPBACK_NAMES | allowed | ({bound} if bound not in WILDCARD_ADDRESSES else set()))

    def allows(self, host_header: str | None) -> bool:
        if self.any:
            return True
        if not host_header:
            return False
        name = host_name(host_header)
        if name in self.names:
            return True
        if _is_ip(name):
            return self.any_ip or ipaddress.ip_address(name).is_loopback
        return False


def json_body_rule(path: str) -> tuple[str, ...] | None:
    """The ``lightning-sql serve`` content types a path accepts for a request body (None: no rule)."""
    if path == "/v1/traces":
        return None  # OTLP answers its own 415, in its own encoding
    if path == "/login":
        return ("application/x-www-form-urlencoded",)
    return (JSON_TYPE,)


class BrowserGuardMiddleware:
    """Applies the ``Host``, ``Origin`` and ``Content-Type`` rules above before the app sees a request.

    ``body_types(path)`` names the media types a request body to ``path`` may have (None: the app
    decides).  ``cors_origins`` are the foreign origins allowed to change state.
    """

    def __init__(
        self,
        app: ASGIApp,
        hosts: HostPolicy,
        body_types: Callable[[str], tuple[str, ...] | None],
        cors_origins: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.hosts = hosts
        self.body_types = body_types
        self.origins = frozenset(o.rstrip("/").lower() for o in cors_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        host = headers.get(b"host", b"").decode("latin-1") or None
        if not self.hosts.allows(host):
            message = (
                f"this server does not answer for the host {host!r}: use its address, localhost, or a name "
                "it allows (lightning-sql serve --allowed-host NAME)"
            )
            await error_response(421, message)(scope, receive, send)
            return
        method = scope.get("method", "GET")
        if method not in SAFE_METHODS:
            origin = headers.get(b"origin", b"").decode("latin-1").strip().rstrip("/").lower()
            if origin and not self._same_origin(origin, host) and origin not in self.origins:
                message = f"requests from the web page at {origin!r} may not change this server (CORS origins: --cors-origin)"
                await error_response(403, message)(scope, receive, send)
                return
            allowed = self.body_types(scope.get("path", ""))
            declared = media_type(headers)
            has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
            if allowed is not None and has_body and declared not in allowed:
                shown = declared or "none"
                message = f"unsupported Content-Type {shown!r}: send {' or '.join(allowed)}"
                await error_response(415, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _same_origin(origin: str, host: str | None) -> bool:
        if host is None or "://" not in origin:
            return False
        return origin.split("://", 1)[1] == host.strip().lower()
