"""CORE (raychat.eval.core, raychat.eval.core_bundle): nanochat's prompt rendering, token spans and scoring of
the three task types, worked out by hand on a bigram stub whose preferences are known; centered accuracy and
CORE; the bundle layout and its bad inputs; the bundle download from a loopback server."""

from __future__ import annotations

import contextlib
import http.server
import io
import math
import random
import re
import threading
import zipfile
from pathlib import Path

import jinja2
import pytest
from support.core_fixtures import BigramStub, byte_tokenizer, write_bundle

from raychat.data.corpus.download import DownloadError
from raychat.eval.core import (
    centered_accuracy,
    core_scores,
    crop,
    fewshot_indices,
    render_prompts,
    score_tasks,
    token_spans,
)
from raychat.eval.core_bundle import BundleError, download_bundle, load_bundle

# Prefer 'b' after ' ', ' ' after 'g' and ' ' after '='; every other character predicts uniformly.
PREFS = {" ": "b", "g": " ", "=": " "}
S = 50.0  # the stub's strength
V = 265  # 256 bytes + 9 special tokens
HIT = math.log(V - 1 + math.exp(S)) - S  # loss of the preferred token (~5e-20)
MISS = math.log(V - 1 + math.exp(S))  # loss of any other token after a character with a preference (~50)
FLAT = math.log(V)  # loss of any token after a character with no preference (5.58)

MC = {
    "type": "multiple_choice",
    "baseline": 25,
    "items": [
        {"query": "Q1:", "choices": ["a", "b", "c", "d"], "gold": 1},  # ' '->b: picks 1, correct
        {"query": "Q2:", "choices": ["b", "c", "d", "e"], "gold": 2},  # picks 0, wrong
        # mean, not sum: "zzzz" = (MISS + 3 FLAT) / 4 = 16.7 < "c" = MISS = 50 (sums: 66.7 > 50): picks 0, correct
        {"query": "Q3:", "choices": ["zzzz", "c"], "gold": 0},
    ],
}
SCHEMA = {
    "type": "schema",
    "baseline": 50,
    "items": [  # scored: the common suffix " sat"/" ran"; only its first token differs ('g'->' ' is preferred)
        {"context_options": ["The cat", "The dog"], "continuation": "sat", "gold": 1},  # picks 1, correct
        {"context_options": ["A dog", "A cat"], "continuation": "ran", "gold": 1},  # picks 0, wrong
    ],
}
LM = {
    "type": "language_modeling",
    "baseline": 0,
    "items": [  # delimiter ' ': the scored tokens are ' ' + continuation
        {"context": "x=", "continuation": "b"},  # '='->' ', ' '->'b': correct
        {"context": "y= ", "continuation": "bc"},  # 'b' predicts byte 0 (uniform argmax), not 'c': wrong
        {"context": "  z=", "continuation": "b"},  # context stripped: correct
    ],
}
# centered: mc (2/3 - .25) / .75 = 5/9; schema (1/2 - 1/2) / (1/2) = 0; lm 2/3. CORE = (5/9 + 0 + 6/9) / 3
CORE = 11 / 27


@pytest.fixture
def tok():
    return byte_tokenizer()


def test_centered_accuracy_is_nanochats_formula():
    assert centered_accuracy(0.5, 25) == pytest.approx(1 / 3)
    assert centered_accuracy(0.25, 25) == 0.0
    assert centered_accuracy(1.0, 25) == 1.0
    assert centered_accuracy(0.0, 50) == -1.0


def test_multiple_choice_renders_shots_then_one_prompt_per_choice():
    shots = [
        {"query": "2+2=", "choices": ["3", "4"], "gold": 1},
        {"query": "1+1=", "choices": ["2"], "gold": 0},
    ]
    item = {"query": "3+3=", "choices": ["5", "6"], "gold": 1}
    assert render_prompts("multiple_choice", item, " ", shots) == [
        "2+2= 4\n\n1+1= 2\n\n3+3= 5",
        "2+2= 4\n\n1+1= 2\n\n3+3= 6",
    ]
    assert render_prompts("multiple_choice", item, ":") == ["3+3=:5", "3+3=:6"]


