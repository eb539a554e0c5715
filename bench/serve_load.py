"""Load generator for the chat endpoint on loopback: streams at several concurrencies against the real Ray
Serve app, and continuous batching vs one request at a time per replica.

  python bench/serve_load.py                                  # tiny random model, short run
  python bench/serve_load.py --checkpoint runs/sft/latest --concurrency 1 4 16 64 --duration-s 30
  python bench/serve_load.py --soak-s 300                     # + 5-minute soak at 16 streams

Per concurrency C: C client streams send requests back to back for --duration-s seconds (POST
/chat/completions, SSE); requests still running at the end are abandoned and not counted. Each request's
max_tokens is drawn uniformly from [M/2, 3M/2] (M = --max-tokens), seeded by stream and request, so both
modes of a comparison send the same requests: equal lengths would keep the streams in lockstep, every
request of a wave ending together and the batch idling through the next wave's time to first token.
Reported:
  tokens/s        completion tokens of the completed requests / --duration-s (usage.completion_tokens)
  TTFT p50/p99    request sent -> first delta event received, seconds
  ITL p50/p99     gap between consecutive delta events of one request, ms; with stream_interval k
                  (serve.app) an event carries up to k tokens
Batching comparison: the same 16-stream load against max_slots=--max-slots (continuous batching) and max_slots=1
(one request at a time per replica), one replica each, at every --ratio-intervals stream interval (both modes
use the same interval, so they pay the same transport per event). Soak: 16 streams for --soak-s seconds;
errors and the engine replica's resident memory (RSS) at the start and end of the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from raychat.config import ServeConfig
from raychat.ports import free_ports


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, seed: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
    }
    t0 = time.perf_counter()
    first, last, gaps, usage = None, None, [], None
    async with client.stream("POST", f"{url}/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            if ev["type"] == "delta":
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
            elif ev["type"] == "done":
                usage = ev["usage"]
            elif ev["type"] == "error":  # (tool_call / tool_result events carry no text: not counted)
                return {"error": ev.get("message", "error event")}
    if usage is None:
        return {"error": "stream ended without a done event"}
    return {"ttft": (first or time.perf_counter()) - t0, "gaps": gaps, "tokens": usage["completion_tokens"]}


async def run_level(url: str, concurrency: int, duration_s: float, max_tokens: int) -> dict:
    """`concurrency` streams send requests back to back for `duration_s` seconds; then every request still
    in flight is abandoned (its connection closed, which cancels it on the server). Only requests that
    completed inside the window count, so tokens/s is the steady-state rate without a drain tail in which
    the last requests would run in a half-empty batch."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def stream(i: int) -> None:
            for k in itertools.count():
                request_max_tokens = random.Random(1000 * i + k).randint(max_tokens // 2, max_tokens * 3 // 2)
                prompt = f"Stream {i}, request {k}: tell me a story."
                try:
                    results.append(await one_request(client, url, prompt, request_max_tokens, 1000 * i + k))
                except (httpx.HTTPError, ValueError) as e:  # ValueError: an event that is not JSON
                    results.append({"error": f"{type(e).__name__}: {e}"})

        tasks = [asyncio.create_task(stream(i)) for i in range(concurrency)]
        await asyncio.sleep(duration_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]] or [float("nan")]
    ttft = [r["ttft"] for r in ok] or [float("nan")]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_messages": sorted({r["error"] for r in results if "error" in r})[:3],
        "tokens": sum(r["tokens"] for r in ok),
        "wall_s": duration_s,
        "tokens_per_s": sum(r["tokens"] for r in ok) / duration_s,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_mean_ms": 1000 * statistics.fmean(gaps),
    }


def tiny_checkpoint(directory: Path, depth: int) -> Path:
    """A random model (raychat's own init, depth -> width via ModelConfig.from_depth) with a BPE trained on
    two stdlib modules; enough to measure the serving path, not the model."""
    import inspect
    import json as json_mod
    import textwrap

    from raychat.checkpoint import save_model
    from raychat.model import GPT, ModelConfig
    from raychat.tokenizer import Tokenizer

    tok = Tokenizer.train([inspect.getsource(json_mod), inspect.getsource(textwrap)], vocab_size=1024)
    model = GPT(ModelConfig.from_depth(depth, vocab_size=tok.vocab_size, max_seq_len=512)).init_weights(
        seed=0
    )
    save_model(directory, model, tok, {"step": 0, "stage": "bench-random"}, commit=True)
    return directory


def deploy(
    checkpoint: str,
    max_slots: int,
    num_cpus: float,
    torch_threads: int | None,
    stream_interval: int,
    engine_process: bool = True,
) -> None:
    import ray
    from ray import serve

    from raychat.serve.app import build_app

    if num_cpus + ServeConfig().ingress_num_cpus > ray.cluster_resources().get("CPU", 0):
        raise SystemExit(
            f"--num-cpus {num_cpus} + the ingress' {ServeConfig().ingress_num_cpus} exceed the cluster's CPUs"
        )
    # Serve's HTTP proxy listens on 127.0.0.1 only (main): no API key, so build_app's opt-out
    app = build_app({"checkpoint": checkpoint, "max_slots": max_slots, "num_cpus": num_cpus, "torch_threads": torch_threads,
                     "stream_interval": stream_interval, "engine_process": engine_process, "min_replicas": 1, "max_replicas": 1, "max_ongoing_requests": 128,
                     "allow_unauthenticated": True})  # fmt: skip
    serve.run(app, name="raychat", route_prefix="/")


