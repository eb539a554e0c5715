"""Ray tier: the whole speedrun on a tiny preset and a tiny local corpus (every stage, minutes not hours)."""

import json
import random

import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = (
    "the a river stone light cloud tree bird wind fire water runs falls grows sings over under near "
    "green blue old new small large"
).split()


@pytest.fixture()
def tiny_preset(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(300):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80))) + "."
        (corpus / f"doc{i:03d}.txt").write_text(text)
    preset = {
        "data": {"source": str(corpus), "num_shards": 3},
        "tokenizer": {"vocab_size": 320},
        "train": dict(
            depth=1,
            aspect_ratio=64,
            head_dim=32,
            seq_len=64,
            device_batch_size=4,
            num_workers=2,
            cpus_per_worker=0.5,
            total_batch_size=512,
            num_iterations=8,
            eval_every=4,
            eval_tokens=512,
            checkpoint_every=4,
            buffer_size=16,
        ),
        "sft": {"num_iterations": 3, "sft_tasks": "calculator:200", "eval_examples": 4},
        "rl": {
            "steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "max_tokens": 8,
            "eval_every": 2,
            "eval_examples": 4,
            "eval_samples": 2,
            "rollout_workers": 1,
            "checkpoint_every": 2,
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def test_speedrun_end_to_end(tiny_preset, tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tmp_path / "no-task-data"))  # no hub files, no CORE bundle

    from raychat.speedrun import run_speedrun

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        report = run_speedrun(str(tiny_preset), str(tmp_path / "out"))
        again = run_speedrun(str(tiny_preset), str(tmp_path / "out"))  # every stage's output is there
    finally:
        ray.shutdown()
    # the second invocation reuses every stage and reports the figures and wall times of the first
    assert report["reused"] == [] and again["reused"] == ["data", "tokenizer", "pretrain", "sft", "rl"]
    for stage in ("data", "tokenizer", "pretrain", "sft", "rl"):
        assert again["timings_s"][stage] == report["timings_s"][stage] > 0, stage
    assert again["pretrain"]["val_bpb"] == report["pretrain"]["val_bpb"]
    assert again["tokenizer"] == report["tokenizer"] and again["rl"] == report["rl"]
    assert again["sft"]["accuracy_before"] == report["sft"]["accuracy_before"]
    assert report["pretrain"]["step"] == 8
    assert 0 < report["pretrain"]["val_bpb"] < 20 and 0 < report["unigram_bpb"] < 20
    assert report["sft"]["step"] == 3
    assert 0.0 <= report["sft"]["accuracy_after"] <= 1.0
    assert report["rl"]["steps"] == 2 and 0.0 <= report["rl"]["pass@1_after"] <= 1.0
    assert report["final_checkpoint"].endswith("checkpoint_000002")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "validation BPB" in text and "unigram baseline BPB" in text
    for stage in ("pretrain", "sft", "rl"):  # curves drawn from each stage's metrics sink
        assert f"![{stage} curves](curves_{stage}.png)" in text
        assert (tmp_path / "out" / f"curves_{stage}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = report["report_card"]["rows"]  # the report card: what has data here is measured, the rest says so
    assert list(card) == ["base", "sft", "rl"]
    assert card["base"]["CORE"]["note"] == "n/a: no data" and card["base"]["SpellingBee"]["note"] == "-"
    for stage in ("sft", "rl"):
        assert all(
            card[stage][c]["note"] == "n/a: no data" for c in ("ARC-Easy", "MMLU", "GSM8K", "HumanEval")
        )
        assert (
            0.0 <= card[stage]["SpellingBee"]["value"] <= 1.0 and card[stage]["SpellingBee"]["examples"] > 0
        )
        assert card[stage]["ChatCORE"]["note"] == "n/a: needs all six" and card[stage]["wall_s"] > 0
    assert "## Report card" in text and report["report_card"]["markdown"] in text
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["final_checkpoint"] == report["final_checkpoint"]
