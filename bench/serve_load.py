"""Load generator for the chat endpoint on loopback: streams at several concurrencies against the real Ray
Serve app, and continuous batching vs one request at a time per replica.

  python bench/serve_load.py                                  # tiny random model, short run
  python bench/serve_load.py --checkpoint runs/sft/latest --concurrency 1 4 16 64 --requests-per-stream 4
  python bench/serve_load.py --soak-s 300                     # + 5-minute soak at 16 streams

Per concurrency C: C client streams each send `--requests-per-stream` requests back to back
(POST /chat/completions, SSE). Reported:
  tokens/s        completion tokens of all requests / wall time of the level (usage.completion_tokens)
  TTFT p50/p99    request sent -> first delta event received, seconds
  ITL p50/p99     gap between consecutive delta events of one request (one event ~ one token), ms
Batching comparison: the same 16-stream load against max_rows=16 (continuous batching) and max_rows=1 (one
request at a time per replica), one replica each. Soak: 16 streams for --soak-s seconds; errors and the
engine replica's resident memory (RSS) at the start and end of the soak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx


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
            else:
                return {"error": ev.get("message", "error event")}
    if usage is None:
        return {"error": "stream ended without a done event"}
    return {"ttft": (first or time.perf_counter()) - t0, "gaps": gaps, "tokens": usage["completion_tokens"]}


async def run_level(
    url: str, concurrency: int, requests_per_stream: int, max_tokens: int, deadline: float | None = None
) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def stream(i: int) -> list[dict]:
            out, k = [], 0
            while (deadline is None and k < requests_per_stream) or (
                deadline is not None and time.time() < deadline
            ):
                try:
                    out.append(
                        await one_request(
                            client,
                            url,
                            f"Stream {i}, request {k}: tell me a story.",
                            max_tokens,
                            1000 * i + k,
                        )
                    )
                except httpx.HTTPError as e:
                    out.append({"error": f"{type(e).__name__}: {e}"})
                k += 1
            return out

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(stream(i) for i in range(concurrency))) for r in rs]
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]] or [float("nan")]
    ttft = [r["ttft"] for r in ok] or [float("nan")]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "tokens": sum(r["tokens"] for r in ok),
        "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_mean_ms": 1000 * statistics.fmean(gaps),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    save_model(directory, model, tok, {"step": 0, "kind": "bench-random"})
    return directory


def deploy(checkpoint: str, max_rows: int, num_cpus: float, torch_threads: int) -> None:
    import ray
    from ray import serve

    from raychat.serve.app import DEFAULTS, build_app

    if num_cpus + DEFAULTS["ingress_num_cpus"] > ray.cluster_resources().get("CPU", 0):
        raise SystemExit(
            f"--num-cpus {num_cpus} + the ingress' {DEFAULTS['ingress_num_cpus']} exceed the cluster's CPUs"
        )
    app = build_app({"checkpoint": checkpoint, "max_rows": max_rows, "num_cpus": num_cpus, "torch_threads": torch_threads,
                     "min_replicas": 1, "max_replicas": 1, "max_ongoing_requests": 128})  # fmt: skip
    serve.run(app, name="raychat", route_prefix="/")


def replica_rss_bytes() -> int:
    """Resident memory of the (single) ChatEngine replica process, as its stats() reports it."""
    from ray import serve

    return serve.get_deployment_handle("ChatEngine", app_name="raychat").stats.remote().result()["rss_bytes"]


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
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the engine replica reserves")
    p.add_argument("--torch-threads", type=int, default=os.cpu_count(), help="torch threads of the replica")
    p.add_argument("--max-rows", type=int, default=64, help="KV rows of the continuous-batching replica")
    p.add_argument("--soak-s", type=float, default=0.0, help="seconds of 16-stream soak (0 = skip)")
    p.add_argument("--out", help="write the markdown report here")
    a = p.parse_args()

    import ray
    from ray import serve

    ckpt = a.checkpoint or str(tiny_checkpoint(Path(tempfile.mkdtemp(prefix="raychat-bench-")), a.depth))
    ray.init(include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    report = [f"command: `python {' '.join(sys.argv)}`", f"machine: {os.cpu_count()} CPUs, torch CPU; checkpoint: {a.checkpoint or f'random depth {a.depth}'}",
              f"max_tokens {a.max_tokens}, temperature 1.0, {a.requests_per_stream} requests per stream", ""]  # fmt: skip

    deploy(ckpt, a.max_rows, a.num_cpus, a.torch_threads)
    asyncio.run(run_level(url, 2, 1, 8))  # warm-up
    rows = [asyncio.run(run_level(url, c, a.requests_per_stream, a.max_tokens)) for c in a.concurrency]
    report += [f"## Concurrency (one replica, max_rows={a.max_rows})", "", table(rows), ""]
    print(table(rows), flush=True)

    batched = next((r for r in rows if r["concurrency"] == 16), None) or asyncio.run(
        run_level(url, 16, a.requests_per_stream, a.max_tokens)
    )
    deploy(ckpt, 1, a.num_cpus, a.torch_threads)
    asyncio.run(run_level(url, 1, 1, 8))
    single = asyncio.run(run_level(url, 16, a.requests_per_stream, a.max_tokens))
    ratio = batched["tokens_per_s"] / single["tokens_per_s"]
    report += ["## 16 streams: continuous batching vs one request at a time per replica", "",
               table([{**batched, "concurrency": "16 (max_rows=16+)"}, {**single, "concurrency": "16 (max_rows=1)"}]), "",
               f"throughput ratio: {ratio:.1f}x", ""]  # fmt: skip
    print(f"batching vs one-at-a-time at 16 streams: {ratio:.1f}x", flush=True)

    if a.soak_s > 0:
        deploy(ckpt, a.max_rows, a.num_cpus, a.torch_threads)
        asyncio.run(run_level(url, 16, 1, a.max_tokens))  # warm-up before the first RSS sample
        rss0 = replica_rss_bytes()
        soak = asyncio.run(run_level(url, 16, 0, a.max_tokens, deadline=time.time() + a.soak_s))
        rss1 = replica_rss_bytes()
        growth = (rss1 - rss0) / rss0
        report += [f"## Soak: 16 streams for {a.soak_s:.0f} s", "", table([soak]), "",
                   f"errors: {soak['errors']} of {soak['requests']}; replica RSS {rss0 / 2**20:.0f} MiB -> {rss1 / 2**20:.0f} MiB ({100 * growth:+.1f}%)", ""]  # fmt: skip
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
