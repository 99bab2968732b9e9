"""Reinforcement-learning data through the LLM proxy: token ids and rewards, offline.

A stand-in model server (deterministic, OpenAI-compatible, returning token ids the way vLLM does with
``return_token_ids``) runs beside a Trainer whose ``llm_proxy`` fronts it.  The agent asks its sums with
the official ``openai`` SDK through the proxy (every other call streamed); the proxy records each call,
with its prompt and response token ids, as a span of the agent's rollout attempt; the algorithm turns
each rollout's spans into triplets (prompt token ids, response token ids, reward), the data an RL
trainer updates the policy with.  At the end it prints the triplets of a few rollouts and the SQL that
reads them back.

    python examples/rl_proxy.py                      # sqlite:///rl_proxy.db, a fresh run each time
    python examples/rl_proxy.py --url postgresql://user@host/db --tasks 32

With a real vLLM instead of the stand-in, see docs/llm-proxy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sqlite3
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_sql import LLM, Algorithm, SqlLightningStore, Trainer, rollout
from lightning_sql.llm_proxy.testing import StandInModelServer
from lightning_sql.types import Triplet

RUN_NAME = "rl-proxy"
MODEL = "policy"
console = Console()


@rollout
async def adder(task: dict[str, Any], llm: LLM) -> float:
    """One model call through the proxy (the runner routed `llm` to this rollout attempt); reward 1 if right."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.get_base_url(), api_key="unused-by-the-stand-in")
    messages = [
        {"role": "system", "content": "Answer with the number."},
        {"role": "user", "content": f"What is {task['question']}?"},
    ]
    if task["stream"]:
        stream = await client.chat.completions.create(
            model=llm.model, messages=messages, stream=True, **llm.sampling_parameters  # type: ignore[arg-type]
        )
        answer = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    else:
        response = await client.chat.completions.create(
            model=llm.model, messages=messages, **llm.sampling_parameters  # type: ignore[arg-type]
        )
        answer = response.choices[0].message.content or ""
    await client.close()
    return 1.0 if answer.split()[-1:] == [str(task["answer"])] else 0.0


class CollectTriplets(Algorithm):
    """One round of RL data collection: publish the policy behind the proxy, run every task, adapt.

    A real algorithm would now update the model from `self.triplets` (e.g. with verl) and publish the
    new weights behind the same proxy (`llm_proxy.update_model_list(...)`, then the next round).
    """

    def __init__(self) -> None:
        super().__init__()
        self.triplets: dict[str, list[Triplet]] = {}
        self.failures: dict[str, str] = {}

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store, proxy = self.get_store(), self.get_llm_proxy()
        assert proxy is not None, "Trainer(llm_proxy=...) hands the proxy to the algorithm"
        # A ProxyLLM: each runner turns it into an endpoint of its own rollout attempt.
        await store.update_resources("policy", {"llm": proxy.as_resource(sampling_parameters={"temperature": 0.7})})
        rollouts = [await store.enqueue_rollout(task, mode="train", resources_id="policy") for task in train_dataset or []]
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in rollouts], timeout=120)
        adapter = self.get_adapter()
        for r in finished:
            if r.status != "succeeded":  # the runner put the agent's error in the attempt's metadata
                attempt = await store.get_latest_attempt(r.rollout_id)
                error = (attempt.metadata or {}).get("error") if attempt is not None else None
                self.failures[r.rollout_id] = f"{error['type']}: {error['message']}" if error else r.status
            # A rollout whose agent failed before its first call has no spans, and so no triplets.
            self.triplets[r.rollout_id] = adapter.adapt(list(await store.query_spans(r.rollout_id, "latest")))


