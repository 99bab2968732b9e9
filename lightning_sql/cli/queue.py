"""``lightning-sql cancel``: queue control from the command line (docs/queue.md)."""

from __future__ import annotations

import asyncio

import click
from rich.console import Console

from lightning_sql.cli.options import common_options, fail, handled, need_run, run_option, writable_store
from lightning_sql.cli.output import emit, printable


@click.command("cancel")
@click.argument("rollout_ids", nargs=-1)
@run_option()
@click.option("--all", "cancel_all", is_flag=True, help="Cancel every unfinished rollout of the run.")
@common_options
@handled
def cancel_command(
    rollout_ids: tuple[str, ...],
    run: str | None,
    cancel_all: bool,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Cancel rollouts (or, with --all, the whole run): queued ones at once, running ones at their
    runner's next heartbeat."""
    name = need_run(run)
    if bool(rollout_ids) == cancel_all:
        fail(as_json, "give ROLLOUT_ID... or --all (not both)")

    async def go() -> dict[str, str] | int:
        store = writable_store(url, schema, connect_timeout, name)
        try:
            if cancel_all:
                return int(await store.cancel_run())
            return {rid: (await store.cancel_rollout(rid)).status for rid in rollout_ids}
        finally:
            await store.close()

    done = asyncio.run(go())
    if isinstance(done, int):
        emit(as_json, {"run": name, "cancelled": done}, lambda c: c.print(f"Cancelled {done} rollout(s) of {printable(name)}."))
    else:
        statuses = done

        def show(c: Console) -> None:
            for rid, status in statuses.items():
                c.print(f"{printable(rid)}: {status}")

        emit(as_json, {"run": name, "rollouts": statuses}, show)


def _set_pause(paused: bool) -> click.Command:
    verb = "pause" if paused else "resume"

    @click.command(verb)
    @run_option()
    @click.option("--drain", "drain_timeout", type=float, default=None,
                  help="(pause) Then wait up to this many seconds until no attempt is in flight.")
    @common_options
    @handled
    def command(
        run: str | None, drain_timeout: float | None, url: str | None, schema: str | None, connect_timeout: float,
        as_json: bool,
    ) -> None:
        name = need_run(run)

        async def go() -> tuple[bool, bool | None]:
            store = writable_store(url, schema, connect_timeout, name)
            try:
                state = await (store.pause_run() if paused else store.resume_run())
                drained = None
                if paused and drain_timeout is not None:
                    drained = bool(await store.wait_for_drain(timeout=drain_timeout))
                return state.paused, drained
            finally:
                await store.close()

        state, drained = asyncio.run(go())
        data = {"run": name, "paused": state, **({} if drained is None else {"drained": drained})}
        said = f"Run {printable(name)} is {'paused' if state else 'running'}" + (
            "" if drained is None else ("; nothing in flight" if drained else "; attempts still in flight at the timeout")
        )
        emit(as_json, data, lambda c: c.print(said + "."))
        if drained is False:
            raise SystemExit(1)

    command.help = (
        "Pause the run: claims take nothing, on every host; attempts in flight go on (--drain waits for them)."
        if paused
        else "Resume the run: claims take work again and waiting runners wake."
    )
    return command


pause_command = _set_pause(True)
resume_command = _set_pause(False)
