"""Ray tier: the whole speedrun on a tiny preset and a tiny local corpus (every stage, minutes not hours)."""

import contextlib
import io
import json
import random
import shutil

import pytest
import ray
import yaml
from support.cluster import init_local_ray

from raychat.checkpoint_manager import COMMIT_FILE
from raychat.cli import main as raychat_main
from raychat.log import plural
from raychat.speedrun import run_speedrun
from raychat.train.layout import LOCAL_DATA_CPUS, local_cores

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = (
    "the a river stone light cloud tree bird wind fire water runs falls grows sings over under near "
    "green blue old new small large"
).split()


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("speedrun")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(300):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 80))) + "."
        (corpus / f"doc{i:03d}.txt").write_text(text)
    mine = tmp_path / "mine.jsonl"  # a user's own conversations, added to the SFT mixture (--sft-data)
    mine.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"{w}?"}, {"role": "assistant", "content": w}]}) + "\n"
        for w in WORDS[:20]
    ))  # fmt: skip
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
        "sft": {
            "num_iterations": 3,
            "sft_tasks": "calculator:200",
            "sft_data": str(mine),
            "eval_examples": 4,
        },
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


@pytest.fixture(scope="module")
def speedrun(tiny_preset):
    """(the --out of a tiny speedrun run twice, the first invocation's report, the second's, the second's
    output lines): the module's tests share it (one full speedrun)."""
    out = tiny_preset.parent / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        # no hub files, no CORE bundle
        monkeypatch.setenv("RAYCHAT_TASK_DATA", str(tiny_preset.parent / "no-task-data"))
        init_local_ray(num_cpus=2, include_dashboard=False)
        try:
            report = run_speedrun(str(tiny_preset), str(out))
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                again = run_speedrun(str(tiny_preset), str(out))  # every stage's output is there
        finally:
            ray.shutdown()
        yield out, report, again, printed.getvalue().splitlines()


def test_speedrun_end_to_end(speedrun):
    out, report, again, lines = speedrun
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
    assert 0 < report["sft"]["sft-data_val_bpb"] < 20 and 0 < report["sft"]["calculator_val_bpb"] < 20
    assert (
        "sft data: --sft-data: 19 conversations to train on, 1 held out for sft-data_val_bpb (--sft-test-size "
        "0.05 of 20, in seed 42's order)"
    ) in lines  # logged again as the second invocation checks that SFT has nothing left to train
    assert 0.0 <= report["sft"]["accuracy_after"] <= 1.0
    assert report["rl"]["steps"] == 2 and 0.0 <= report["rl"]["pass@1_after"] <= 1.0
    assert report["final_checkpoint"].endswith("checkpoint_000002")
    text = (out / "report.md").read_text()
    assert "validation BPB" in text and "unigram baseline BPB" in text
    for stage in ("pretrain", "sft", "rl"):  # curves drawn from each stage's metrics sink
        assert f"![{stage} curves](curves_{stage}.png)" in text
        assert (out / f"curves_{stage}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
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
    rl = out / "rl" / "rl" / "checkpoint_000002"  # the finished line names the preset's key, not rl's --steps
    assert (
        f"finished: the run's checkpoint {rl} is at step 2, the last of its 2 steps; nothing to train (rl.steps "
        "above 2 trains it longer)"
    ) in lines
    saved = json.loads((out / "report.json").read_text())
    assert saved["final_checkpoint"] == report["final_checkpoint"]


def test_a_speedrun_starts_ray_for_rl_alone(speedrun, tiny_preset, capsys):
    """Pretraining and SFT finished, rl/ gone: the speedrun starts no Ray for the finished stages (their finished
    lines name what trains them longer in the speedrun: --num-iterations is pretraining's, SFT's horizon is the
    preset's sft.num_iterations), then starts a local Ray cluster for RL alone (connect), which trains and
    commits its checkpoint."""
    out = speedrun[0]
    shutil.rmtree(out / "rl")
    capsys.readouterr()
    assert not ray.is_initialized()
    try:
        assert raychat_main(["speedrun", "--preset", str(tiny_preset), "--out", str(out)]) == 0
    finally:
        ray.shutdown()
    lines = capsys.readouterr().out.splitlines()
    base, sft = (
        out / "checkpoints" / "base" / "checkpoint_000008",
        out / "checkpoints" / "sft" / "checkpoint_000003",
    )
    assert (
        f"finished: the run's checkpoint {base} is at step 8, the last of its 8 steps; nothing to train "
        "(--num-iterations above 8 trains it longer)"
    ) in lines
    assert (
        f"finished: the run's checkpoint {sft} is at step 3, the last of its 3 steps; nothing to train "
        "(sft.num_iterations above 3 trains it longer)"
    ) in lines
    rl = lines.index(next(line for line in lines if line.startswith("=== 6/6 RL")))
    local = f"(a local Ray cluster: {plural(local_cores(), 'core')} + {LOCAL_DATA_CPUS} for Ray Data)"
    started = [i for i, line in enumerate(lines) if line.endswith(local)]  # Ray, started once: for RL
    assert len(started) == 1 and started[0] > rl, lines
    assert [line for line in lines if line.startswith("RL: ")][0].startswith(
        "RL: 2 steps, pass@1 on 4 held-out problems "
    )
    assert (out / "rl" / "rl" / "checkpoint_000002" / COMMIT_FILE).exists()
    assert json.loads((out / "report.json").read_text())["final_checkpoint"] == str(
        out / "rl" / "rl" / "checkpoint_000002"
    )