def test_schema_renders_the_gold_context_of_each_shot_and_every_option_of_the_item():
    shots = [{"context_options": ["I ran", "You ran"], "continuation": "fast", "gold": 0}]
    item = {"context_options": ["The cat", "The dog"], "continuation": "sat", "gold": 1}
    assert render_prompts("schema", item, " ", shots) == [
        "I ran fast\n\nThe cat sat",
        "I ran fast\n\nThe dog sat",
    ]


def test_language_modeling_strips_contexts_and_the_prompt_without_the_continuation():
    shots = [{"context": " a= ", "continuation": "1"}]
    item = {"context": "\tb= ", "continuation": "2 "}
    # without: "a= 1\n\nb= " stripped; with: the continuation after the delimiter, not stripped
    assert render_prompts("language_modeling", item, " ", shots) == ["a= 1\n\nb=", "a= 1\n\nb= 2 "]
    assert render_prompts("language_modeling", {"context": "", "continuation": "x"}, "\n") == ["", "\nx"]


# nanochat/core_eval.py's templates, verbatim: the reference render_prompts must equal.
NANOCHAT_TEMPLATES = {
    "multiple_choice": """
{%- for example in fewshot_examples -%}
{{ example.query }}{{ continuation_delimiter }}{{ example.choices[example.gold] }}

{% endfor -%}
{{ item.query }}{{ continuation_delimiter }}{{ choice }}""",
    "schema": """
{%- for example in fewshot_examples -%}
{{ example.context_options[example.gold] }}{{ continuation_delimiter }}{{ example.continuation }}

{% endfor -%}
{{ context }}{{ continuation_delimiter }}{{ item.continuation }}""",
    "language_modeling": """
{%- for example in fewshot_examples -%}
{{ example.context | trim }}{{ continuation_delimiter }}{{ example.continuation }}

{% endfor -%}
{{ item.context | trim }}{{ continuation_delimiter }}{% if include_continuation %}{{ item.continuation }}{% endif %}""",
}


def nanochat_render(task_type, item, delimiter, shots):
    t = jinja2.Template(NANOCHAT_TEMPLATES[task_type].strip())
    ctx = {"fewshot_examples": shots, "continuation_delimiter": delimiter, "item": item}
    if task_type == "multiple_choice":
        return [t.render(choice=c, **ctx) for c in item["choices"]]
    if task_type == "schema":
        return [t.render(context=c, **ctx) for c in item["context_options"]]
    return [t.render(include_continuation=False, **ctx).strip(), t.render(include_continuation=True, **ctx)]


@pytest.mark.parametrize("task", [MC, SCHEMA, LM], ids=lambda t: t["type"])
@pytest.mark.parametrize("delimiter", [" ", "\nAnswer: ", ""])
def test_render_prompts_equals_nanochats_templates(task, delimiter):
    items = [
        *task["items"],
        *({**x, "context": f" {x['context']}\n"} for x in task["items"] if "context" in x),
    ]
    for i, item in enumerate(items):
        shots = [items[j] for j in fewshot_indices(i, len(items), min(2, len(items) - 1))]
        want = nanochat_render(task["type"], item, delimiter, shots)
        assert render_prompts(task["type"], item, delimiter, shots) == want


def test_fewshot_indices_are_nanochats_seeded_sample_of_the_other_items():
    assert fewshot_indices(3, 10, 0) == []
    assert fewshot_indices(3, 10, 4) == random.Random(1234 + 3).sample([0, 1, 2, 4, 5, 6, 7, 8, 9], 4)
    assert sorted(fewshot_indices(2, 5, 4)) == [0, 1, 3, 4]


