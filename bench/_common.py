"""Shared pieces of the training/data benchmarks: the real corpus and tokenizer, a private Ray cluster,
steady-state tokens/s from a run's metrics.jsonl, and the machine/load line that every result records.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path


def corpus(
    workdir: str | Path, data_dir: str | None = None, tokenizer_dir: str | None = None
) -> tuple[str, str]:
    """(data_dir, tokenizer_dir): the default corpus (`raychat data prepare`, debian-docs, 7 train shards)
    and a 4096-token tokenizer trained on it, built under `workdir` unless given (or already there)."""
    from raychat.data.corpus.prepare import prepare
    from raychat.tokenizer_cli import train_tokenizer

    workdir = Path(workdir)
    data = Path(data_dir) if data_dir else workdir / "data"
    tok = Path(tokenizer_dir) if tokenizer_dir else workdir / "tokenizer"
    if not (data / "manifest.json").exists():
        prepare(source="debian-docs", out=data, num_shards=7)
    if not (tok / "tokenizer.json").exists():
        train_tokenizer(str(data), str(tok), 4096)
    return str(data), str(tok)


def start_ray(num_cpus: int, workdir: str | Path) -> None:
    """A private local Ray cluster (never an existing one) with `num_cpus` logical CPUs."""
    import ray

    os.environ.pop("RAYCHAT_THREADS", None)  # the loop would take its thread count from it
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(Path(workdir, "ray").resolve()),
    )


def steady_tokens_per_s(per_step: list[float], tokens_per_step: int, skip: int) -> float:
    """Tokens/s over the steps after the first `skip`: total tokens / total step time, where a step's time
    is tokens_per_step / its tokens/s (so this is the harmonic mean of the per-step rates)."""
    rates = per_step[skip:]
    if not rates:
        raise ValueError(f"no steps left after skipping {skip} of {len(per_step)}")
    return len(rates) * tokens_per_step / sum(tokens_per_step / r for r in rates)


def read_metrics(storage: str | Path, run_name: str) -> list[dict]:
    """The per-step lines rank 0 wrote to <storage>/<run_name>/metrics.jsonl."""
    path = Path(storage, run_name, "metrics.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine() -> str:
    import torch

    return f"{os.cpu_count()} CPUs, {platform.machine()}, Python {sys.version.split()[0]}, torch {torch.__version__}"


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0], Path(__file__).parents[1]), *sys.argv[1:]])


def append_result(out: str | Path, text: str) -> None:
    """Append a section to a results markdown file (created with nothing else in it)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(text.rstrip() + "\n\n")


def markdown_table(rows: list[dict], float_format: str = ".4g") -> str:
    """A markdown table of dict rows that share their keys (the first row's keys are the header); floats
    formatted with float_format, everything else with str."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(format(v, float_format) if isinstance(v, float) else str(v) for v in r.values())
            + " |"
        )
    return "\n".join(lines)


def add_common_flags(ap: argparse.ArgumentParser) -> None:
    """--workdir, --data-dir, --tokenizer, --out: where the corpus, tokenizer, Ray and results go."""
    ap.add_argument("--workdir", default=None, help="corpus, tokenizer, Ray and runs go here (default: tmp)")
    ap.add_argument("--data-dir", default=None, help="reuse prepared shards instead of preparing the corpus")
    ap.add_argument("--tokenizer", default=None, help="reuse a tokenizer directory instead of training one")
    ap.add_argument("--out", default=None, help="append the markdown result here")
