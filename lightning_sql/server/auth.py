"""Token authentication: the API, ingestion, metrics and dashboard need the server's token.

Machines send ``Authorization: Bearer <token>`` (or HTTP Basic with the token as the password, which
is what a client given ``http://user:<token>@host:port`` sends).  A browser asks for the token once
on ``/login``, which sets an HttpOnly, SameSite=Strict cookie holding a digest of the token (never
the token itself); the cookie is honoured on dashboard pages only, so a page elsewhere cannot make a
browser write through the API.  Every comparison is constant-time.  ``/healthz`` and the login page
need no token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lightning_sql.server.errors import error_response

COOKIE_NAME = "lightning_sql_session"
OPEN_PATHS = frozenset({"/healthz", "/login", "/logout"})
# Paths for programs, not browsers: the login cookie is not accepted there.
MACHINE_PREFIXES = ("/v1/", "/metrics")
COOKIE_MAX_AGE_S = 7 * 24 * 3600
# Wrong tokens one client address may try per window before /login answers 429: a person mistypes a
# few times, a guesser needs millions.
MAX_FAILED_LOGINS = 5
LOGIN_WINDOW_S = 60.0
# Client addresses remembered; the oldest is forgotten first (bounded memory under many addresses).
MAX_TRACKED_CLIENTS = 10_000


def session_value(token: str) -> str:
    """The cookie value for ``token``: a keyed digest, so the cookie never holds the token itself."""
    return hmac.new(token.encode(), b"lightning_sql dashboard session", hashlib.sha256).hexdigest()


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def header_token(authorization: str) -> str | None:
    """The token an ``Authorization`` header carries (Bearer, or Basic's password), if any."""
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
        _user, sep, password = decoded.partition(":")
        return password if sep else None
    return None


def _cookie(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, val = part.strip().partition("=")
            if key == COOKIE_NAME:
                return val
    return None


def safe_next(target: str | None) -> str:
    """A local path to go to after login (never another site)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


class TokenAuthMiddleware:
    """Lets a request through when it carries the token (or no token is configured)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token
        self.session = session_value(token) if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if path in OPEN_PATHS or self._authorised(scope, path):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        wants_page = b"text/html" in headers.get(b"accept", b"") and scope.get("method") in ("GET", "HEAD")
        if wants_page and not path.startswith(MACHINE_PREFIXES):
            query = scope.get("query_string", b"").decode("latin-1")
            target = path + (f"?{query}" if query else "")
            await RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303)(scope, receive, send)
            return
        response = error_response(
            401,
            "this server needs its token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": 'Bearer realm="lightning-sql"'},
        )
        await response(scope, receive, send)

    def _authorised(self, scope: Scope, path: str) -> bool:
        assert self.token is not None and self.session is not None
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        for name, value in headers:
            if name == b"authorization":
                given = header_token(value.decode("latin-1"))
                return given is not None and _same(given, self.token)
        if path.startswith(MACHINE_PREFIXES):
            return False
        cookie = _cookie(headers)
        return cookie is not None and _same(cookie, self.session)


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>lightning-sql: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:system-ui,sans-serif;max-width:24rem;margin:15vh auto;padding:0 1rem}}
input{{width:100%;padding:.5rem;margin:.5rem 0;box-sizing:border-box}}.error{{color:#b00020}}</style>
</head><body><h1>lightning-sql</h1><p>This server needs its access token.</p>{error}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<label>Token <input type="password" name="token" autocomplete="current-password" autofocus required></label>
<input type="submit" value="Sign in"></form></body></html>"""


def _login_page(next_path: str, error: str | None = None, status: int = 200) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    body = _LOGIN_PAGE.format(error=message, next=html.escape(next_path, quote=True))
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})


class LoginThrottle:
    """Failed logins per client address in a sliding window of ``LOGIN_WINDOW_S``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, client: str) -> deque[float]:
        failures = self._failures.get(client)
        if failures is None:
            failures = self._failures[client] = deque()
            while len(self._failures) > MAX_TRACKED_CLIENTS:
                self._failures.popitem(last=False)
        horizon = self.clock() - LOGIN_WINDOW_S
        while failures and failures[0] <= horizon:
            failures.popleft()
        return failures

    def retry_after(self, client: str) -> int | None:
        """Seconds until ``client`` may try again, or None when it may now."""
        failures = self._recent(client)
        if len(failures) < MAX_FAILED_LOGINS:
            return None
        return max(1, math.ceil(failures[0] + LOGIN_WINDOW_S - self.clock()))

    def failed(self, client: str) -> None:
        self._recent(client).append(self.clock())

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


def login_routes(token: str | None, throttle: LoginThrottle | None = None) -> list[Route]:
    """``GET/POST /login`` and ``POST /logout`` (with no token configured, login just goes home)."""
    throttle = throttle or LoginThrottle()

    async def login_form(request: Request) -> Response:
        next_path = safe_next(request.query_params.get("next"))
        if token is None:
            return RedirectResponse(next_path, status_code=303)
        return _login_page(next_path)

    async def login_submit(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"), keep_blank_values=True)
        next_path = safe_next((form.get("next") or ["/"])[0])
        if token is None:
            return RedirectResponse(next_path, status_code=303)
        client = request.client.host if request.client is not None else ""
        wait = throttle.retry_after(client)
        if wait is not None:
            page = _login_page(next_path, f"Too many wrong tokens: try again in {wait} s.", status=429)
            page.headers["Retry-After"] = str(wait)
            return page
        given = (form.get("token") or [""])[0]
        if not _same(given, token):
            throttle.failed(client)
            return _login_page(next_path, "That token is not this server's token.", status=401)
        throttle.succeeded(client)
        response = RedirectResponse(next_path, status_code=303)
        response.set_cookie(
            COOKIE_NAME,
            session_value(token),
            max_age=COOKIE_MAX_AGE_S,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(request: Request) -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="strict")
        return response

    return [
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login_submit, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
    ]