def test_token_spans_of_each_type(tok):
    bos = tok.bos_id
    rows, s, e = token_spans(tok, "multiple_choice", ["Q: ab", "Q: c"])
    assert rows == [[bos, *b"Q: ab"], [bos, *b"Q: c"]] and s == [4, 4] and e == [6, 5]
    rows, s, e = token_spans(tok, "schema", ["The cat sat", "A dog sat"])
    assert s == [8, 6] and e == [12, 10]  # the common suffix " sat"
    rows, s, e = token_spans(tok, "language_modeling", ["x=", "x= 4"])
    assert rows == [[bos, *b"x= 4"]] and s == [3] and e == [5]
    with pytest.raises(ValueError, match="strict prefix"):
        token_spans(tok, "language_modeling", ["x=", "x="])


def test_crop_keeps_the_last_tokens_and_shifts_the_spans():
    assert crop([[9, 1, 2, 3, 4]], [3], [5], 3) == ([[2, 3, 4]], [1], [3])
    assert crop([[9, 1, 2]], [1], [3], 8) == ([[9, 1, 2]], [1], [3])
    with pytest.raises(ValueError, match="max_seq_len = 2"):
        crop([[9, 1, 2, 3, 4]], [3], [5], 2)


def test_scores_of_each_task_type_and_core_worked_out_by_hand(tmp_path, tok):
    bundle = write_bundle(tmp_path, {"mc": MC, "schema": SCHEMA, "lm": LM})
    out = core_scores(BigramStub(PREFS, V, S), tok, bundle)
    assert out["results"] == pytest.approx({"mc": 2 / 3, "schema": 0.5, "lm": 2 / 3})
    assert out["centered_results"] == pytest.approx({"mc": 5 / 9, "schema": 0.0, "lm": 2 / 3})
    assert out["core_metric"] == pytest.approx(CORE)
    assert out["errors"] == {} and out["workers"] == 0
    assert out["tasks"]["mc"] == {
        "task_type": "multiple_choice",
        "num_fewshot": 0,
        "random_baseline": 25.0,
        "examples": 3,
        "accuracy": pytest.approx(2 / 3),
        "centered": pytest.approx(5 / 9),
        "error": None,
    }
    # the Q3 margin the mean decides: (MISS + 3 FLAT) / 4 against MISS
    assert (MISS + 3 * FLAT) / 4 < MISS < MISS + 3 * FLAT and HIT < 1e-15


def test_the_model_sees_the_shots_rendered_exactly(tmp_path, tok):
    items = [
        {"query": "Q1:", "choices": ["a", "b"], "gold": 1},
        {"query": "Q2:", "choices": ["c", "d"], "gold": 1},
    ]
    bundle = write_bundle(tmp_path, {"mc": {"type": "multiple_choice", "items": items, "shots": 1}})
    model = BigramStub(PREFS, V, S)
    # Q1 right (' '->b); Q2: c and d tie, the first wins: wrong
    assert core_scores(model, tok, bundle)["results"] == {"mc": 0.5}
    seen = {tok.decode(row[1:].tolist()) for call in model.calls for row in call}
    assert seen == {"Q2: d\n\nQ1: a", "Q2: d\n\nQ1: b", "Q1: b\n\nQ2: c", "Q1: b\n\nQ2: d"}
    assert all(call[:, 0].tolist() == [tok.bos_id] * 2 for call in model.calls)


def test_items_are_shuffled_and_cut_as_nanochat_does(tmp_path):
    items = [{"context": f"c{i}", "continuation": "x"} for i in range(10)]
    write_bundle(tmp_path, {"lm": {"type": "language_modeling", "items": items}})
    order = list(range(10))
    random.Random(1337).shuffle(order)
    (task,) = load_bundle(tmp_path, max_per_task=4)
    assert [x["context"] for x in task.items] == [f"c{i}" for i in order[:4]]
    assert task.lines == [i + 1 for i in order[:4]]


def test_numbers_where_text_is_expected_are_read_as_nanochats_jinja_renders_them(tmp_path):
    items = [{"query": 12, "choices": [3, 4.5, "x"], "gold": 2}] * 2
    write_bundle(tmp_path, {"mc": {"type": "multiple_choice", "items": items}})
    (task,) = load_bundle(tmp_path)
    assert task.items[0] == {"query": "12", "choices": ["3", "4.5", "x"], "gold": 2}
    assert render_prompts("multiple_choice", task.items[0], " ") == nanochat_render(
        "multiple_choice", items[0], " ", []
    )


