"""Quickstart: an offline agent that gets better, with lightning_sql — no API key, no network.

The task is small arithmetic ("What is 47 + 38?").  The "LLM" is a deterministic stand-in with three
weaknesses, each cured by one instruction in the prompt-template resource.  `PromptSearch` starts from
a plain prompt, proposes variants (an instruction put in front), publishes each as a new resources
version, runs it on the train split with 4 runners and keeps the best; the first and the best prompt
also run on val.  Every rollout, attempt, span (the LLM call and the reward) and resources version
lands in `quickstart.db`, and the reward by version shows what the search learned.

    python examples/quickstart.py            # run (or resume, or show the finished run)
    python examples/quickstart.py --fresh    # delete the run and start over
    python examples/quickstart.py --url postgresql://user@host/db --runners 8

Interrupt it mid-search (Ctrl-C) and run it again: it resumes where it stopped, redoing nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import re
import zlib
from typing import Any

from opentelemetry import trace
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_sql import (
    LitAgentRunner,
    PromptSearch,
    PromptTemplate,
    SqlLightningStore,
    Trainer,
    emit_reward,
    rollout,
)
from lightning_sql.runtime.summary import reward_bar

RUN_NAME = "quickstart"
N_TRAIN = 32
N_VAL = 32
SEED = 7
PROMPT = PromptTemplate(template="Q: What is {question}?", engine="f-string")
# What PromptSearch may put in front of the prompt: three help the stand-in model, one does nothing.
EDITS = ["Be polite.", "Work step by step.", "Answer with the number only.", "Double-check the sign."]

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
    """A deterministic 'model' with three weaknesses, each cured by one instruction in the prompt.

    Without "step by step" it drops carries when adding and rounds big products down to ten; without
    "number only" it wraps products in a sentence; without "sign" it forgets minus signs.
    """
    match = re.search(r"(\d+) ([+*-]) (\d+)", prompt)
    if match is None:
        return "I don't know"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    text = prompt.lower()
    careful, terse, signed = "step by step" in text, "number only" in text, "sign" in text
    if op == "+":
        return str(a + b if careful else _add_without_carry(a, b))
    if op == "-":
        return str(a - b if signed else abs(a - b))
    product = a * b if careful or a < 10 or b < 10 else a * b - a * b % 10
    return str(product) if terse else f"The product is {product}."


# --- the agent: one LLM call (an OpenTelemetry span) and a reward ------------------------------------------

tracer = trace.get_tracer("quickstart")


@rollout
async def arithmetic_agent(task: dict[str, Any], prompt_template: PromptTemplate) -> None:
    prompt = prompt_template.format(question=task["question"])
    with tracer.start_as_current_span("openai.chat.completion") as span:
        span.set_attribute("gen_ai.request.model", "fake-calculator-1")
        span.set_attribute("gen_ai.prompt.0.role", "user")
        span.set_attribute("gen_ai.prompt.0.content", prompt)
        await asyncio.sleep(0.005 + zlib.crc32(prompt.encode()) % 20 / 1000)  # "network latency"
        answer = fake_llm(prompt)
        span.set_attribute("gen_ai.completion.0.role", "assistant")
        span.set_attribute("gen_ai.completion.0.content", answer)
    emit_reward(1.0 if answer.strip() == str(task["answer"]) else 0.0)


# --- results ------------------------------------------------------------------------------------------


def show_learning(search: PromptSearch) -> None:
    """Reward by resources version, train and val side by side, with the change each version tried."""
    rows: dict[int, dict[str, Any]] = {}
    for stage in search.stages:
        row = rows.setdefault(stage.stage, {"version": stage.version, "edit": stage.edit, "template": stage.template})
        row[stage.mode] = stage.mean_reward
    best = search.best_template or ""
    table = Table(title="what the prompt search learned: mean reward by resources version", title_justify="left")
    for name, justify in [("version", "right"), ("train", "right"), ("val", "right"), ("", "left"), ("prompt", "left")]:
        table.add_column(name, justify=justify, no_wrap=name != "prompt")  # type: ignore[arg-type]
    last = max(rows) if rows else 0
    for number, row in sorted(rows.items()):
        train, val = row.get("train"), row.get("val")
        if row["edit"] is None:
            change = "the initial prompt" if number == 0 else "the best prompt, on val"
        else:
            kept = best.endswith(row["template"]) and number != last
            change = escape(f"+ {row['edit']}") + ("  [green]kept[/]" if kept else "")
        table.add_row(
            str(row["version"]),
            "" if train is None else f"{train:.3f}",
            "" if val is None else f"{val:.3f}",
            reward_bar(train if train is not None else val, 0.0, 1.0, width=16),
            change,
        )
    console.print(table)
    console.print(f"best prompt: [bold]{escape(best)}[/]")


def print_sql_hint(url: str) -> None:
    if not url.startswith("sqlite:///"):
        return
    path = url.removeprefix("sqlite:///")
    console.print(f"\nLook at the results yourself:  [bold]sqlite3 {escape(path)}[/]", soft_wrap=True)
    console.print(
        """[dim]-- mean reward by resources version and mode: did each new prompt help?
