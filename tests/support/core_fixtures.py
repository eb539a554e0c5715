"""CORE test helpers: a bundle in the DCLM/nanochat layout written into a directory, a byte-level tokenizer
(one token per byte, so token spans are countable by hand) and a bigram stub model with known preferences."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from torch import nn

from raychat.tokenizer import SPLIT_PATTERN, Tokenizer


def byte_tokenizer() -> Tokenizer:
    """No merges: token id = the byte's value (ASCII text: ord(char)); BOS = 256."""
    return Tokenizer(SPLIT_PATTERN, {bytes([i]): i for i in range(256)})


class BigramStub(nn.Module):
    """Logits at position t depend only on the token at t: `strength` on the preferred next token of each
    character in `prefs`, 0 elsewhere (uniform). Same forward interface as raychat.model.GPT. Every call's
    input_ids are kept in `calls`."""

    def __init__(
        self, prefs: dict[str, str], vocab_size: int = 265, strength: float = 50.0, max_seq_len=None
    ):
        super().__init__()
        table = torch.zeros(vocab_size, vocab_size)
        for a, b in prefs.items():
            table[ord(a), ord(b)] = strength
        self.register_buffer("table", table)
        self.config = SimpleNamespace(max_seq_len=max_seq_len)
        self.calls: list[torch.Tensor] = []

    def forward(
        self, input_ids, position_ids=None, segment_ids=None, attn_mask=None, kv_cache=None, logits_at=None
    ):
        self.calls.append(input_ids.clone())
        logits = self.table[input_ids]
        if logits_at is not None:
            logits = logits[torch.arange(len(input_ids)), logits_at]
        return logits


def write_bundle(root: Path, tasks: dict[str, dict]) -> Path:
    """Write core.yaml, eval_meta_data.csv and eval_data/<label>.jsonl under root; returns root.

    tasks: {label: {"type", "items" (list of dicts, or a str: the file's raw text), "shots" (default 0),
    "delimiter" (default: left out, i.e. " "), "baseline" (percent, default 0)}}.
    """
    (root / "eval_data").mkdir(parents=True, exist_ok=True)
    entries = []
    for label, t in tasks.items():
        entry = {"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [t.get("shots", 0)]}
        entry["icl_task_type"] = t["type"]
        if "delimiter" in t:
            entry["continuation_delimiter"] = t["delimiter"]
        entries.append(entry)
        items = t["items"]
        text = items if isinstance(items, str) else "".join(json.dumps(x) + "\n" for x in items)
        (root / "eval_data" / f"{label}.jsonl").write_text(text, encoding="utf-8")
    (root / "core.yaml").write_text(yaml.safe_dump({"icl_tasks": entries}, sort_keys=False), encoding="utf-8")
    with open(root / "eval_meta_data.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline"])
        for label, t in tasks.items():
            w.writerow([label, "test", t["type"], t.get("shots", 0), 0, t.get("baseline", 0)])
    return root