def replica_rss_bytes() -> int:
    """Resident memory of the (single) ChatServer replica and its engine process, as its stats() reports it."""
    from ray import serve

    return serve.get_deployment_handle("ChatServer", app_name="raychat").stats.remote().result()["rss_bytes"]


def table(rows: list[dict]) -> str:
    head = "| streams | requests | errors | tokens/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) |"
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.0f} | {r['ttft_p50']:.3f} | "
            f"{r['ttft_p99']:.3f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="raychat checkpoint (default: a random model of --depth)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of load per measurement")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the engine replica reserves")
    p.add_argument("--torch-threads", type=int, help="torch threads of the replica (default: its --num-cpus)")
    p.add_argument("--max-slots", type=int, default=64, help="KV rows of the continuous-batching replica")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=ServeConfig().replica.stream_interval,
        help="tokens per streamed event of the concurrency levels and the soak (default: the app's)",
    )
    p.add_argument(
        "--ratio-intervals",
        type=int,
        nargs="+",
        default=[1, ServeConfig().replica.stream_interval, 8],
        help="stream intervals of the batching comparison",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="model + scheduler in a child process of the replica (serve.app's engine_process)",
    )
    p.add_argument("--soak-s", type=float, default=0.0, help="seconds of 16-stream soak (0 = skip)")
    p.add_argument("--out", help="write the markdown report here")
    a = p.parse_args()

    import ray
    from ray import serve

    ckpt = a.checkpoint or str(tiny_checkpoint(Path(tempfile.mkdtemp(prefix="raychat-bench-")), a.depth))
    ray.init(include_dashboard=False, log_to_driver=False)
    (port,) = free_ports(1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    report = [f"command: `python {' '.join(sys.argv)}`", f"machine: {os.cpu_count()} CPUs, torch CPU; checkpoint: {a.checkpoint or f'random depth {a.depth}'}",
              f"max_tokens uniform in [{a.max_tokens // 2}, {a.max_tokens * 3 // 2}], temperature 1.0, {a.duration_s:.0f} s per measurement, engine replica: "
              f"{a.num_cpus} CPU, torch threads {a.torch_threads or 'default'}, engine_process {a.engine_process}", ""]  # fmt: skip

    deploy(ckpt, a.max_slots, a.num_cpus, a.torch_threads, a.stream_interval, a.engine_process)
    asyncio.run(run_level(url, 2, 2.0, 8))  # warm-up
    rows = [asyncio.run(run_level(url, c, a.duration_s, a.max_tokens)) for c in a.concurrency]
    report += [
        f"## Concurrency (one replica, max_slots={a.max_slots}, stream_interval={a.stream_interval})",
        "",
        table(rows),
        "",
    ]
    print(table(rows), flush=True)

    report += ["## 16 streams: continuous batching vs one request at a time per replica", "",
               "| stream_interval | batched tokens/s | one-at-a-time tokens/s | ratio | batched TTFT p50 (s) | batched ITL p50 (ms) |",
               "|---|---|---|---|---|---|"]  # fmt: skip
    for interval in a.ratio_intervals:
        pair = []
        for max_slots in (a.max_slots, 1):
            deploy(ckpt, max_slots, a.num_cpus, a.torch_threads, interval, a.engine_process)
            asyncio.run(run_level(url, 2, 2.0, 8))  # warm-up
            pair.append(asyncio.run(run_level(url, 16, a.duration_s, a.max_tokens)))
        batched, single = pair
        ratio = batched["tokens_per_s"] / single["tokens_per_s"]
        report.append(f"| {interval} | {batched['tokens_per_s']:.0f} | {single['tokens_per_s']:.0f} | {ratio:.1f}x | "
                      f"{batched['ttft_p50']:.3f} | {batched['itl_p50_ms']:.1f} |")  # fmt: skip
        print(
            f"stream_interval {interval}: batching vs one-at-a-time at 16 streams: {ratio:.1f}x", flush=True
        )
    report.append("")

    if a.soak_s > 0:
        deploy(ckpt, a.max_slots, a.num_cpus, a.torch_threads, a.stream_interval, a.engine_process)
        asyncio.run(run_level(url, 16, 5.0, a.max_tokens))  # warm-up before the first RSS sample
        rss0 = replica_rss_bytes()
        soak = asyncio.run(run_level(url, 16, a.soak_s, a.max_tokens))
        rss1 = replica_rss_bytes()
        growth = (rss1 - rss0) / rss0
        report += [f"## Soak: 16 streams for {a.soak_s:.0f} s (stream_interval={a.stream_interval})", "", table([soak]), "",
                   f"errors: {soak['errors']} of {soak['requests']}; replica + engine process RSS {rss0 / 2**20:.0f} MiB -> {rss1 / 2**20:.0f} MiB ({100 * growth:+.1f}%)", ""]  # fmt: skip
        print(report[-2], flush=True)

    serve.shutdown()
    ray.shutdown()
    text = "\n".join(report)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
