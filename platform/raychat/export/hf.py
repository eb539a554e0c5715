"""Export a raychat checkpoint to the Hugging Face layout (`raychat export --checkpoint REF`): the files go to
<storage-path>/<run-name>/ or to --out (with none of the three, beside the checkpoint's run:
<root>/<run>/checkpoint_<step> goes to <root>/<run>-hf-step<step>/, raychat.checkpoint_manager.output_place;
latest and a run name are looked up under runs/checkpoints), whole: a local one is assembled beside its target under a temporary
name and renamed into place (raychat.atomic.atomic_write_dir: an export killed part-way leaves the earlier
export as it was, never new files beside old ones), one on object storage (a --storage-path or an --out of
s3://bucket/prefix or gs://bucket/prefix) is staged in a local .export.<16 hex> directory under EXPORT_STAGING, then uploaded (raychat.storage.upload_dir) and deleted, and EXPORT_STAGING too once empty; the next such export deletes
the staging directories a killed one left there (idle for an hour). The upload deletes config.json there first,
uploads the other files, deletes the files an earlier export left that this one lacks, and uploads config.json
last: a prefix with a config.json holds one whole export, one without it an upload that ended part-way
(transformers refuses it; the next export replaces it). A directory that holds anything but an earlier export is refused
(check_export_target); --checkpoint is any reference raychat.checkpoint_manager resolves (`latest`: the newest checkpoint there).
The files the export reads (raychat.checkpoint.MODEL_FILES) are checked against their sha256 digests in the
checkpoint's commit.json first, so a checkpoint damaged in place (same size) is refused rather than exported.

Files written into OUT (each atomically: temporary name, then rename):
  config.json              Qwen3Config, architectures ["Qwen3ForCausalLM"] (parameter names already match)
  model.safetensors        the weights, float32, names as in raychat.model.GPT (= Qwen3ForCausalLM)
  tokenizer.json           a `tokenizers` byte-level BPE equal to the tiktoken encoding (see below)
  tokenizer_config.json    PreTrainedTokenizerFast, bos/eos/pad tokens, the Jinja chat_template
  generation_config.json   bos, eos (<|assistant_end|> and <|bos|>), pad, sampling; no max_length, as Qwen3's
                           (config.json's max_position_embeddings bounds the context; a max_length here made
                           every generate(max_new_tokens=...) warn that both were set)
  chat_template.jinja      the same Jinja template as a file (transformers >= 4.43 reads either)

Tokenizer conversion (tiktoken -> `tokenizers`), after transformers' TikTokenConverter:
  - vocab: every mergeable token's bytes mapped through the GPT-2 byte-to-unicode table (Radford et al.
    2019, `bytes_to_unicode` in openai/gpt-2 encoder.py) -> its tiktoken rank;
  - merges: for every token t of 2+ bytes, each split t = a + b with a and b both tokens, ordered by
    rank(t) and then by (rank(a), rank(b)). tiktoken merges the adjacent pair whose concatenation has the
    lowest rank; listing every split of t at t's rank gives HF's BPE the same choice;
  - ignore_merges=True: a pre-token that is itself a token maps to it directly, as in tiktoken;
  - pre-tokenizer: Split(the tiktoken regex, isolated) then ByteLevel(use_regex=False); decoder ByteLevel;
  - special tokens added as special AddedTokens with their raychat ids.
Chat template (CHAT_TEMPLATE_JINJA) renders the layout of raychat.chat_template as text; the HF tokenizer then
encodes that text in one piece, whereas raychat encodes every span on its own. The ids are equal whenever
the tokenizer's split regex already breaks the text at span boundaries, as it does for ordinary messages (a
system message and SYSTEM_SEPARATOR "\n\n" are one span, so a system message ending in whitespace agrees);
they can differ when the user message after a system message starts with a line break, which the regex joins
to the separator ("\n\n" + "\nHi": raychat's ids for "\n\n" then "\n", HF's one id for "\n\n\n").
HF tokenizers match special-token text anywhere in their input, whereas raychat encodes special-token text
inside content as plain text: the template escapes it (MARKER_ESCAPE) and the tokenizer's normalizer undoes
the escape after special tokens are matched, so the ids are raychat's for any content.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.fs as pafs
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from raychat.atomic import (
    STAGING_IDLE_S,
    atomic_write,
    atomic_write_dir,
    atomic_write_text,
    fresh_dir,
    remove_leftovers,
)
from raychat.chat_template import TEMPLATE_VERSION
from raychat.checkpoint import MODEL_FILES, load_model
from raychat.checkpoint_manager import (
    DEFAULT_CACHE,
    check_output_target,
    find_checkpoint,
    output_place,
    verify,
)
from raychat.config import ExportConfig, from_args
from raychat.config.eval import CHECKPOINTS_ROOT
from raychat.model import GPT
from raychat.storage import Storage, check_writable, copy_command, is_remote, open_storage, upload_dir
from raychat.tokenizer import BOS, Tokenizer

ARCHITECTURE = "Qwen3ForCausalLM"
EOS = "<|assistant_end|>"
EXPORT_FILES = frozenset(
    {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    }
)  # what export_hf writes
REQUIRED_EXPORT_FILES = frozenset({"config.json", "model.safetensors"})  # a tokenizer dir has no model

# Marker text inside content, escaped for the HF tokenizer, which matches special-token text anywhere in its
# input (raychat encodes it as plain text): MARKER_ESCAPE goes after every "<" followed by "|" or by
# MARKER_ESCAPE, so escaped text never contains "<|" (every marker starts with it), and the exported
# tokenizer's normalizer, which runs after special tokens are matched, removes one MARKER_ESCAPE after each
# "<" and so restores the text before BPE. The Jinja template escapes every content string the same way.
MARKER_ESCAPE = "\ue000"  # a private-use character


def escape_marker_text(text: str) -> str:
    """`text` with MARKER_ESCAPE inserted after each "<" followed by "|" or MARKER_ESCAPE (see above)."""
    return text.replace("<" + MARKER_ESCAPE, "<" + MARKER_ESCAPE * 2).replace("<|", "<" + MARKER_ESCAPE + "|")


def unescape_marker_text(text: str) -> str:
    """The inverse of escape_marker_text (what the exported tokenizer's normalizer does)."""
    return text.replace("<" + MARKER_ESCAPE, "<")


# raychat.chat_template's layout in Jinja (transformers' apply_chat_template; also read by vLLM). Markers are
# literal text, which the HF tokenizer maps to the special ids; content goes through `text`, which takes a
# string or OpenAI's list of {"type": "text", "text"} parts (joined with "\n", as raychat's server does) and
# escapes marker text (escape_marker_text). Assistant content may also be raychat's parts (text / python /
# python_output). OpenAI tool_calls in an assistant message are not rendered: the calculator does not run
# under vLLM (raychat.serve.vllm).
CHAT_TEMPLATE_JINJA = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{%- set s = c -%}{%- else -%}{%- set s = c | map(attribute='text') | join('\n') -%}{%- endif -%}"
    "{{- s | replace('<' ~ '" + MARKER_ESCAPE + "', '<' ~ '" + MARKER_ESCAPE * 2 + "')"
    " | replace('<|', '<' ~ '" + MARKER_ESCAPE + "' ~ '|') -}}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system='', in_assistant=false) -%}"
    "<|bos|>"
    "{%- for message in messages -%}"
    "{%- if message.role in ('system', 'developer') -%}{%- set ns.system = text(message.content) + '\n\n' -%}"
    "{%- elif message.role == 'user' -%}"
    "{%- if ns.in_assistant -%}<|assistant_end|>{%- set ns.in_assistant = false -%}{%- endif -%}"
    "<|user_start|>{{ ns.system }}{{ text(message.content) }}<|user_end|>{%- set ns.system = '' -%}"
    "{%- else -%}"
    "{%- if not ns.in_assistant -%}<|assistant_start|>{%- set ns.in_assistant = true -%}{%- endif -%}"
    "{%- if message.role == 'tool' -%}<|output_start|>{{ text(message.content) }}<|output_end|>"
    "{%- elif message.content is string -%}{{ text(message.content) }}"
    "{%- elif message.content -%}{%- for part in message.content -%}"
    "{%- if part.type == 'text' -%}{{ text(part.text) }}"
    "{%- elif part.type == 'python' -%}<|python_start|>{{ text(part.text) }}<|python_end|>"
    "{%- else -%}<|output_start|>{{ text(part.text) }}<|output_end|>"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    # a prompt ending with a tool message leaves its assistant turn open (render_for_completion)
    "{%- if not (add_generation_prompt and messages and messages[-1].role == 'tool') -%}"
    "{%- if ns.in_assistant -%}<|assistant_end|>{%- endif -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"
    "{%- endif -%}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _hf_token(token: bytes, table: dict[int, str]) -> str:
    return "".join(table[b] for b in token)


def bpe_vocab_and_merges(mergeable_ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level BPE vocabulary and merge list equal to tiktoken's `mergeable_ranks` (see module doc)."""
    table = bytes_to_unicode()
    vocab = {_hf_token(t, table): r for t, r in mergeable_ranks.items()}
    ranked = []
    for token, rank in mergeable_ranks.items():
        for i in range(1, len(token)):
            a, b = token[:i], token[i:]
            if a in mergeable_ranks and b in mergeable_ranks:
                ranked.append((rank, mergeable_ranks[a], mergeable_ranks[b], a, b))
    ranked.sort(key=lambda x: x[:3])
    merges = [(_hf_token(a, table), _hf_token(b, table)) for _, _, _, a, b in ranked]
    return vocab, merges


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """tokenizer.json text (the `tokenizers` library's serialization) for a raychat Tokenizer."""
    vocab, merges = bpe_vocab_and_merges(tokenizer.mergeable_ranks)
    hf = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False)
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    hf.normalizer = normalizers.Replace("<" + MARKER_ESCAPE, "<")  # unescape (see MARKER_ESCAPE)
    hf.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    for name, idx in specials:
        if hf.token_to_id(name) != idx:
            raise ValueError(f"special token {name}: HF id {hf.token_to_id(name)} != raychat id {idx}")
    return hf.to_str()


def hf_config(model: GPT, tokenizer: Tokenizer) -> dict:
    """config.json for Qwen3ForCausalLM from the model's ModelConfig (field map in the code below)."""
    c = model.config
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,  # read by transformers 4.x and vLLM
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},  # transformers 5
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "use_cache": True,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.special_id(EOS),
        "pad_token_id": tokenizer.bos_id,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def export_hf(model: GPT, tokenizer: Tokenizer, out: str | os.PathLike) -> Path:
    """Write the Hugging Face directory for (model, tokenizer) into `out` (created); returns its path.

    Raises:
        ValueError: the tokenizer has more ids than the model's embedding rows.
    """
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but model vocab_size is {model.config.vocab_size}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)  # of an earlier export that was killed
    template = CHAT_TEMPLATE_JINJA
    eos_ids = [tokenizer.special_id(EOS), tokenizer.bos_id]
    atomic_write_text(out / "config.json", json.dumps(hf_config(model, tokenizer), indent=2))
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    atomic_write_text(out / "tokenizer.json", hf_tokenizer_json(tokenizer))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": BOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_seq_len,
        "chat_template": template,
        "raychat_tokenizer_version": tokenizer.version,
        "raychat_template_version": TEMPLATE_VERSION,
    }
    atomic_write_text(out / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))
    atomic_write_text(
        out / "special_tokens_map.json", json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": BOS})
    )
    generation_config = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": tokenizer.bos_id,
        "do_sample": True,
        "temperature": 1.0,
    }
    atomic_write_text(out / "generation_config.json", json.dumps(generation_config, indent=2))
    atomic_write_text(out / "chat_template.jinja", template)
    return out


