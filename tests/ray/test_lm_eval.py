"""A peer harness on raychat: lm-evaluation-harness (lm_eval, the test extra) scores a small multiple-choice
task defined from local files (a task YAML + JSONL in a temp dir) twice, as its users run it: its
`local-completions` model against a real `raychat serve` (POST /v1/completions with echo and logprobs, behind
an API key), and its `hf` model on the HF export of the same checkpoint. Both must give the accuracy, and
every choice's log-likelihood, that the checkpoint's own forward gives for the same tokens."""

from __future__ import annotations

import argparse
import json

import lm_eval
import pytest
import requests
import torch
from lm_eval.tasks import TaskManager
from support.serve_helpers import write_tiny_checkpoint
from support.serve_process import ServeProcess

from raychat.checkpoint import load_model
from raychat.export import hf as export_hf

pytestmark = pytest.mark.slow
TASK = "raychat_tiny_mc"
KEY = "lm-eval-test-key"
ITEMS = [
    {"question": "The json module encodes", "choices": ["objects", "strings", "floats"], "gold": 0},
    {"question": "def dumps(obj", "choices": [", skipkeys", ") :", " indent"], "gold": 0},
    {"question": "textwrap wraps", "choices": ["text", "lines of text", "width"], "gold": 1},
    {"question": "import", "choices": ["re", "json", "sys"], "gold": 2},
    {"question": "return", "choices": ["None", "self", "result"], "gold": 1},
    {"question": "class JSONEncoder", "choices": ["(object):", ":", "(Exception):"], "gold": 0},
]
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{items}}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    checkpoint = write_tiny_checkpoint(root / "tiny-ckpt")
    export = root / "hf"
    assert export_hf.main(argparse.Namespace(checkpoint=str(checkpoint), out=str(export))) == 0
    tasks = root / "tasks"
    tasks.mkdir()
    items = tasks / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(items=items))
    return checkpoint, export, tasks


def own_logliks(checkpoint) -> list[list[float]]:
    """Each choice's log-likelihood from the checkpoint's own forward, on the tokens lm_eval scores: context
    = the question, continuation = " " + choice, split as lm_eval does (ids of the whole minus the context's
    ids; no <|bos|>, as the HF export's tokenizer adds none)."""
    model, tokenizer, _ = load_model(checkpoint, device="cpu")
    out = []
    for item in ITEMS:
        row = []
        for choice in item["choices"]:
            context = tokenizer.encode(item["question"])
            whole = tokenizer.encode(item["question"] + " " + choice)
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole]))[0].float(), dim=-1)
            row.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(context), len(whole))))
        out.append(row)
    return out


def run_lm_eval(model: str, model_args: str, tasks) -> tuple[float, list[float]]:
    """lm_eval.simple_evaluate on TASK: (acc, every choice's log-likelihood, item by item in order)."""
    result = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True, batch_size=1,
    )  # fmt: skip
    samples = sorted(result["samples"][TASK], key=lambda s: s["doc_id"])
    logliks = [float(r[0][0]) for s in samples for r in s["resps"]]
    return result["results"][TASK]["acc,none"], logliks


def test_lm_eval_local_completions_and_hf_match_raychat(setup, monkeypatch):
    checkpoint, export, tasks = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expected = own_logliks(checkpoint)
    picks = [max(range(len(row)), key=row.__getitem__) for row in expected]
    expected_acc = sum(p == item["gold"] for p, item in zip(picks, ITEMS)) / len(ITEMS)
    # the items tell the choices apart (no near-ties), so an accuracy that matches means the same picks
    assert all(sorted(row)[-1] - sorted(row)[-2] > 1e-3 for row in expected)

    hf_acc, hf_logliks = run_lm_eval("hf", f"pretrained={export},dtype=float32,device=cpu", tasks)
    assert hf_acc == pytest.approx(expected_acc)
    assert hf_logliks == pytest.approx([x for row in expected for x in row], abs=1e-4)

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as the bearer token
    with ServeProcess(checkpoint, args=["--api-key", KEY]) as server:
        # docs/openai.md's model arguments: the model id and max_length (the context; lm_eval's default, 2048, sent
        # longer prompts than a 256-token model takes, refused as context_length_exceeded) from /v1/models
        models = requests.get(
            f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
        )
        (model,) = models.json()["data"]
        assert (model["id"], model["max_seq_len"]) == (str(checkpoint), 256)
        model_args = (
            f"model={model['id']},base_url={server.url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={export},max_length={model['max_seq_len']}"
        )
        api_acc, api_logliks = run_lm_eval("local-completions", model_args, tasks)
    assert api_acc == pytest.approx(expected_acc)
    assert api_logliks == pytest.approx([x for row in expected for x in row], abs=1e-4)
