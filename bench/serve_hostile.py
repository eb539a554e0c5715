"""Hostile soak: 64 concurrent streams for 5 minutes where 10% of the requests are hostile, beside a clean
soak of the same streams in the same run, against the real Ray Serve app (or any running server, --url).

  python bench/serve_hostile.py --out bench/results/serve_hostile_soak.md              # ~11 minutes
  python bench/serve_hostile.py --url http://127.0.0.1:8000 --duration-s 120 --clean-s 0   # a running server

Well-formed requests: POST /chat/completions (SSE), temperature 1.0, a seed, max_tokens uniform in
[M/2, 3M/2] (M = --max-tokens), as bench/serve_load.py sends them. A hostile request replaces a well-formed one
with probability --hostile (seeded per stream and request), cycling through:
  tiny_temperature   temperature 5e-324 or 1e-300 (accepted: 0..2); must not disturb any other request
  huge_max_tokens    max_tokens 4096, more than the model's context leaves after the prompt -> 400
                     context_length_exceeded, before the engine sees it (until this was refused, it ran until
                     the row's context was full: 200 in the results before)
  invalid_utf8       a JSON body with bytes that are not UTF-8 -> 400
  disconnect         a well-formed stream dropped after its first event -> the server cancels it
  oversized          a 600 KiB body -> 413 before parsing
Reported per phase: well-formed requests, their errors (the target is 0), tokens/s of their completions,
TTFT p50/p99 (request sent -> first delta); the outcome of each hostile kind against what it should get;
whether the engine process restarted (the replica's child pids from /health); the replica's resident memory
(replica + engine process, /health) at minute 1 and at the end of the hostile phase (target: within +5%).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serve_load import deploy, percentile, tiny_checkpoint

from raychat.ports import free_ports

KINDS = ("tiny_temperature", "huge_max_tokens", "invalid_utf8", "disconnect", "oversized")
EXPECTED = {"tiny_temperature": "200", "huge_max_tokens": "400", "invalid_utf8": "400", "disconnect": "dropped",
            "oversized": "413"}  # fmt: skip


def body(prompt: str, max_tokens: int, seed: int, temperature: float = 1.0) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}


async def stream(client: httpx.AsyncClient, url: str, payload: dict, drop_after_first: bool = False) -> dict:
    """One SSE request; {"ttft", "tokens"} on success, {"error"} otherwise, {"dropped"} when we hung up."""
    t0 = time.perf_counter()
    first, usage = None, None
    async with client.stream("POST", f"{url}/chat/completions", json=payload) as resp:
        if resp.status_code != 200:
            return {
                "error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}",
                "status": resp.status_code,
            }
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "delta" and first is None:
                first = time.perf_counter()
                if drop_after_first:
                    return {"dropped": True, "status": 200}
            elif ev["type"] == "done":
                usage = ev["usage"]
            elif ev["type"] == "error":
                return {"error": ev["message"], "status": 200}
    if usage is None:
        return {"error": "stream ended without a done event", "status": 200}
    return {"ttft": (first or time.perf_counter()) - t0, "tokens": usage["completion_tokens"], "status": 200}


async def raw_post(client: httpx.AsyncClient, url: str, content: bytes) -> dict:
    try:
        resp = await client.post(
            f"{url}/chat/completions", content=content, headers={"content-type": "application/json"}
        )
    except httpx.HTTPError as e:  # the server may close the connection on an oversized body
        return {"status": f"closed ({type(e).__name__})"}
    return {"status": resp.status_code, "error_shape": "error" in resp.json()}


async def hostile(client: httpx.AsyncClient, url: str, kind: str, prompt: str, seed: int) -> dict:
    if kind == "tiny_temperature":
        return await stream(
            client, url, body(prompt, 32, seed, temperature=random.Random(seed).choice([5e-324, 1e-300]))
        )
    if kind == "huge_max_tokens":
        return await stream(client, url, body(prompt, 4096, seed))
    if kind == "invalid_utf8":
        return await raw_post(
            client, url, b'{"messages": [{"role": "user", "content": "\xff\xfe bad \xc3"}]}'
        )
    if kind == "disconnect":
        return await stream(client, url, body(prompt, 256, seed), drop_after_first=True)
    return await raw_post(
        client, url, b'{"messages": [{"role": "user", "content": "' + b"x" * 600 * 1024 + b'"}]}'
    )


def outcome(kind: str, result: dict) -> str:
    if result.get("dropped"):
        return "dropped"
    status = str(result.get("status"))
    return (
        status
        if "error" not in result or kind in ("huge_max_tokens", "invalid_utf8", "oversized")
        else f"error: {result['error'][:80]}"
    )


async def soak(
    url: str,
    streams: int,
    duration_s: float,
    max_tokens: int,
    hostile_share: float,
    on_minute=None,
    kinds: tuple[str, ...] = KINDS,
) -> dict:
    """`streams` streams send requests back to back for `duration_s`; requests still in flight at the end are
    abandoned and not counted. on_minute(elapsed_s) is awaited once a minute; hostile requests cycle `kinds`."""
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    good: list[dict] = []
    bad: Counter = Counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def run(i: int) -> None:
            for k in itertools.count():
                rng = random.Random(1_000_003 * i + k)
                seed, prompt = 1000 * i + k, f"Stream {i}, request {k}: tell me a story."
                try:
                    if rng.random() < hostile_share:
                        kind = kinds[(i + k) % len(kinds)]
                        bad[(kind, outcome(kind, await hostile(client, url, kind, prompt, seed)))] += 1
                    else:
                        good.append(
                            await stream(
                                client,
                                url,
                                body(prompt, rng.randint(max_tokens // 2, max_tokens * 3 // 2), seed),
                            )
                        )
                except (httpx.HTTPError, ValueError) as e:
                    good.append({"error": f"{type(e).__name__}: {e}"})

        tasks = [asyncio.create_task(run(i)) for i in range(streams)]
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < duration_s:
            await asyncio.sleep(min(60.0, duration_s - elapsed))
            if on_minute is not None and time.monotonic() - start < duration_s - 1:
                await on_minute(time.monotonic() - start)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in good if "error" not in r]
    ttft = [r["ttft"] for r in ok] or [float("nan")]
    return {"requests": len(good), "errors": len(good) - len(ok), "error_messages": sorted({r["error"] for r in good if "error" in r})[:3],
            "tokens_per_s": sum(r["tokens"] for r in ok) / duration_s, "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "hostile": bad}  # fmt: skip


def engine_stats(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=60).json()["engine"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running raychat server (default: deploy one on a local Ray cluster)")
    p.add_argument("--checkpoint", help="raychat checkpoint (default: a random model of --depth)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=300.0, help="seconds of the hostile soak")
    p.add_argument(
        "--clean-s", type=float, default=300.0, help="seconds of the clean soak before it (0 = skip)"
    )
    p.add_argument("--hostile", type=float, default=0.10, help="share of hostile requests")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="hostile kinds to send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--num-cpus", type=float, default=1.0)
    p.add_argument("--out", help="write the markdown report here")
    a = p.parse_args()

    url = a.url
    if url is None:
        import ray
        from ray import serve

        ckpt = a.checkpoint or str(tiny_checkpoint(Path(tempfile.mkdtemp(prefix="raychat-bench-")), a.depth))
        ray.init(include_dashboard=False, log_to_driver=False)
        (port,) = free_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        deploy(ckpt, a.max_slots, a.num_cpus, None, 4, True)
    load = os.getloadavg()
    asyncio.run(soak(url, 4, 3.0, 8, 0.0))  # warm-up
    before = engine_stats(url)
    rows, rss = [], {}
    if a.clean_s > 0:
        rows.append(("clean", asyncio.run(soak(url, a.streams, a.clean_s, a.max_tokens, 0.0))))
        print("clean:", rows[-1][1], flush=True)

    async def sample(elapsed: float) -> None:
        rss.setdefault("minute_1", engine_stats(url)["rss_bytes"])

    rows.append(
        (
            f"{a.hostile:.0%} hostile",
            asyncio.run(soak(url, a.streams, a.duration_s, a.max_tokens, a.hostile, sample, tuple(a.kinds))),
        )
    )
    print("hostile:", rows[-1][1], flush=True)
    drain_start = time.monotonic()  # abandoned requests end (their rows and in-flight counts free up)
    while (after := engine_stats(url))["in_flight"] and time.monotonic() - drain_start < 120:
        time.sleep(1)
    drained_s = time.monotonic() - drain_start
    rss.setdefault("minute_1", before["rss_bytes"])
    growth = (after["rss_bytes"] - rss["minute_1"]) / rss["minute_1"]
    restarted = before["child_pids"] != after["child_pids"]

    report = [f"command: `python {' '.join(sys.argv)}`",
              f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} at start; checkpoint: {a.checkpoint or f'random depth {a.depth}'}"
              f"{'' if a.url else f', one replica, max_slots={a.max_slots}, {a.num_cpus} CPU'}",
              f"{a.streams} streams; well-formed: /chat/completions SSE, max_tokens uniform in [{a.max_tokens // 2}, {a.max_tokens * 3 // 2}], temperature 1.0",
              "", "| phase | seconds | well-formed requests | errors | tokens/s | TTFT p50 (s) | TTFT p99 (s) | hostile requests |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in rows:
        seconds = a.clean_s if name == "clean" else a.duration_s
        report.append(f"| {name} | {seconds:.0f} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.0f} | {r['ttft_p50']:.3f} | "
                      f"{r['ttft_p99']:.3f} | {sum(r['hostile'].values())} |")  # fmt: skip
    hostile_row = rows[-1][1]
    report += ["", "| hostile kind | expected | outcomes |", "|---|---|---|"]
    for kind in a.kinds:
        got = {o: n for (k, o), n in hostile_row["hostile"].items() if k == kind}
        report.append(
            f"| {kind} | {EXPECTED[kind]} | {', '.join(f'{o}: {n}' for o, n in sorted(got.items())) or '-'} |"
        )
    report += ["", f"well-formed errors: {sum(r['errors'] for _, r in rows)} {rows[-1][1]['error_messages']}",
               f"engine process restarted: {'YES' if restarted else 'no'} (child pids {before['child_pids']} -> {after['child_pids']})",
               f"replica + engine process RSS: minute 1 {rss['minute_1'] / 2**20:.0f} MiB -> end {after['rss_bytes'] / 2**20:.0f} MiB ({100 * growth:+.1f}%)",
               f"{drained_s:.0f} s after the soak: in_flight {after['in_flight']}, running {after['running']}, free rows {after['free_rows']}/{after['max_slots']}",
               f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", ""]  # fmt: skip
    text = "\n".join(report)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)
    if a.url is None:
        from ray import serve

        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