SELECT resources_version, mode, count(*) AS rollouts, round(avg(final_reward), 3) AS mean_reward
  FROM rollout_summary_v1 WHERE run_name = 'quickstart' GROUP BY 1, 2 ORDER BY 1, 2;
-- the prompt of each version, next to its reward
SELECT rv.version, round(avg(rs.final_reward), 3) AS mean_reward, json_extract(rv.resources, '$.prompt.template') AS prompt
  FROM resource_versions rv JOIN rollout_summary_v1 rs
    ON rs.run_id = rv.run_id AND rs.resources_id = rv.resources_id AND rs.resources_version = rv.version
 WHERE rs.run_name = 'quickstart' AND rs.mode = 'train' GROUP BY rv.version, prompt ORDER BY rv.version;
-- the answers the first and the last version got wrong
SELECT rs.resources_version, r.input, json_extract(s.attributes, '$."gen_ai.completion.0.content"') AS answer
  FROM rollout_summary_v1 rs JOIN rollouts r USING (run_id, rollout_id) JOIN spans s USING (run_id, rollout_id)
 WHERE rs.run_name = 'quickstart' AND rs.final_reward = 0 AND s.name = 'openai.chat.completion'
   AND rs.resources_version IN ((SELECT min(resources_version) FROM rollout_summary_v1 WHERE run_name = 'quickstart'),
                                (SELECT max(resources_version) FROM rollout_summary_v1 WHERE run_name = 'quickstart'))
 ORDER BY 1 LIMIT 8;[/]""",
        soft_wrap=True,  # keep each SQL line whole so it can be pasted
    )


# --- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="sqlite:///quickstart.db", help="database URL (default: %(default)s)")
    parser.add_argument("--runners", type=int, default=4, help="number of runners (default: %(default)s)")
    parser.add_argument("--strategy", default="inprocess", choices=["inprocess", "processes"])
    parser.add_argument("--fresh", action="store_true", help="delete the run and start over")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the algorithm does")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    store = SqlLightningStore(args.url, run=RUN_NAME)
    if args.fresh and asyncio.run(store.delete_run(RUN_NAME)):
        console.print(f"Deleted run [bold]{RUN_NAME}[/]; starting over.")

    search = PromptSearch(edits=EDITS, max_queue_length=2 * args.runners, polling_interval=1.0, span_verbosity="none")
    trainer = Trainer(
        store=store,
        run=RUN_NAME,
        n_runners=args.runners,
        strategy=args.strategy,
        algorithm=search,
        runner=LitAgentRunner(poll_interval=1.0),
        initial_resources={"prompt": PROMPT},
        summary=False,  # printed below, next to the learning curve
    )
    try:
        summary = trainer.fit(arithmetic_agent, make_dataset(N_TRAIN, SEED), make_dataset(N_VAL, SEED + 1))
    except KeyboardInterrupt:
        console.print(f"\nInterrupted. Run the same command again to resume run [bold]{RUN_NAME}[/] where it stopped.")
        raise SystemExit(130) from None
    console.print(summary.render(include_versions=False))
    show_learning(search)
    print_sql_hint(args.url)


if __name__ == "__main__":
    main()
