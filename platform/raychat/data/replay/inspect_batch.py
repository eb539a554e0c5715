"""`raychat inspect-batch`: the batch of a training step rebuilt from its replay record, or canary samples (or
your --sft-data conversations) token by token (what it prints: `raychat inspect-batch --help`, raychat.commands.INSPECT_BATCH_DESCRIPTION)."""

from __future__ import annotations

import argparse

import torch

from raychat.chat_template import TEMPLATE_VERSION, messages_of, render_conversation
from raychat.data.loader.sample_packing import PackItem, SamplePacker, rows_to_batch, stack_rows
from raychat.data.replay.rebuild import verify_step
from raychat.data.replay.records import read_step, rows_batch
from raychat.masks import document_causal_mask
from raychat.tasks.sft_data import SFTData, sft_data_files
from raychat.tokenizer import Tokenizer

PACKED_MEMBERS = ("short", "unicode", "code")


def canary_conversations() -> dict[str, dict]:
    """The canary conversations by name (the "packed" canary reuses short, unicode and code)."""
    turn = [
        {"role": "user", "content": "Tell me about turn {k} of this long chat, with some detail please."},
        {"role": "assistant", "content": "Turn {k}: nothing much happened, but thank you for asking twice."},
    ]
    long_messages = [{"role": "system", "content": "You are terse."}]
    for k in range(12):
        long_messages += [{"role": m["role"], "content": m["content"].format(k=k)} for m in turn]
    return {
        "short": {
            "id": "canary/short",
            "messages": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}],
        },
        "empty": {
            "id": "canary/empty",
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": ""},
                {"role": "assistant", "content": ""},
            ],
        },
        "tool_use": {
            "id": "canary/tool_use",
            "messages": [
                {"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "What is 12 * 34?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Computing. "},
                        {"type": "python", "text": "12 * 34"},
                    ],
                },
                {"role": "tool", "content": "408"},
                {"role": "assistant", "content": "#### 408"},
                {"role": "user", "content": "And plus 2?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "python", "text": "408 + 2"},
                        {"type": "python_output", "text": "410"},
                        {"type": "text", "text": "#### 410"},
                    ],
                },
            ],
        },
        "unicode": {
            "id": "canary/unicode",
            "messages": [
                {"role": "user", "content": "Ça va? 日本語 🙂 naïve"},
                {"role": "assistant", "content": "Très bien 👍 — ありがとう"},
            ],
        },
        "code": {
            "id": "canary/code",
            "messages": [
                {"role": "user", "content": "Fix: def f(x):\n\treturn x  # <|assistant_end|>"},
                {"role": "assistant", "content": "def f(x):\n    return x + 1\n"},
            ],
        },
        "overlong": {"id": "canary/overlong", "messages": long_messages},
        "overlong_turn": {
            "id": "canary/overlong_turn",
            "messages": [
                {"role": "user", "content": "Repeat after me. " * 200},
                {"role": "assistant", "content": "No."},
            ],
        },
    }


def canary_texts() -> list[str]:
    texts = []
    for conv in canary_conversations().values():
        for m in messages_of(conv):
            c = m["content"]
            texts.append(c if isinstance(c, str) else "".join(p["text"] for p in c))
    return texts


def inspect_canaries(tokenizer: Tokenizer, row_len: int, names: list[str] | None = None) -> str:
    """The full report as text (see the module docstring)."""
    convs = canary_conversations()
    names = names or [*convs, "packed"]
    out = [f"template {TEMPLATE_VERSION}  tokenizer {tokenizer.version}  row_len {row_len} (T={row_len - 1})"]
    for name in names:
        members = PACKED_MEMBERS if name == "packed" else (name,)
        out.append(f"\n=== canary {name} ===")
        out += _section(tokenizer, row_len, [convs[m] for m in members], packed=name == "packed")
    return "\n".join(out)


def inspect_sft_data(tokenizer: Tokenizer, row_len: int, value: str, examples: int) -> str:
    """The first `examples` conversations of an --sft-data value (its train files, then its test files, each in
    file order), each rendered, truncated to `row_len` and padded to a row as SFT trains on it, as a table like
    the canaries'; each headed by its file and line.

    Raises:
        ValueError: one line, as `raychat sft --sft-data` refuses the value (a missing file, a bad record).
    """
    files = sft_data_files(value)
    try:
        task = SFTData([*files.train, *files.test])
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--sft-data: {e}") from None
    n = min(examples, len(task))
    out = [
        f"template {TEMPLATE_VERSION}  tokenizer {tokenizer.version}  row_len {row_len} (T={row_len - 1}); "
        f"the first {n} of {len(task)} conversations"
    ]
    for i in range(n):
        example = task.get_example(i)
        out.append(f"\n=== {example['where']} ===")
        out += _section(tokenizer, row_len, [example], packed=False)
    return "\n".join(out)


