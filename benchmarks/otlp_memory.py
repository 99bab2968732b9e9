"""Peak memory of ``lightning-sql serve`` storing one OTLP request, against the size of its body.

Spawns the server on a fresh SQLite file (or ``--url``), starts one rollout attempt, then for each
``--spans`` count sends one protobuf ``ExportTraceServiceRequest`` of that many spans (attributes padded
so that the body is ``--mib`` MiB) and samples the server's RSS while it answers.  Prints the body size,
the RSS before, the peak added and the ratio.  Nothing is asserted.

    python -m benchmarks.otlp_memory --mib 16 --spans 10000 2000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import httpx
import psutil

from benchmarks.server_startup import running_server


def _body(spans: int, mib: float, rollout_id: str, attempt_id: str) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    pad = max(int(mib * 2**20 / spans) - 120, 1)
    message = ExportTraceServiceRequest()
    resource = ResourceSpans(scope_spans=[ScopeSpans(spans=[
        Span(
            trace_id=os.urandom(16), span_id=(i + 1).to_bytes(8, "big"), name=f"span-{i}",
            start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_001_000_000_000,
            attributes=[KeyValue(key="padding", value=AnyValue(string_value="x" * pad))],
        )
        for i in range(spans)
    ])])  # fmt: skip
    for key, value in (("agentlightning.rollout_id", rollout_id), ("agentlightning.attempt_id", attempt_id)):
        resource.resource.attributes.append(KeyValue(key=key, value=AnyValue(string_value=value)))
    message.resource_spans.append(resource)
    return message.SerializeToString()


def _sample(process: psutil.Process, peak: list[int], done: threading.Event) -> None:
    while not done.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.005)


def measure(url: str, mib: float, span_counts: list[int]) -> list[tuple[int, int, int, int, int]]:
    """(spans, body bytes, RSS before, peak RSS added, status) per request."""
    rows = []
    with running_server(["--url", url, "--run", "otlp-memory"]) as (base, _startup):
        server = next(p for p in psutil.Process().children() if "lightning_sql.server" in " ".join(p.cmdline()))
        with httpx.Client(base_url=base, timeout=600) as http:
            for spans in span_counts:
                started = http.post("/v1/agl/rollouts", json={"input": spans}).json()
                body = _body(spans, mib, started["rollout_id"], started["attempt"]["attempt_id"])
                before = server.memory_info().rss
                peak, done = [before], threading.Event()
                sampler = threading.Thread(target=_sample, args=(server, peak, done))
                sampler.start()
                answer = http.post("/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"})
                done.set()
                sampler.join()
                peak_rss = peak[0]
                rows.append((spans, len(body), before, peak_rss - before, answer.status_code))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url")
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--spans", type=int, nargs="+", default=[10_000, 2_000])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        url = args.url or f"sqlite:///{folder}/otlp.db"
        for spans, size, before, added, status in measure(url, args.mib, args.spans):
            print(
                f"{spans:>6} spans  body {size / 2**20:6.1f} MiB  RSS before {before / 2**20:6.0f} MiB  "
                f"peak added {added / 2**20:6.0f} MiB  ({added / size:4.1f}x the body)  HTTP {status}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
