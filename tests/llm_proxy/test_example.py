"""``examples/rl_proxy.py`` runs offline, as a newcomer would run it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from lightning_sql import SqlLightningStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_proxy.py"


def test_rl_proxy_example_prints_triplets_with_token_ids_and_the_sql(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rl.db'}"
    cmd = [sys.executable, str(EXAMPLE), "--url", url, "--tasks", "8", "--runners", "2", "--show", "2"]
    for _ in range(2):  # a second run starts over
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "rollouts: 8  triplets: 8  with token ids: 8" in done.stdout
        assert "json_extract(s.attributes, '$.prompt_token_ids')" in done.stdout
        rows = [line for line in done.stdout.splitlines() if line.startswith("ro-") and " | " in line]
        assert len(rows) == 2 and all(line.count("[") == 2 for line in rows)

    async def check() -> None:
        store = SqlLightningStore(url, run="rl-proxy", read_only=True)
        rollouts = list(await store.query_rollouts())
        assert len(rollouts) == 8 and {r.status for r in rollouts} == {"succeeded"}
        for r in rollouts:
            (call,) = [s for s in await store.query_spans(r.rollout_id) if s.name == "openai.chat.completion"]
            assert call.attributes["prompt_token_ids"] and call.attributes["response_token_ids"]
            assert call.attributes["lightning_sql.proxy.stream"] is r.input["stream"]
        await store.close()

    asyncio.run(check())


def test_the_proxy_extra_brings_what_the_example_imports() -> None:
    import tomllib

    extras = tomllib.loads((EXAMPLE.parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("openai") for req in extras["proxy"]), extras["proxy"]


def test_without_the_sdk_the_example_says_what_to_install(tmp_path: Path) -> None:
    broken = tmp_path / "broken" / "openai"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'openai'\", name='openai')\n")
    env = {"PYTHONPATH": str(broken.parent), "PATH": "/usr/bin:/bin", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", f"sqlite:///{tmp_path / 'rl.db'}", "--tasks", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode != 0 and "pip install -e '.[proxy]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_rollout_without_spans_adapts_to_no_triplets() -> None:
    from lightning_sql.runtime.adapter import TracerTraceToTriplet

    assert TracerTraceToTriplet().adapt([]) == []