def _section(tokenizer: Tokenizer, row_len: int, conversations: list[dict], packed: bool) -> list[str]:
    """Lines: each conversation's rendering summary, then its row(s) (one per row, or best-fit `packed`)."""
    rendered = {c["id"]: render_conversation(tokenizer, c, max_tokens=row_len) for c in conversations}
    out = [
        f"{sid}: {len(r)} tokens, {r.num_targets} targets, truncation {r.truncation.to_dict()}"
        for sid, r in rendered.items()
    ]
    items = [PackItem.from_rendered(sid, r) for sid, r in rendered.items() if not r.dropped]
    if not items:
        return [*out, "dropped: not trained on"]
    packer = SamplePacker.from_items(items, row_len, tokenizer.bos_id, mode="bestfit" if packed else "pad")
    return out + [format_row(tokenizer, row, rendered) for row in packer]


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """repr of the token's text; bytes that are not whole UTF-8 characters are shown as a bytes literal."""
    raw = tokenizer.decode_bytes([token_id])
    try:
        return repr(raw.decode("utf-8"))[:22]
    except UnicodeDecodeError:
        return repr(raw)[:22]


def format_row(tokenizer: Tokenizer, row: dict, rendered: dict) -> str:
    """Table of one packed row; `rendered` maps sample id -> RenderedConversation (for the roles)."""
    L = len(row["input_ids"])
    roles = ["pad"] * L
    for sid, off in zip(row["sample_ids"], row["segment_offsets"]):
        r = rendered[sid]
        roles[off : off + len(r)] = r.roles
    batch = rows_to_batch(stack_rows([row]), tokenizer.bos_id)
    mask = document_causal_mask(batch["segment_ids"])[0, 0]
    ids = row["input_ids"].tolist()
    lines = [
        f"row: samples {row['sample_ids']} at offsets {row['segment_offsets'].tolist()}, "
        f"{row['num_targets']} targets",
        f"{'pos':>4} {'id':>5}  {'text':<22} {'role':<9} {'seg':>3} {'position':>8} {'visible':>9}  label",
    ]
    n_pad = roles.count("pad")
    for i in range(L):
        text = token_text(tokenizer, ids[i])
        if roles[i] == "pad" and 0 < i < L - 1 and roles[i - 1] == "pad":
            if roles[i - 2] != "pad":
                lines.append(f"   ... {n_pad - 2} more padding positions (same segment, label -)")
            continue
        if i == L - 1:
            lines.append(
                f"{i:>4} {ids[i]:>5}  {text:<22} {roles[i]:<9} {int(row['segment_ids'][i]):>3} {'':>8} {'':>9}  (label only)"
            )
            continue
        keys = torch.nonzero(mask[i]).flatten().tolist()
        visible = (
            f"{keys[0]}..{keys[-1]}" if keys == list(range(keys[0], keys[-1] + 1)) else f"{len(keys)} keys"
        )
        label = token_text(tokenizer, int(batch["labels"][0, i])) if batch["loss_mask"][0, i] else "-"
        lines.append(
            f"{i:>4} {ids[i]:>5}  {text:<22} {roles[i]:<9} {int(batch['segment_ids'][0, i]):>3} "
            f"{int(batch['position_ids'][0, i]):>8} {visible:>9}  {label}"
        )
    return "\n".join(lines)


def segment_text(record: dict, k: int, files: list[str]) -> str:
    """One segment of a replay record row, e.g. `shard_00003.parquet:0:17[0:+120]@0 whole` or `calculator-train/12+40@0`."""
    where = f"@{record['row_offset'][k]}"
    if "sample_id" in record:
        return f"{record['sample_id'][k]}+{record['length'][k]}{where}"
    doc = f"{files[record['doc_shard'][k]]}:{record['doc_row_group'][k]}:{record['doc_row'][k]}"
    tail = f"({record['tail'][k]})" if record["tail"][k] else ""
    return f"{doc}[{record['doc_offset'][k]}:+{record['length'][k]}]{where} {record['decision'][k]}{tail}"