def make_tasks(n: int, seed: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        tasks.append({"question": f"{a} + {b}", "answer": a + b, "stream": i % 2 == 1})
    return tasks


SQLITE_SQL = """\
SELECT s.rollout_id,
       s.sequence_id,
       json_extract(s.attributes, '$.prompt_token_ids')   AS prompt_token_ids,
       json_extract(s.attributes, '$.response_token_ids') AS response_token_ids,
       r.final_reward                                     AS reward
FROM spans s
JOIN rollout_summary_v1 r ON r.run_id = s.run_id AND r.rollout_id = s.rollout_id
WHERE r.run_name = '{run}' AND s.name = 'openai.chat.completion' AND s.attempt_id = r.latest_attempt_id
ORDER BY s.rollout_id, s.sequence_id
LIMIT {limit};"""

POSTGRES_SQL = """\
SELECT s.rollout_id,
       s.sequence_id,
       s.attributes -> 'prompt_token_ids'   AS prompt_token_ids,
       s.attributes -> 'response_token_ids' AS response_token_ids,
       r.final_reward                       AS reward
FROM spans s
JOIN rollout_summary_v1 r ON r.run_id = s.run_id AND r.rollout_id = s.rollout_id
WHERE r.run_name = '{run}' AND s.name = 'openai.chat.completion' AND s.attempt_id = r.latest_attempt_id
ORDER BY s.rollout_id, s.sequence_id
LIMIT {limit};"""


def _ids(ids: list[int], keep: int = 6) -> str:
    return "[" + ", ".join(map(str, ids[:keep])) + (", …" if len(ids) > keep else "") + f"] ({len(ids)})"


def show(algorithm: CollectTriplets, url: str, run: str, limit: int) -> None:
    table = Table(title=f"Triplets of {limit} rollouts (token ids from the proxy, reward from the agent)")
    for column in ("rollout", "prompt token ids", "response token ids", "response", "reward"):
        table.add_column(column)
    for rollout_id, triplets in list(algorithm.triplets.items())[:limit]:
        for t in triplets:
            text = (t.response.get("raw_content") or [{}])[0].get("content", "")
            table.add_row(rollout_id, _ids(t.prompt["token_ids"]), _ids(t.response["token_ids"]), text, str(t.reward))
    console.print(table)
    rewards = [t.reward for ts in algorithm.triplets.values() for t in ts if t.reward is not None]
    with_ids = sum(1 for ts in algorithm.triplets.values() for t in ts if t.prompt["token_ids"] and t.response["token_ids"])
    total = sum(len(ts) for ts in algorithm.triplets.values())
    console.print(f"rollouts: {len(algorithm.triplets)}  triplets: {total}  with token ids: {with_ids}  "
                  f"mean reward: {sum(rewards) / max(len(rewards), 1):.2f}")
    if algorithm.failures:
        first = next(iter(algorithm.failures.values()))
        console.print(f"[red]{len(algorithm.failures)} rollout(s) failed[/red], the first with: {first}", highlight=False)
    if url.startswith("sqlite:///"):
        sql = SQLITE_SQL.format(run=run, limit=limit)
        console.print("\n[bold]The same data in SQL[/bold] (sqlite3 " + url.removeprefix("sqlite:///") + "):")
        console.print(sql, markup=False, highlight=False, soft_wrap=True)
        with sqlite3.connect(f"file:{url.removeprefix('sqlite:///')}?mode=ro", uri=True) as db:
            for row in db.execute(sql):
                console.print(" | ".join(map(str, row)), markup=False, highlight=False, soft_wrap=True)
    else:
        console.print("\n[bold]The same data in SQL[/bold] (psql):")
        console.print(POSTGRES_SQL.format(run=run, limit=limit), markup=False, highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> CollectTriplets:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="sqlite:///rl_proxy.db")
    parser.add_argument("--run", default=RUN_NAME)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--runners", type=int, default=4)
    parser.add_argument("--show", type=int, default=3, help="rollouts whose triplets are printed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import openai  # noqa: F401 - the agent's SDK, imported by every rollout
    except ImportError:
        raise SystemExit("examples/rl_proxy.py needs the openai SDK: pip install -e '.[proxy]'") from None

    async def fresh() -> None:  # each run of the example starts over
        store = SqlLightningStore(args.url, run=args.run)
        await store.delete_run(args.run)
        await store.close()

    asyncio.run(fresh())
    with StandInModelServer(model="stand-in") as model_server:
        console.print(f"stand-in model server at {model_server.url}")
        algorithm = CollectTriplets()
        trainer = Trainer(
            store=args.url,
            run=args.run,
            n_runners=args.runners,
            algorithm=algorithm,
            llm_proxy={
                "model_list": [
                    {"model_name": MODEL,
                     "litellm_params": {"model": "hosted_vllm/stand-in", "api_base": model_server.url}},
                ],
                "num_retries": 2,
            },
        )
        console.print(f"LLM proxy at {trainer.llm_proxy.endpoint}")
        trainer.fit(adder, train_dataset=make_tasks(args.tasks))
        asyncio.run(trainer.store.close())  # type: ignore[attr-defined]
    show(algorithm, args.url, args.run, args.show)
    return algorithm


if __name__ == "__main__":
    main()
