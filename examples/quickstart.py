"""Quickstart: train-and-evaluate an offline agent with lightning_sql — no API key, no network.

The task is small arithmetic ("What is 47 + 38?").  The "LLM" is a deterministic stand-in whose
accuracy depends on the prompt-template resource: a prompt that asks it to work step by step makes
it carry digits correctly; a plain prompt makes it drop carries and guess products.  `Baseline`
runs every train and val sample through 4 runners; every rollout, attempt, span (the LLM call
and the reward) and resource version lands in `quickstart.db`.

    python examples/quickstart.py            # run (or resume, or show the finished run)
    python examples/quickstart.py --fresh    # delete the run and start over
    python examples/quickstart.py --url postgresql://user@host/db --runners 8

Kill it half-way (Ctrl-C) and run it again: finished samples are not redone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import re
import threading
import time
import zlib
from collections import Counter, defaultdict
from typing import Any

from opentelemetry import trace
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lightning_sql import (
    AGL_ANNOTATION,
    FINISHED_STATUSES,
    Baseline,
    LitAgentRunner,
    PromptTemplate,
    Rollout,
    SqlLightningStore,
    Trainer,
    emit_reward,
    reward_value_key,
    rollout,
)

RUN_NAME = "quickstart"
N_TRAIN = 160
N_VAL = 80
SEED = 7
PROMPT = PromptTemplate(
    template="You are a careful calculator. Work step by step, then answer with the number only.\nQ: What is {question}?",
    engine="f-string",
)

console = Console()


# --- the task and a deterministic stand-in for an LLM -----------------------------------------------------


def make_dataset(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` arithmetic problems with their answers (JSON, so the store can keep them)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        problems.append({"question": f"{a} {op} {b}", "answer": answer})
    return problems


def _add_without_carry(a: int, b: int) -> int:
    return int("".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:03d}", f"{b:03d}", strict=True)))


def fake_llm(prompt: str) -> str:
    """A deterministic 'model': careful prompts get carries right; big products are still sometimes off."""
    match = re.search(r"(\d+) ([+*-]) (\d+)", prompt)
    if match is None:
        return "I don't know"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    careful = "step by step" in prompt.lower()
    if op == "+":
        return str(a + b if careful else _add_without_carry(a, b))
    if op == "-":
        return str(a - b)
    exact = a * b
    if careful and (a < 40 or b < 40):
        return str(exact)
    return str(exact - exact % 10)  # rounds big products down to the nearest ten


# --- the agent: one LLM call (an OpenTelemetry span) and a reward ------------------------------------------

tracer = trace.get_tracer("quickstart")


@rollout
async def arithmetic_agent(task: dict[str, Any], prompt_template: PromptTemplate) -> None:
    prompt = prompt_template.format(question=task["question"])
    with tracer.start_as_current_span("openai.chat.completion") as span:
        span.set_attribute("gen_ai.request.model", "fake-calculator-1")
        span.set_attribute("gen_ai.prompt.0.role", "user")
        span.set_attribute("gen_ai.prompt.0.content", prompt)
        await asyncio.sleep(0.02 + zlib.crc32(prompt.encode()) % 40 / 1000)  # "network latency"
        answer = fake_llm(prompt)
        span.set_attribute("gen_ai.completion.0.role", "assistant")
        span.set_attribute("gen_ai.completion.0.content", answer)
    emit_reward(1.0 if answer.strip() == str(task["answer"]) else 0.0)


# --- progress and results ------------------------------------------------------------------------------


def watch_progress(store: SqlLightningStore, total: int, stop: threading.Event) -> None:
    """A live bar of finished rollouts, read from the store (works for any strategy or host)."""

    async def finished() -> int:
        result = await store.query_rollouts(status_in=list(FINISHED_STATUSES), limit=0)
        return result.total

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        bar = progress.add_task(f"run {RUN_NAME}", total=total)
        while True:
            done = asyncio.run(finished())
            progress.update(bar, completed=min(done, total))
            if stop.wait(0.2):
                progress.update(bar, completed=min(asyncio.run(finished()), total))
                return


async def summarise(store: SqlLightningStore) -> tuple[list[Rollout], dict[str, float | None], int, Any]:
    rollouts = list(await store.query_rollouts())
    rewards: dict[str, float | None] = {}

    async def reward_of(r: Rollout) -> None:
        spans = await store.query_spans(r.rollout_id, attempt_id="latest", name=AGL_ANNOTATION)
        values = [s.attributes.get(reward_value_key(0)) for s in spans]
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        rewards[r.rollout_id] = numbers[-1] if numbers else None

    for start in range(0, len(rollouts), 32):
        await asyncio.gather(*(reward_of(r) for r in rollouts[start : start + 32]))
    stats = await store.statistics()
    run = await store.get_run(RUN_NAME)
    return rollouts, rewards, int(stats.get("total_spans", 0)), run


def show_results(store: SqlLightningStore, wall_time: float | None) -> None:
    rollouts, rewards, spans, run = asyncio.run(summarise(store))
    counts: Counter[tuple[str, str]] = Counter((r.mode or "-", r.status) for r in rollouts)
    by_mode: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        value = rewards.get(r.rollout_id)
        if value is not None:
            by_mode[r.mode or "-"].append(value)

    table = Table(title=f"run '{RUN_NAME}' in {store.url}")
    table.add_column("mode")
    table.add_column("status")
    table.add_column("rollouts", justify="right")
    table.add_column("mean reward", justify="right")
    for (mode, status), n in sorted(counts.items()):
        values = by_mode.get(mode, [])
        mean = f"{sum(values) / len(values):.3f}" if values and status == "succeeded" else ""
        table.add_row(mode, status, str(n), mean)
    console.print(table)
    console.print(f"spans stored: [bold]{spans}[/]   rollouts: [bold]{len(rollouts)}[/]")
    if run is not None and run.finished_at is not None:
        console.print(f"run wall time (created → finished): [bold]{run.finished_at - run.created_at:.1f} s[/]")
    if wall_time is not None:
        console.print(f"this invocation: [bold]{wall_time:.1f} s[/]")


def print_sql_hint(url: str) -> None:
    if not url.startswith("sqlite:///"):
        return
    path = url.removeprefix("sqlite:///")
    console.print(f"\nLook at the results yourself:  [bold]sqlite3 {path}[/]", soft_wrap=True)
    console.print(
        """[dim]-- rollouts by mode and status
