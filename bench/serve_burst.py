"""One replica under a burst of 10x its capacity: is overload refused fast, and do admitted requests keep their
latency? (issue 23, "Backpressure and deadlines"; a benchmark, not a test.)

  python bench/serve_burst.py                       # tiny random model, ~45 s
  python bench/serve_burst.py --out bench/results/serve_burst.md

The replica is the chat app without Ray: raychat.serve.ingress over one ChatServer whose model and scheduler run
in an engine child process (engine_process, as serve.app deploys it), served by uvicorn in a process of its own
(`--serve PORT`); this process is only the load generator. Capacity = --max-slots (requests decoded at once);
the engine queues up to --max-pending more and answers the rest 429 with Retry-After.

Phases (POST /chat/completions, SSE, temperature 1, max_tokens uniform in [M/2, 3M/2]):
  before   --max-slots steady streams, back to back, for --phase-s seconds
  during   the same steady streams plus 10 x --max-slots burst streams for --phase-s seconds; a burst stream
           that gets 429/503 waits its Retry-After, as the openai client does, then sends again
Reported: the fraction of the burst phase's refused answers (429/503) that came within 1 s of the request,
and the fraction of all its requests refused; TTFT p50/p99 (request sent -> first delta) of the requests that
completed, before and during; the server's resident memory (uvicorn process + engine child) before the
load and after it drained.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
from _common import machine, uptime
from serve_load import percentile, tiny_checkpoint

from raychat.ports import free_ports

REFUSED = (429, 503)


def serve(checkpoint: str, port: int, max_slots: int, max_pending: int) -> None:
    """The replica: uvicorn on 127.0.0.1:port over ChatServer (engine process); runs until killed."""
    import uvicorn

    from raychat.serve.ingress import LocalClient, create_app
    from raychat.serve.server import ChatServer

    engine = ChatServer.from_checkpoint(checkpoint, engine_process=True, max_slots=max_slots, max_pending=max_pending,
                                        stream_interval=4, retry_after_s=1)  # fmt: skip
    uvicorn.run(create_app(LocalClient(engine)), host="127.0.0.1", port=port, log_level="warning")


async def one_request(client: aiohttp.ClientSession, url: str, max_tokens: int, seed: int) -> dict:
    """{"status", "answer_s" (request -> status line), "ttft_s" (-> first delta; completed only), "retry_after"}.
    aiohttp, not httpx: with ~90 streams in one process httpx's own CPU time showed up as seconds of latency
    (a raw-socket client saw the same server refuse in ~30 ms)."""
    body = {"messages": [{"role": "user", "content": f"Tell me a story, {seed}."}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed}  # fmt: skip
    t0 = time.perf_counter()
    async with client.post(f"{url}/chat/completions", json=body) as resp:
        out = {"status": resp.status, "answer_s": time.perf_counter() - t0}
        if resp.status != 200:
            await resp.read()
            return out | {"retry_after": float(resp.headers.get("Retry-After", "1"))}
        ttft, done = None, False
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "delta" and ttft is None:
                ttft = time.perf_counter() - t0
            done = done or ev["type"] == "done"
    return out | {"ttft_s": ttft, "completed": done}


async def stream(client, url: str, results: list, stop_at: float, max_tokens: int, seed: int) -> None:
    """Requests back to back until stop_at (monotonic); after a refusal, wait its Retry-After."""
    for k in itertools.count():
        if time.monotonic() >= stop_at:
            return
        tokens = random.Random(seed * 1000 + k).randint(max_tokens // 2, max_tokens * 3 // 2)
        try:
            r = await one_request(client, url, tokens, seed * 1000 + k)
        except aiohttp.ClientError as e:
            r = {"status": None, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        if r.get("status") in REFUSED:
            await asyncio.sleep(r["retry_after"])


async def phase(url: str, steady: int, burst: int, seconds: float, max_tokens: int, seed: int) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=steady + burst + 8)
    results: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        stop_at = time.monotonic() + seconds
        tasks = [stream(client, url, results, stop_at, max_tokens, seed + i) for i in range(steady + burst)]
        await asyncio.gather(*tasks)
    return results


def summary(results: list[dict]) -> dict:
    ok = [r for r in results if r.get("status") == 200 and r.get("completed")]
    refused = [r for r in results if r.get("status") in REFUSED]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None] or [float("nan")]
    answer = [r["answer_s"] for r in refused] or [float("nan")]
    return {
        "requests": len(results),
        "completed": len(ok),
        "refused": len(refused),
        "refused_within_1s": sum(r["answer_s"] <= 1.0 for r in refused),
        "other": len(results) - len(ok) - len(refused),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "refusal_p99": percentile(answer, 99),
    }


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` and its children (the engine process)."""
    proc = psutil.Process(pid)
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not answer /health within {timeout_s} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="raychat checkpoint (default: a random model of --depth)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--max-slots", type=int, default=8, help="the replica's KV slots (its capacity)")
    p.add_argument("--max-pending", type=int, default=8, help="requests the engine queues beyond its slots")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--phase-s", type=float, default=15.0, help="seconds of each phase (before, during)")
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    a = p.parse_args()
    if a.serve:
        serve(a.checkpoint, a.serve, a.max_slots, a.max_pending)
        return 0

    ckpt = a.checkpoint or str(tiny_checkpoint(Path(tempfile.mkdtemp(prefix="raychat-burst-")), a.depth))
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, __file__, "--serve", str(port), "--checkpoint", ckpt,
            "--max-slots", str(a.max_slots), "--max-pending", str(a.max_pending)]  # fmt: skip
    server = subprocess.Popen(argv)
    try:
        wait_healthy(url, server)
        asyncio.run(phase(url, 2, 0, 2.0, 8, seed=900_000))  # warm-up
        rss0 = rss_bytes(server.pid)
        before = summary(asyncio.run(phase(url, a.max_slots, 0, a.phase_s, a.max_tokens, seed=0)))
        burst = 10 * a.max_slots
        during = summary(asyncio.run(phase(url, a.max_slots, burst, a.phase_s, a.max_tokens, seed=10_000)))
        time.sleep(1.0)  # drained: every stream has ended
        rss1 = rss_bytes(server.pid)
    finally:
        server.kill()
        server.wait(10)

    rows = ["| phase | requests | completed | refused 429/503 | refused within 1 s | other | TTFT p50 (s) | "
            "TTFT p99 (s) | refusal p99 (s) |", "|" + "---|" * 9]  # fmt: skip
    for name, s in (("before", before), (f"during (+{burst} burst streams)", during)):
        rows.append(f"| {name} | {s['requests']} | {s['completed']} | {s['refused']} | {s['refused_within_1s']} | "
                    f"{s['other']} | {s['ttft_p50']:.3f} | {s['ttft_p99']:.3f} | {s['refusal_p99']:.3f} |")  # fmt: skip
    refused = during["refused"]
    report = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {machine()}",
        f"load before the run: {uptime()}",
        f"command: `python bench/serve_burst.py {' '.join(sys.argv[1:])}`",
        f"replica: uvicorn + ChatServer, engine process (1 torch thread), checkpoint "
        f"{a.checkpoint or f'random depth {a.depth}'}, max_slots={a.max_slots} (capacity), "
        f"max_pending={a.max_pending}, stream_interval 4; max_tokens uniform in [{a.max_tokens // 2}, "
        f"{a.max_tokens * 3 // 2}]; {a.phase_s:.0f} s per phase; {a.max_slots} steady streams, "
        f"+{burst} burst streams (10x capacity) during",
        "",
        *rows,
        "",
        f"- refused answers within 1 s: {during['refused_within_1s']} of {refused} "
        f"({100 * during['refused_within_1s'] / max(1, refused):.1f}%); "
        f"{100 * refused / max(1, during['requests']):.1f}% of the burst phase's requests were refused",
        f"- completed requests' TTFT p99: {before['ttft_p99']:.3f} s before, {during['ttft_p99']:.3f} s during",
        f"- server RSS (uvicorn process + engine child): {rss0 / 2**20:.0f} MiB before the load, "
        f"{rss1 / 2**20:.0f} MiB after it ({100 * (rss1 - rss0) / rss0:+.1f}%)",
    ]
    text = "\n".join(report)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(
            "# One replica under a burst of 10x its capacity (bench/serve_burst.py)\n\n" + text + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