def test_sequences_longer_than_max_seq_len_are_cropped_from_the_left(tmp_path, tok):
    # 1 shot makes each prompt ~10 tokens; a max_seq_len of 4 keeps "z: b" and the ' '->'b' answer is still read
    items = [{"query": "long query z:", "choices": ["a", "b"], "gold": 1}] * 2
    bundle = write_bundle(tmp_path, {"mc": {"type": "multiple_choice", "items": items, "shots": 1}})
    model = BigramStub(PREFS, V, S, max_seq_len=4)
    assert core_scores(model, tok, bundle)["results"] == {"mc": 1.0}
    assert {tuple(c.shape) for c in model.calls} == {(2, 4)}


# ---- bad input --------------------------------------------------------------------------------------------
def bad_item_cases():
    mc = {"type": "multiple_choice"}
    ok = {"query": "Q:", "choices": ["a", "b"], "gold": 0}
    return {
        "missing field": (
            {**mc, "items": [ok, {"query": "Q:", "choices": ["a", "b"]}]},
            r"bad\.jsonl:2: field 'gold' is missing \(multiple_choice items need query, choices, gold\)",
        ),
        "gold past the choices": (
            {**mc, "items": [{"query": "Q:", "choices": ["a", "b"], "gold": 3}, ok]},
            r"bad\.jsonl:1: field 'gold' = 3 but the item has 2 choices \(allowed 0\.\.1\)",
        ),
        "empty file": ({**mc, "items": ""}, r"bad\.jsonl: no items \(empty file\)"),
        "not json": ({**mc, "items": '{"query": "Q:", \n'}, r"bad\.jsonl:1: not valid JSON"),
        "one choice": (
            {**mc, "items": [{"query": "Q:", "choices": ["a"], "gold": 0}, ok]},
            r"bad\.jsonl:1: field 'choices' has 1 entries; at least 2 are needed",
        ),
        "null query": (
            {**mc, "items": [ok, {"query": None, "choices": ["a", "b"], "gold": 0}]},
            r"bad\.jsonl:2: field 'query' must be a string",
        ),
        "string gold": (
            {
                "type": "schema",
                "items": [{"context_options": ["a", "b"], "continuation": "c", "gold": "1"}] * 2,
            },
            r"bad\.jsonl:1: field 'gold' must be an integer, got str",
        ),
        "too few for the shots": (
            {**mc, "items": [ok, ok], "shots": 2},
            r"num_fewshot = 2 needs more than 2 items",
        ),
        "lm continuation is empty": (  # found while scoring, not while loading
            {
                "type": "language_modeling",
                "items": [{"context": "a", "continuation": ""}] * 2,
                "delimiter": "",
            },
            r"bad\.jsonl:[12]: ValueError: the tokens of the context alone are not a strict prefix",
        ),
    }


@pytest.mark.parametrize("case", list(bad_item_cases()))
def test_a_bad_task_fails_alone_with_file_line_and_field(tmp_path, tok, case):
    bad, message = bad_item_cases()[case]
    bundle = write_bundle(tmp_path, {"mc": MC, "bad": bad, "lm": LM})
    out = core_scores(BigramStub(PREFS, V, S), tok, bundle)
    assert list(out["errors"]) == ["bad"]
    assert out["errors"]["bad"].startswith(str(tmp_path / "eval_data" / "bad.jsonl"))
    assert pytest.approx(out["results"]) == {"mc": 2 / 3, "lm": 2 / 3}  # the others as without it
    assert out["tasks"]["bad"]["accuracy"] is None and out["core_metric"] is None
    assert re.search(message, out["errors"]["bad"]), out["errors"]["bad"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda y: y.replace("  icl_task_type: schema\n", ""),
            r"icl_tasks\[1\]: field 'icl_task_type' is missing",
        ),
        (
            lambda y: y.replace("icl_task_type: schema", "icl_task_type: qa"),
            r"'qa'; allowed: multiple_choice, schema",
        ),
        (
            lambda y: y.replace("- 0", "- -1", 1),
            r"icl_tasks\[0\] \(mc\): field 'num_fewshot' must be an integer >= 0",
        ),
        (
            lambda y: y.replace("dataset_uri: lm.jsonl", "dataset_uri: ../x.jsonl"),
            r"relative path inside eval_data",
        ),
        (lambda y: y.replace("label: lm", "label: mc"), r"labels must be unique; repeated: mc"),
        (lambda y: "tasks: []\n", r"field 'icl_tasks' must be a non-empty list"),
    ],
)
def test_a_wrong_core_yaml_raises_naming_entry_and_field(tmp_path, tok, edit, message):
    write_bundle(tmp_path, {"mc": MC, "schema": SCHEMA, "lm": LM})
    path = tmp_path / "core.yaml"
    path.write_text(edit(path.read_text()))
    with pytest.raises(BundleError, match=message) as e:
        core_scores(BigramStub(PREFS, V, S), tok, tmp_path)
    assert str(path) in str(e.value)