def is_earlier_export(entries: list[pafs.FileInfo], killed: bool, remote: bool = False) -> bool:
    """Whether a directory's entries (its leftovers aside: check_output_target) are an earlier export: only
    EXPORT_FILES, config.json and model.safetensors among them; or, killed (a leftover of a killed write was
    there), config.json among them (an export writes it first); or, remote (on object storage), no config.json
    among them (an upload that ended part-way: it deletes config.json first and uploads it last)."""
    files = {e.base_name for e in entries if e.type == pafs.FileType.File}
    if len(files) != len(entries) or not files <= EXPORT_FILES:
        return False
    need = {"config.json"} if killed else REQUIRED_EXPORT_FILES
    return need <= files or (remote and "config.json" not in files)


def check_export_target(storage: Storage, target: str, flag: str) -> str:
    """`target` on storage.fs, where an export goes, replacing what is there: nothing, an empty directory or an
    earlier export (is_earlier_export; on object storage also one whose upload ended part-way).

    Raises ValueError naming `flag`: a checkpoint, a training run's checkpoints or anything else there
    (prepared data, a tokenizer, eval results, other files, a file)."""
    return check_output_target(
        storage,
        target,
        flag,
        "an export",
        "an earlier export",
        lambda entries, killed: is_earlier_export(entries, killed, remote=not storage.is_local),
    )


