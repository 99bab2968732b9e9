"""A web page cannot drive a tokenless server on this machine: bodies must be JSON (or the endpoint's
own type), ``Host`` must name the server, a foreign ``Origin`` cannot change state, ``/logout`` is
POST-only and ``/login`` is rate-limited (SQLite files and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from lightning_sql import SqlLightningStore
from lightning_sql.server.auth import MAX_FAILED_LOGINS
from lightning_sql.server.guard import HostPolicy
from tests.server.conftest import RunningServer

ENQUEUE = "/v1/agl/queues/rollouts/enqueue"
BODY = b'{"rollouts": [{"input": 1}]}'


async def test_only_json_bodies_reach_the_api(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for content_type in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]:
            answer = http.post(ENQUEUE, content=BODY, headers={"Content-Type": content_type, "Origin": "http://evil.example"})
            assert answer.status_code in (403, 415), (content_type, answer.text)
            plain = http.post(ENQUEUE, content=BODY, headers={"Content-Type": content_type})
            assert plain.status_code == 415 and "application/json" in plain.json()["detail"], content_type
        assert http.post(ENQUEUE, content=BODY, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 201
    assert [r.input for r in await reader().query_rollouts()] == [1]


async def test_a_foreign_origin_cannot_change_state(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory(cors_origins=("http://ui.example",))
    json_type = {"Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for origin in ["http://evil.example", "null", "http://127.0.0.1.evil.example"]:
            answer = http.post(ENQUEUE, content=BODY, headers={**json_type, "Origin": origin})
            assert answer.status_code == 403 and origin in answer.json()["detail"], origin
        dequeue = http.post("/v1/agl/queues/rollouts/dequeue", headers={"Origin": "http://evil.example"})
        assert dequeue.status_code == 403  # an empty body is no way around it
        same = server.url.lower()
        assert http.post(ENQUEUE, content=BODY, headers={**json_type, "Origin": same}).status_code == 201
        assert http.post(ENQUEUE, content=BODY, headers={**json_type, "Origin": "http://ui.example"}).status_code == 201
        # Reads stay readable by tools; the browser keeps a foreign page from reading the answer.
        assert http.get("/v1/agl/health", headers={"Origin": "http://evil.example"}).status_code == 200
    assert len(await reader().query_rollouts()) == 2


def test_host_must_name_this_server(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory()
    port = server.url.rsplit(":", 1)[1]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for host in ["evil.example", f"evil.example:{port}", f"rebind.attacker.test:{port}", "10.0.0.1"]:
            answer = http.get("/v1/agl/health", headers={"Host": host})
            assert answer.status_code == 421 and host in answer.json()["detail"], host
            assert http.post(ENQUEUE, content=BODY, headers={"Host": host, "Content-Type": "application/json"}).status_code == 421
        for host in [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"]:
            assert http.get("/v1/agl/health", headers={"Host": host}).status_code == 200, host
    allowed = server_factory(allowed_hosts=("trainer.lan",))
    with httpx.Client(base_url=allowed.url, timeout=30) as http:
        assert http.get("/v1/agl/health", headers={"Host": "trainer.lan:4747"}).status_code == 200
        assert http.get("/v1/agl/health", headers={"Host": "evil.example"}).status_code == 421


def test_host_policy_of_a_wildcard_bind() -> None:
    wildcard = HostPolicy("0.0.0.0")
    assert wildcard.allows("192.0.2.7:4747") and wildcard.allows("[2001:db8::1]:4747") and wildcard.allows("localhost")
    assert not wildcard.allows("evil.example:4747") and not wildcard.allows(None)
    bound = HostPolicy("192.0.2.7", ["trainer.lan"])
    assert bound.allows("192.0.2.7:1") and bound.allows("TRAINER.lan") and not bound.allows("192.0.2.8")
    assert HostPolicy("127.0.0.1", ["*"]).allows("anything.example")


def test_logout_is_post_only_and_login_is_rate_limited(server_factory: Callable[..., RunningServer]) -> None:
    server = server_factory(token="tok")
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as http:
        assert http.post("/login", data={"token": "tok"}).status_code == 303
        assert http.get("/logout").status_code == 405
        assert http.cookies  # a GET (an <img> on any page) does not sign out
        out = http.post("/logout")
        assert out.status_code == 303 and out.headers["location"] == "/login"
        assert "max-age=0" in out.headers["set-cookie"].lower() or "expires=" in out.headers["set-cookie"].lower()
        for _ in range(MAX_FAILED_LOGINS):
            assert http.post("/login", data={"token": "guess"}).status_code == 401
        throttled = http.post("/login", data={"token": "tok"})  # even the right token waits
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
        assert "Too many" in throttled.text
        # Machines with the header are not throttled.
        assert http.get("/v1/agl/health", headers={"Authorization": "Bearer tok"}).status_code == 200
