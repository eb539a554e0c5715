"""The GPU check (issue 21 item 6), one run on one H100/H200 in under 9 minutes; prints ONE JSON line at the end.

Prepared on a CPU machine; NOT run here (no GPU). Run it with `bash bench/gpu_check.sh`. In order:
1. pretraining of a depth-12 model (ModelConfig.from_depth(12), vocab 65,536, seq 1024, 16 rows a step) for
   --steps steps in bf16 autocast, then the same from the same init with FP8 Linear layers
   (raychat.train.fp8.convert_to_fp8, tensorwise; real FP8 matmuls on the GPU), both with raychat's
   optimizers (Muon + AdamW, raychat.train.optim.build_optimizers) on one synthetic, learnable token stream
   (random 64-token phrases repeated): tokens/s of the steps after the first 10 (compile-free warm-up),
   MFU (raychat.model.GPT.flops_per_token x tokens/s / the device's dense bf16 peak of
   raychat.train.plan.peak_flops_of), the loss at the last step;
2. the engine's decode tokens/s (ModelRunner.generate_batch, bf16, greedy, 128-token prompts, 128 new
   tokens; bench/engine_gpu.py's timing) at 1, 8 and 32 rows, from the bf16 model of 1;
3. vLLM on the HF export of that model (raychat.export.hf) at the same rows, when `vllm` imports (else the
   JSON says why not);
4. `raychat serve --checkpoint <the bf16 model> --num-gpus 1` answering 16 concurrent streamed chat requests
   through the official openai client: how many ended with finish_reason stop/length, the wall time, TTFT.

    bash bench/gpu_check.sh                  # the check (CUDA)
    bash bench/gpu_check.sh --dry-run        # every code path on a CPU at tiny sizes (tests/ray/test_gpu_check.py)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from _engine_common import random_prompts, synthetic_tokenizer
from engine_gpu import timed_generate, vllm_tps

from raychat.checkpoint import save_model
from raychat.config.train import OptimSection
from raychat.engine.runner import ModelRunner
from raychat.model import GPT, ModelConfig
from raychat.ports import free_ports
from raychat.train.fp8 import convert_to_fp8
from raychat.train.optim import build_optimizers
from raychat.train.plan import peak_flops_of

REPO = Path(__file__).resolve().parents[1]
FULL = dict(depth=12, vocab=65536, seq=1024, rows=16, steps=60, warmup=10, decode_rows=(1, 8, 32), prompt=128,
            new=128, streams=16, serve_gpus=1)  # fmt: skip
DRY = dict(depth=2, vocab=512, seq=64, rows=2, steps=4, warmup=1, decode_rows=(1, 2), prompt=8, new=8,
           streams=4, serve_gpus=0)  # fmt: skip


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def token_stream(vocab: int, rows: int, seq: int, seed: int = 0):
    """(rows, seq + 1) batches of random 64-token phrases, each repeated: a stream a model can learn."""
    g = torch.Generator().manual_seed(seed)
    while True:
        phrases = torch.randint(300, vocab, (rows, 64), generator=g)
        yield phrases.repeat(1, (seq + 1) // 64 + 1)[:, : seq + 1]


def pretrain(c: dict, device: str, fp8: bool, init: dict) -> tuple[dict, GPT]:
    """Train --steps steps from the state dict `init`; returns ({tokens_per_s, mfu, last_loss, ...}, model)."""
    cfg = ModelConfig.from_depth(c["depth"], vocab_size=c["vocab"], max_seq_len=c["seq"])
    model = GPT(cfg).to(device)
    model.load_state_dict(init)
    converted = convert_to_fp8(model) if fp8 else 0
    optimizers = build_optimizers(model, OptimSection())
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    data, times, loss = token_stream(c["vocab"], c["rows"], c["seq"]), [], float("nan")
    for _ in range(c["steps"]):
        batch = next(data).to(device)
        sync()
        t = time.perf_counter()
        with autocast:
            logits = model(batch[:, :-1])
        step_loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        step_loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        loss = step_loss.item()  # syncs
        times.append(time.perf_counter() - t)
    tokens_per_s = c["rows"] * c["seq"] * len(times[c["warmup"] :]) / sum(times[c["warmup"] :])
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_flops_of(name)
    flops = model.flops_per_token(c["seq"])
    return {
        "fp8_linears": converted, "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(flops * tokens_per_s / peak, 4) if peak else None, "last_loss": round(loss, 4),
    }, model  # fmt: skip


def decode(c: dict, model: GPT, tok, device: str) -> dict[int, float]:
    model = model.eval()
    runner = ModelRunner(model, tok, dtype="bfloat16" if device == "cuda" else "float32")
    return {b: round(timed_generate(runner, random_prompts(tok, b, c["prompt"]), c["new"])[0], 1) for b in c["decode_rows"]}  # fmt: skip


def vllm_decode(c: dict, tok) -> dict:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return {
            "skipped": f"vllm does not import here ({e}); install the vLLM environment: constraints-vllm.txt"
        }
    args = argparse.Namespace(prompt_len=c["prompt"], new_tokens=c["new"], rows=list(c["decode_rows"]))
    return {str(k): round(v, 1) for k, v in vllm_tps(tok, c["depth"], args).items()}


def serve_streams(c: dict, checkpoint: Path, log: Path) -> dict:
    """`raychat serve --checkpoint DIR --num-gpus N` on a local Ray, then c["streams"] concurrent streams."""
    import openai
    import requests

    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "raychat.cli", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
           "--num-gpus", str(c["serve_gpus"]), "--max-slots", str(c["streams"]), "--num-cpus", "1"]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                return {"error": f"raychat serve did not come up: {log.read_text()[-1500:]}"}
            time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        model = client.models.list().data[0].id

        def stream(i: int) -> tuple[str | None, float]:
            t = time.perf_counter()
            ttft, finish = None, None
            for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell me about {i}."}], max_tokens=c["new"],
                stream=True,
            ):  # fmt: skip
                if ttft is None:
                    ttft = time.perf_counter() - t
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return finish, ttft

        t = time.perf_counter()
        with ThreadPoolExecutor(c["streams"]) as pool:
            results = list(pool.map(stream, range(c["streams"])))
        wall = time.perf_counter() - t
        ttfts = [x for _, x in results if x is not None]
        return {
            "streams": c["streams"], "finished": sum(f in ("stop", "length") for f, _ in results),
            "wall_s": round(wall, 2), "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        }  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def section(result: dict, name: str, fn) -> None:
    """result[name] = fn(), or {"error": ...}: one failing part does not lose the others."""
    t = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as e:  # noqa: BLE001 (the JSON line reports it)
        traceback.print_exc()
        result[name] = {"error": f"{type(e).__name__}: {e}"}
    print(f"[gpu_check] {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks the code paths")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and logs go (default: a temp dir)")
    a = ap.parse_args()
    c = DRY if a.dry_run else FULL
    device = "cpu" if a.dry_run else "cuda"
    if not a.dry_run and not torch.cuda.is_available():
        print(
            "bench/gpu_check.py: no CUDA device here; pass --dry-run to check the code on a CPU",
            file=sys.stderr,
        )
        return 2
    if a.dry_run:
        # one torch thread: the tiny dry-run steps gain nothing from more, and on a loaded CPU the idle threads
        # spin (measured 2026-12-07, 2 cores: pretrain bf16 5.8 -> 0.3 CPU-s, fp8 12.3 -> 2.5); the serve replica
        # sets its own
        torch.set_num_threads(1)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"dry_run": a.dry_run, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "sizes": {k: v for k, v in c.items() if k != "decode_rows"}}  # fmt: skip
    tok = synthetic_tokenizer(c["vocab"])
    torch.manual_seed(0)
    init = GPT(ModelConfig.from_depth(c["depth"], vocab_size=c["vocab"], max_seq_len=c["seq"])).init_weights(
        0
    )
    init = {k: v.detach().clone() for k, v in init.state_dict().items()}
    models = {}

    def run(fp8: bool):
        stats, models["fp8" if fp8 else "bf16"] = pretrain(c, device, fp8, init)
        return stats

    section(result, "pretrain_bf16", lambda: run(False))
    section(result, "pretrain_fp8", lambda: run(True))
    models.pop("fp8", None)
    model = models.get("bf16")
    if model is None:
        result["decode_raychat"] = result["serve"] = {"error": "no bf16 model (pretrain_bf16 failed)"}
    else:
        section(result, "decode_raychat", lambda: decode(c, model, tok, device))
        save_model(
            work / "ckpt", model.float().cpu(), tok, {"step": c["steps"], "stage": "pretrain"}, commit=True
        )
        del models["bf16"], model
        if device == "cuda":
            torch.cuda.empty_cache()
        section(result, "decode_vllm", lambda: vllm_decode(c, tok))
        section(result, "serve", lambda: serve_streams(c, work / "ckpt", work / "serve.log"))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