def rebuilt_row_table(tokenizer: Tokenizer, batch: dict, i: int) -> list[str]:
    """Row `i` of a step's make_batch tensors (records.rows_batch), one line a position: pos, input id, its
    text, segment (- without document masking), position, label (its text; "-" where loss_mask is False)."""
    lines = [f"{'pos':>5} {'id':>6}  {'text':<22} {'seg':>3} {'position':>8}  label"]
    for p in range(batch["input_ids"].shape[1]):
        token = int(batch["input_ids"][i, p])
        seg = int(batch["segment_ids"][i, p]) if "segment_ids" in batch else "-"
        label = token_text(tokenizer, int(batch["labels"][i, p])) if batch["loss_mask"][i, p] else "-"
        lines.append(
            f"{p:>5} {token:>6}  {token_text(tokenizer, token):<22} {seg:>3} "
            f"{int(batch['position_ids'][i, p]):>8}  {label}"
        )
    return lines


def inspect_step(
    run_dir: str,
    step: int,
    data_dir: str | None = None,
    tokenizer: str | None = None,
    row: int | None = None,
) -> tuple[str, bool]:
    """(report, identical): step `step`'s records listed row by row and verified against the rebuilt rows;
    with `row` (0-based, in the listing's order), that rebuilt row token by token (rebuilt_row_table).

    Raises:
        ValueError: `row` outside the step's rows (naming --row and the allowed range).
    """
    records, meta = read_step(run_dir, step)
    if row is not None and not 0 <= row < len(records):
        raise ValueError(f"--row {row}: step {step} has {len(records)} rows; allowed: 0..{len(records) - 1}")
    rows, problems = verify_step(records, meta, data_dir, tokenizer)
    files = meta["data"].get("files", [])
    out = [
        f"{run_dir} step {step}: {records[0]['world']} ranks, {len(records)} rows of {meta['row_len']} tokens; "
        f"stage {meta['stage']}, seed {meta['seed']}, tokenizer {meta['tokenizer_version']}, "
        f"template {meta['template_version']}"
    ]
    for r in records:
        segments = " | ".join(segment_text(r, k, files) for k in range(len(r["doc"])))
        out.append(f"rank {r['rank']} micro {r['micro']} row {r['row']}: {segments}")
    names = ", ".join(k.removesuffix("_sha256") for k in records[0] if k.endswith("_sha256"))
    if problems:
        out += ["DIFFERS from the record:", *(f"  {p}" for p in problems)]
    else:
        out.append(f"rebuilt {len(records)} rows from the data: {names} hashes equal to the record")
    if row is not None and rows:
        r = records[row]
        out.append(
            f"row {row} (rank {r['rank']} micro {r['micro']} row {r['row']}) as trained on: input_ids, labels, "
            "loss_mask (label -: not in the loss), segment_ids, position_ids"
        )
        batch = rows_batch(rows, meta["bos_id"], meta["document_masking"])
        out += rebuilt_row_table(Tokenizer.load(tokenizer or meta["tokenizer_path"]), batch, row)
    elif row is not None:
        out.append(f"row {row}: not shown, the step's rows could not be rebuilt")
    return "\n".join(out), not problems


def run(args: argparse.Namespace) -> int:
    if args.run or args.step is not None:
        if not args.run or args.step is None:
            raise ValueError(
                "--run and --step go together: --run RUN_DIR --step N rebuilds that step's batch"
            )
        if args.canary or args.sft_data:
            flag = "--canary prints canary samples" if args.canary else "--sft-data prints your conversations"
            raise ValueError(f"{flag}; it does not go with --run and --step")
        report, identical = inspect_step(args.run, args.step, args.data_dir, args.tokenizer or None, args.row)
        print(report)
        return 0 if identical else 1
    if args.row is not None:
        raise ValueError(
            "--row goes with --run and --step (a row of that step); the canaries print every row"
        )
    if args.examples is not None and not args.sft_data:
        raise ValueError("--examples goes with --sft-data (how many of your conversations to print)")
    if args.sft_data and args.canary:
        raise ValueError("--canary prints canary samples, --sft-data your conversations: give one of them")
    if args.data_dir is not None:
        raise ValueError(
            "--data-dir goes with --run and --step (the shards of that run's step); canaries read none"
        )
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        tokenizer = Tokenizer.train(canary_texts() * 4, vocab_size=args.vocab_size)
        print(f"(no --tokenizer: trained a {tokenizer.vocab_size}-token BPE on the canary texts)")
    if args.sft_data:
        print(inspect_sft_data(tokenizer, args.row_len, args.sft_data, args.examples or 4))
    else:
        print(inspect_canaries(tokenizer, args.row_len, args.canary))
    return 0
