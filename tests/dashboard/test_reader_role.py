"""The dashboard works as the read-only PostgreSQL role of docs/operations.md (SELECT only)."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from lightning_sql.server.dashboard import Dashboard
from tests.conftest import PG_URL, BackendSpec
from tests.dashboard.conftest import serve
from tests.dashboard.seed import DEMO_RUN, Seeded
from tests.helpers import pg_execute


@pytest.mark.parametrize("mp_backend", ["postgres"], indirect=True)
async def test_every_page_works_as_the_reader_role(mp_backend: BackendSpec, seeded: Seeded) -> None:
    schema = mp_backend.schema
    assert schema is not None
    reader = f"lsql_reader_{uuid.uuid4().hex[:8]}"
    await pg_execute(
        PG_URL,
        f"CREATE ROLE {reader} LOGIN PASSWORD 'pw-{reader}'; GRANT USAGE ON SCHEMA {schema} TO {reader}; "
        f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {reader}",
    )
    try:
        dashboard = Dashboard(PG_URL.replace("postgres@", f"{reader}:pw-{reader}@", 1), schema=schema)
        with serve(dashboard) as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                home = await client.get("/")
                assert home.status_code == 200 and DEMO_RUN in home.text
                found = re.search(rf'data-run-id="(\d+)">\s*<td class="name"><a href="[^"]+"><bdi>{DEMO_RUN}</bdi>', home.text)
                assert found is not None
                run_id = found.group(1)
                paths = [
                    f"/runs/{run_id}",
                    f"/runs/{run_id}/rollouts",
                    f"/runs/{run_id}/rollouts?q=boom",
                    f"/runs/{run_id}/rollouts/{seeded.llm_rollout}",
                    f"/runs/{run_id}/resources",
                ]
                for path in paths:
                    response = await client.get(path)
                    assert response.status_code == 200, (path, response.text[:500])
    finally:
        await pg_execute(PG_URL, f"DROP OWNED BY {reader}; DROP ROLE IF EXISTS {reader}")