def test_a_wrong_meta_data_csv_raises_naming_the_row_or_column(tmp_path, tok):
    write_bundle(tmp_path, {"mc": MC, "lm": LM})
    csv_path = tmp_path / "eval_meta_data.csv"
    text = csv_path.read_text()
    csv_path.write_text(text.replace("lm,test", "other,test"))
    with pytest.raises(BundleError, match=r"eval_meta_data\.csv: no 'Random baseline' row for task 'lm'"):
        load_bundle(tmp_path)
    csv_path.write_text(text.replace(",25\n", ",high\n"))
    with pytest.raises(
        BundleError, match=r"eval_meta_data\.csv:2: 'Random baseline' = 'high' is not a number"
    ):
        load_bundle(tmp_path)
    csv_path.write_text(text.replace(",25\n", ",100\n"))
    with pytest.raises(BundleError, match=r"must be in \[0, 100\) percent"):
        load_bundle(tmp_path)
    csv_path.write_text(text.replace("Random baseline", "Baseline"))
    with pytest.raises(BundleError, match=r"column 'Random baseline' is missing"):
        load_bundle(tmp_path)
    (tmp_path / "core.yaml").unlink()
    with pytest.raises(BundleError, match=r"core\.yaml: not found"):
        load_bundle(tmp_path)


def test_num_workers_must_not_be_negative(tmp_path, tok):
    write_bundle(tmp_path, {"lm": LM})
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        score_tasks(BigramStub(PREFS, V, S), tok, load_bundle(tmp_path), num_workers=-1)


# ---- download ---------------------------------------------------------------------------------------------
def bundle_zip(root: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                z.write(path, f"eval_bundle/{path.relative_to(root).as_posix()}")
    return buf.getvalue()


@contextlib.contextmanager
def serve(files: dict[str, bytes]):
    """A loopback HTTP server of `files` (URL path -> body; 404 for others); yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_download_bundle_unpacks_the_zip_into_place(tmp_path, tok):
    src = write_bundle(tmp_path / "src", {"mc": MC, "schema": SCHEMA, "lm": LM})
    with serve({"/eval_bundle.zip": bundle_zip(src), "/broken.zip": b"not a zip"}) as base:
        dest = download_bundle(tmp_path / "bundles" / "core", f"{base}/eval_bundle.zip", attempts=1)
        assert dest == tmp_path / "bundles" / "core"
        assert core_scores(BigramStub(PREFS, V, S), tok, dest)["core_metric"] == pytest.approx(CORE)
        assert download_bundle(dest, f"{base}/missing.zip") == dest  # present: not fetched again
        with pytest.raises(DownloadError, match="not a zip archive"):
            download_bundle(tmp_path / "other", f"{base}/broken.zip", attempts=2, backoff_s=0)
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == ["core"]  # no temporary left
    assert not (tmp_path / "other").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(BundleError, match="exists but holds no core.yaml"):
        download_bundle(tmp_path / "full", "http://127.0.0.1:9/never")
