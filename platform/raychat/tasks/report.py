"""Mixture report: per source, its share of samples, of tokens and of target tokens after rendering."""

from __future__ import annotations

from collections import defaultdict

from raychat.chat_template import render_conversation
from raychat.tokenizer import Tokenizer

LOSS_NORMALIZATION = "token-level: sum of CE over target tokens / target tokens summed over all micro-batches and ranks of the step"


def mixture_report(
    tokenizer: Tokenizer, mixture, row_len: int | None = None, limit: int | None = None
) -> dict:
    """Render the first `limit` items of a TaskMixture / TaskSequence (all when None) and tally per source.

    Args:
        row_len: truncate as training does (render_conversation max_tokens); dropped samples are counted.
    Returns:
        {"sources": {name: {samples, sample_share, tokens, token_share, targets, target_share, dropped}},
         "samples", "tokens", "targets", "dropped", "loss_normalization"}; shares are fractions in [0, 1]
         of the kept samples / tokens / targets.
    """
    n = len(mixture) if limit is None else min(limit, len(mixture))
    per = defaultdict(lambda: {"samples": 0, "tokens": 0, "targets": 0, "dropped": 0})
    for i in range(n):
        conversation = mixture[i]
        r = render_conversation(tokenizer, conversation, max_tokens=row_len)
        s = per[conversation.get("source", "?")]
        if r.dropped:
            s["dropped"] += 1
            continue
        s["samples"] += 1
        s["tokens"] += len(r)
        s["targets"] += r.num_targets
    totals = {k: sum(s[k] for s in per.values()) for k in ("samples", "tokens", "targets", "dropped")}
    for s in per.values():
        for k in ("samples", "tokens", "targets"):
            s[f"{k[:-1]}_share"] = s[k] / totals[k] if totals[k] else 0.0
    return {"sources": dict(sorted(per.items())), **totals, "loss_normalization": LOSS_NORMALIZATION}


def format_report(report: dict) -> str:
    lines = [
        f"{'source':<24}{'samples':>9}{'share':>8}{'tokens':>10}{'share':>8}{'targets':>10}{'share':>8}{'dropped':>9}"
    ]
    for name, s in report["sources"].items():
        lines.append(
            f"{name:<24}{s['samples']:>9}{s['sample_share']:>8.1%}{s['tokens']:>10}{s['token_share']:>8.1%}"
            f"{s['targets']:>10}{s['target_share']:>8.1%}{s['dropped']:>9}"
        )
    lines.append(f"loss normalization: {report['loss_normalization']}")
    return "\n".join(lines)