SELECT r.mode, r.status, count(*) FROM rollouts r JOIN runs USING (run_id)
 WHERE runs.name = 'quickstart' GROUP BY 1, 2;
-- mean reward by mode (the reward is an 'agentlightning.annotation' span)
SELECT r.mode, round(avg(json_extract(s.attributes, '$."agentlightning.reward.0.value"')), 3) AS mean_reward
  FROM spans s JOIN rollouts r USING (run_id, rollout_id) JOIN runs USING (run_id)
 WHERE runs.name = 'quickstart' AND s.name = 'agentlightning.annotation' GROUP BY 1;
-- the LLM calls the agent got wrong
SELECT json_extract(s.attributes, '$."gen_ai.prompt.0.content"') AS prompt,
       json_extract(s.attributes, '$."gen_ai.completion.0.content"') AS answer, r.input
  FROM spans s JOIN rollouts r USING (run_id, rollout_id) JOIN runs USING (run_id)
 WHERE runs.name = 'quickstart' AND s.name = 'openai.chat.completion'
   AND s.rollout_id IN (SELECT rollout_id FROM spans a WHERE a.run_id = s.run_id AND a.name = 'agentlightning.annotation'
                         AND json_extract(a.attributes, '$."agentlightning.reward.0.value"') = 0)
 LIMIT 5;[/]""",
        soft_wrap=True,  # keep each SQL line whole so it can be pasted
    )


# --- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="sqlite:///quickstart.db", help="database URL (default: %(default)s)")
    parser.add_argument("--runners", type=int, default=4, help="number of runners (default: %(default)s)")
    parser.add_argument("--strategy", default="inprocess", choices=["inprocess", "processes"])
    parser.add_argument("--fresh", action="store_true", help="delete the run and start over")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the algorithm harvests")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()
    store = SqlLightningStore(args.url, run=RUN_NAME)
    existing = asyncio.run(store.get_run(RUN_NAME))
    if args.fresh and existing is not None:
        asyncio.run(store.delete_run(RUN_NAME))
        console.print(f"Deleted run [bold]{RUN_NAME}[/]; starting over.")
        existing = None
    if existing is not None and existing.status == "finished":
        console.print(
            f"Run [bold]{RUN_NAME}[/] is complete (finished {time.ctime(existing.finished_at or 0)}). "
            "Here are its results; [bold]--fresh[/] starts over."
        )
        show_results(store, None)
        print_sql_hint(args.url)
        return
    if existing is not None:
        console.print(f"Resuming run [bold]{RUN_NAME}[/]: finished samples are not redone.")

    train, val = make_dataset(N_TRAIN, SEED), make_dataset(N_VAL, SEED + 1)
    trainer = Trainer(
        store=store,
        run=RUN_NAME,
        n_runners=args.runners,
        strategy=args.strategy,
        algorithm=Baseline(max_queue_length=2 * args.runners, polling_interval=1.0, span_verbosity="none"),
        runner=LitAgentRunner(poll_interval=1.0),
        initial_resources={"prompt": PROMPT},
    )
    stop = threading.Event()
    watcher = threading.Thread(target=watch_progress, args=(store, N_TRAIN + N_VAL, stop), daemon=True)
    watcher.start()
    try:
        trainer.fit(arithmetic_agent, train, val)
    except KeyboardInterrupt:
        stop.set()
        watcher.join()
        console.print(f"\nInterrupted. Run the same command again to resume run [bold]{RUN_NAME}[/].")
        raise SystemExit(130) from None
    finally:
        stop.set()
        watcher.join()
    show_results(store, time.monotonic() - started)
    print_sql_hint(args.url)


if __name__ == "__main__":
    main()
