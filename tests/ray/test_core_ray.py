"""CORE over Ray workers (raychat.eval.core.score_tasks): the same per-task numbers and errors in this process
and on 1 and 2 workers, for a small real GPT on a bundle of all three task types with shots."""

from __future__ import annotations

import pytest
import ray
import torch
from support.cluster import init_local_ray
from support.core_fixtures import byte_tokenizer, write_bundle

from raychat.eval.core import score_tasks
from raychat.eval.core_bundle import load_bundle
from raychat.model import GPT, ModelConfig


@pytest.fixture(scope="module")
def local_ray():
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def tiny_gpt() -> GPT:
    cfg = ModelConfig(
        vocab_size=265,
        n_layer=1,
        n_embd=32,
        n_head=2,
        n_kv_head=2,
        head_dim=16,
        intermediate_size=64,
        max_seq_len=48,
    )
    model = GPT(cfg).init_weights(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)  # clear preferences (std ~5 logits) instead of near ties
    return model


def bundle(root):
    words = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "rock", "fish", "bird", "star"]
    mc = [
        {"query": f"{w} is", "choices": words[i % 3 : i % 3 + 4], "gold": i % 4} for i, w in enumerate(words)
    ]
    schema = [
        {"context_options": [f"The {w}", f"A {words[-1 - i]}"], "continuation": "ran", "gold": i % 2}
        for i, w in enumerate(words[:9])
    ]
    lm = [{"context": f"{w} {w}", "continuation": w[:2]} for w in words]
    bad = [{"context": w, "continuation": "" if i == 5 else w} for i, w in enumerate(words)]
    return write_bundle(
        root,
        {
            "mc": {"type": "multiple_choice", "items": mc, "shots": 2, "baseline": 25},
            "schema": {"type": "schema", "items": schema, "shots": 1, "baseline": 50},
            "lm": {"type": "language_modeling", "items": lm, "shots": 3},
            "bad": {"type": "language_modeling", "items": bad, "delimiter": ""},
        },
    )


def test_scores_are_the_same_in_process_and_on_1_and_2_workers(local_ray, tmp_path):
    model, tok = tiny_gpt(), byte_tokenizer()
    tasks = load_bundle(bundle(tmp_path))
    runs = {n: score_tasks(model, tok, tasks, num_workers=n, timeout_s=120) for n in (0, 1, 2)}
    for n in (1, 2):
        assert runs[n]["tasks"] == runs[0]["tasks"], n
        assert runs[n]["workers"] == n
    out = runs[2]
    assert sorted(out["results"]) == ["lm", "mc", "schema"]
    assert out["errors"]["bad"].startswith(f"{tmp_path}/eval_data/bad.jsonl:6: ValueError")  # its 6th line
    assert out["core_metric"] is None
    accuracies = [out["results"][k] * out["tasks"][k]["examples"] for k in out["results"]]
    assert all(a == int(a) for a in accuracies)  # whole items each
    assert 0 < sum(out["results"].values()) < 3  # not a trivial all-right or all-wrong model


def test_workers_past_the_timeout_raise_instead_of_hanging(local_ray, tmp_path):
    tasks = load_bundle(bundle(tmp_path))
    with pytest.raises(TimeoutError, match="2 Ray workers did not finish within 0.01 s"):
        score_tasks(tiny_gpt(), byte_tokenizer(), tasks, num_workers=2, timeout_s=0.01)