def main(args: argparse.Namespace) -> int:
    cfg = from_args(args, ExportConfig, "export", where="export settings")
    if not cfg.checkpoint:
        raise ValueError("--checkpoint: required: a checkpoint, its run (dir or name), or latest")
    lookup = open_storage(cfg.storage_path or CHECKPOINTS_ROOT)  # latest, a run name
    checkpoint = find_checkpoint(cfg.checkpoint, lookup, "--checkpoint")
    if not is_remote(checkpoint):  # a remote one is checked against its digests as it downloads
        verify(checkpoint, checksums=MODEL_FILES)  # the weights leave raychat: bytes flipped in place too
    if cfg.out:
        out_storage = open_storage(cfg.out, "--out")
        if not out_storage.is_local and "/" not in out_storage.path:
            raise ValueError(f"--out: {out_storage.uri} is a whole bucket; give {out_storage.uri}/<prefix>")
        check_export_target(out_storage, out_storage.path, "--out")
        check_writable(out_storage, "--out")
    else:
        storage, run_name, storage_flag = output_place(checkpoint, cfg.storage_path, cfg.run_name, "hf")
        check_export_target(storage, storage.writable_run_path(run_name), "--run-name")
        check_writable(storage, storage_flag)
    model, tokenizer, meta = load_model(checkpoint)

    def write(tmp: Path) -> None:
        export_hf(model, tokenizer, tmp)

    def upload(storage: Storage, path: str) -> str:
        tmp = staging_dir()
        try:
            return upload_dir(export_hf(model, tokenizer, tmp), storage, path, last="config.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):  # only when empty: no other export stages there now
                EXPORT_STAGING.rmdir()

    if cfg.out and out_storage.is_local:
        atomic_write_dir(os.path.realpath(out_storage.path), write)  # where a link there leads, as before
        out = cfg.out
    elif cfg.out:  # uploaded below its parent, as a run below its storage root
        parent = out_storage.path.rsplit("/", 1)[0]
        out = upload(replace(out_storage, uri=out_storage.uri_of(parent), path=parent), out_storage.path)
    elif storage.is_local:
        out = str(atomic_write_dir(storage.run_path(run_name), write))
    else:
        out = upload(storage, storage.run_path(run_name))
    print(f"exported {checkpoint} (step {meta.get('step', '?')}) -> {out}")
    print(load_hint(out))
    return 0


# An export to object storage is staged here (.export.<16 hex>) before its upload, beside the checkpoint cache
EXPORT_STAGING = DEFAULT_CACHE.parent / "exports"


def staging_dir() -> Path:
    """A fresh local directory under EXPORT_STAGING (created) for an export bound for object storage. The
    staging directories of killed exports there, those nothing has changed in for STAGING_IDLE_S, are deleted
    first (a younger one may be another export's, running now). The export deletes its own once uploaded,
    and EXPORT_STAGING too once empty. Raises OSError as os.mkdir."""
    while True:
        EXPORT_STAGING.mkdir(parents=True, exist_ok=True)
        remove_leftovers(EXPORT_STAGING, of="export", idle_s=STAGING_IDLE_S)
        try:
            return fresh_dir(EXPORT_STAGING / "export")
        except FileNotFoundError:  # another export deleted the empty EXPORT_STAGING meanwhile
            continue


def load_hint(out: str) -> str:
    """The line that says how to load the export at `out` (a local path, s3:// or gs:// URI) with transformers:
    a URI is downloaded first (raychat.storage.copy_command: transformers loads a local directory or a Hub repo
    id, not a URI) and loaded from ./<its last path segment>."""
    if not is_remote(out):
        return f"load with: transformers.AutoModelForCausalLM.from_pretrained({out!r})"
    scheme, name = out.split("://", 1)[0], out.rstrip("/").rsplit("/", 1)[-1]
    fetch = copy_command(out, ".")
    return (
        f"load with: {fetch}, then transformers.AutoModelForCausalLM.from_pretrained({'./' + name!r}) "
        f"(transformers does not read {scheme}://)"
    )
