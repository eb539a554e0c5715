"""Hub shard downloads against a loopback HTTP server that fails on purpose (no network beyond 127.0.0.1)."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import re
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raychat.cli import main
from raychat.data.corpus import download
from raychat.data.corpus.download import (
    DownloadError,
    NotRetried,
    download_file,
    download_shards,
    shard_indices,
)
from raychat.data.corpus.prepare import prepare
from raychat.data.corpus.shards import list_shards, sha256_file


def parquet_bytes(texts: list[str], **columns) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts, **columns}), buf, compression="zstd", row_group_size=2)
    return buf.getvalue()


class Server:
    """Serves `files` (URL path -> bytes). `plan[path]` is a list of behaviours for the next requests of that
    path, used up one per request: "500" (HTTP 500), "truncate" (full Content-Length, half the body, then
    close), "404", "gzip" (the body gzip-compressed, with Content-Encoding: gzip); once the list is empty the file is served normally. While answering a request, it records
    whether the download's final file already exists (`final_seen`), which must never be True. HEAD requests
    (`heads`) answer a file's size as its Content-Length (`head` "size"), with its sha256 as the hub gives it
    ("sha256": X-Linked-Etag), or as the hub does ("hub": a redirect with X-Linked-Size and X-Linked-Etag to a
    CDN URL that refuses a HEAD, 403), or refuses it ("refused": 405); `delay_s[path]` delays each GET."""

    def __init__(self, files: dict[str, bytes], watch_dir: Path | None = None, head: str = "size"):
        self.files, self.plan, self.requests, self.final_seen = files, {}, [], []
        self.watch_dir, self.heads, self.delay_s = watch_dir, [], {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server.heads.append(self.path)
                if self.path.startswith("/cdn/"):  # the hub's CDN URLs are signed for GET
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = server.files.get(self.path)
                self.send_response(
                    404 if body is None else 302 if head == "hub" else 405 if head == "refused" else 200
                )
                if body is not None and head == "hub":
                    self.send_header("Location", "/cdn" + self.path)
                    self.send_header("X-Linked-Size", str(len(body)))
                self.send_header("Content-Length", str(len(body or b"")))
                if body is not None and head in ("sha256", "hub"):
                    self.send_header("X-Linked-Etag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.end_headers()

            def do_GET(self):
                server.requests.append(self.path)
                threading.Event().wait(server.delay_s.get(self.path, 0))  # no_sleep patches time.sleep
                if server.watch_dir is not None:
                    server.final_seen.append((server.watch_dir / Path(self.path).name).exists())
                steps = server.plan.get(self.path) or []
                step = steps.pop(0) if steps else "ok"
                body = server.files.get(self.path)
                if step in ("500", "404") or body is None:
                    code = 404 if body is None else int(step)
                    self.send_response(code)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                if step == "gzip":
                    body = gzip.compress(body)
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2] if step == "truncate" else body)
                if step == "truncate":
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def no_sleep(monkeypatch):
    """Record the backoff delays instead of sleeping them."""
    delays = []
    monkeypatch.setattr(download.time, "sleep", delays.append)
    return delays


def visible_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_shard_indices_add_the_pinned_validation_shard():
    assert shard_indices(3, 1822) == [0, 1, 2, 1822]
    assert shard_indices(1, 6542) == [0, 6542]
    with pytest.raises(ValueError, match=r"num_shards must be in \[1, 1822\]"):
        shard_indices(0, 1822)
    with pytest.raises(ValueError, match="1822"):
        shard_indices(1823, 1822)


def test_hub_url_patterns():
    assert download.HUB_SOURCES["fineweb-edu"].url_pattern.format(index=7) == (
        "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main/shard_00007.parquet"
    )
    assert download.HUB_SOURCES["climbmix"].url_pattern.format(index=6542) == (
        "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main/shard_06542.parquet"
    )


def test_two_500s_then_ok_retries_with_exponential_backoff(tmp_path, no_sleep):
    body = parquet_bytes(["a", "b", "c"])
    with Server({"/s.parquet": body}, watch_dir=tmp_path) as srv:
        srv.plan["/s.parquet"] = ["500", "500"]
        path = download_file(
            f"{srv.url}/s.parquet", tmp_path / "s.parquet", backoff_s=0.5, log=lambda m: None
        )
    assert path.read_bytes() == body
    assert srv.requests == ["/s.parquet"] * 3
    assert no_sleep == [0.5, 1.0]  # backoff_s * 2**(attempt-1) after attempts 1 and 2
    assert srv.final_seen == [False, False, False]  # never visible while a download was in flight
    assert visible_files(tmp_path) == ["s.parquet"]  # no temporary file left behind


def test_truncated_body_is_retried(tmp_path, no_sleep):
    body = parquet_bytes([f"doc {i}" for i in range(50)])
    with Server({"/s.parquet": body}, watch_dir=tmp_path) as srv:
        srv.plan["/s.parquet"] = ["truncate"]
        download_file(f"{srv.url}/s.parquet", tmp_path / "s.parquet", log=lambda m: None)
    assert (tmp_path / "s.parquet").read_bytes() == body
    assert len(srv.requests) == 2 and no_sleep == [1.0]
    assert srv.final_seen == [False, False]


def test_permanent_failure_raises_after_five_attempts_and_leaves_nothing(tmp_path, no_sleep):
    with Server({"/s.parquet": b"x"}) as srv:
        srv.plan["/s.parquet"] = ["500"] * 10
        with pytest.raises(
            DownloadError, match=r"/s\.parquet: failed after 5 attempts; last error: 500 Server Error"
        ):
            download_file(f"{srv.url}/s.parquet", tmp_path / "s.parquet", log=lambda m: None)
    assert len(srv.requests) == 5
    assert no_sleep == [1.0, 2.0, 4.0, 8.0]
    assert visible_files(tmp_path) == []


def test_404_is_not_retried(tmp_path, no_sleep):
    with Server({}) as srv:
        with pytest.raises(NotRetried, match="HTTP 404"):
            download_file(f"{srv.url}/missing.parquet", tmp_path / "m.parquet", log=lambda m: None)
    assert len(srv.requests) == 1 and no_sleep == []
    assert visible_files(tmp_path) == []


@pytest.mark.parametrize(
    "body, error",
    [
        (b"PAR1 this is not parquet", "not a readable parquet file"),
        (
            parquet_bytes(["a"], id=[1]).replace(b"text", b"txet"),
            r"no `text` column \(columns: \['txet', 'id'\]\)",
        ),
    ],
)
def test_a_corrupt_or_wrong_body_is_rejected_before_the_rename(tmp_path, no_sleep, body, error):
    with Server({"/s.parquet": body}) as srv:
        with pytest.raises(DownloadError, match=error):
            download_file(f"{srv.url}/s.parquet", tmp_path / "s.parquet", attempts=2, log=lambda m: None)
    assert len(srv.requests) == 2
    assert visible_files(tmp_path) == []


def test_a_gzip_encoded_body_is_saved_decoded(tmp_path, no_sleep):
    body = parquet_bytes([f"doc {i}" for i in range(50)])
    with Server({"/s.parquet": body}) as srv:
        srv.plan["/s.parquet"] = ["gzip"]
        download_file(f"{srv.url}/s.parquet", tmp_path / "s.parquet", attempts=1, log=lambda m: None)
    assert len(gzip.compress(body)) != len(body)  # the Content-Length counts the encoded bytes
    assert (tmp_path / "s.parquet").read_bytes() == body


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=2)
    return buf.getvalue()


@pytest.mark.parametrize(
    "table, error",
    [
        (pa.table({"text": [1, 2, 3]}), "the `text` column holds int64, not strings"),
        (pa.table({"text": [{"a": "x"}]}), "the `text` column holds struct<a: string>, not strings"),
        (pa.table({"text": ["a", "b", "c", None]}), "row 3: `text` is null"),
    ],
)
def test_a_hub_shard_of_other_types_or_with_a_null_fails_prepare_naming_it(table, error, tmp_path, no_sleep):
    files = {"/shard_00000.parquet": table_bytes(table), "/shard_01822.parquet": parquet_bytes(["v"])}
    out = tmp_path / "data"
    with Server(files) as srv:
        with pytest.raises(
            DownloadError, match=r"shard_00000\.parquet: .*" + re.escape(error) + ".* \\(not retried\\)"
        ):
            prepare("fineweb-edu", out, num_shards=1, url_pattern=f"{srv.url}/shard_{{index:05d}}.parquet",
                    attempts=3, log=lambda m: None)  # fmt: skip
    assert srv.requests.count("/shard_00000.parquet") == 1  # the same bytes again would be refused again
    assert not (out / "manifest.json").exists() and not (out / "shard_00000.parquet").exists()


def test_download_shards_in_parallel_and_reuse_by_sha256(tmp_path, no_sleep):
    files = {
        f"/shard_{i:05d}.parquet": parquet_bytes([f"shard {i} doc {j}" for j in range(3)])
        for i in (0, 1, 2, 9)
    }
    pattern = "{url}/shard_{{index:05d}}.parquet"
    with Server(files, watch_dir=tmp_path) as srv:
        srv.plan["/shard_00001.parquet"] = ["500", "truncate"]
        paths = download_shards(
            pattern.format(url=srv.url), [0, 1, 2, 9], tmp_path, workers=3, log=lambda m: None
        )
        assert [p.name for p in paths] == [
            "shard_00000.parquet",
            "shard_00001.parquet",
            "shard_00002.parquet",
            "shard_00009.parquet",
        ]
        assert all(p.read_bytes() == files["/" + p.name] for p in paths)
        assert sorted(srv.requests) == sorted(list(files) + ["/shard_00001.parquet"] * 2)
        assert not any(srv.final_seen)

        known = {p.name: sha256_file(p) for p in paths}
        known["shard_00002.parquet"] = "0" * 64  # a stale hash: that shard is fetched again
        srv.requests.clear()
        download_shards(
            pattern.format(url=srv.url), [0, 1, 2, 9], tmp_path, known_sha256=known, log=lambda m: None
        )
        assert srv.requests == ["/shard_00002.parquet"]


def test_download_shards_lists_every_failure(tmp_path, no_sleep):
    with Server({"/shard_00000.parquet": parquet_bytes(["ok"])}) as srv:
        with pytest.raises(DownloadError, match=r"1 of 2 shards failed:\n  .*shard_00005\.parquet: HTTP 404"):
            download_shards(f"{srv.url}/shard_{{index:05d}}.parquet", [0, 5], tmp_path, log=lambda m: None)
    assert visible_files(tmp_path) == ["shard_00000.parquet"]
    with pytest.raises(ValueError, match=r"must contain an \{index\} field"):
        download_shards("http://127.0.0.1/shard.parquet", [0], tmp_path)


@pytest.mark.parametrize(
    "pattern, why",
    [
        ("http://m/shard_{index:05d", "is not a str.format pattern with one {index} field (ValueError: "),
        (
            "http://m/{split}/shard_{index}.parquet",
            "is not a str.format pattern with one {index} field (KeyError: ",
        ),
        ("http://m/shard.parquet", "must contain an {index} field"),
        (
            "file:///mnt/mirror/shard_{index:05d}.parquet",
            "is not an http(s) URL (shards are downloaded with HTTP)",
        ),
        ("/mnt/mirror/shard_{index:05d}.parquet", "is not an http(s) URL"),
    ],
)
def test_a_url_pattern_the_downloader_cannot_use_is_refused_before_downloading(
    pattern, why, tmp_path, capsys
):
    """An unclosed brace read "unmatched '{' in format spec" without the flag; file:// and local paths were
    tried 5 times each (requests speaks http(s) only); both after "downloading ..." was printed."""
    with pytest.raises(ValueError) as e:
        download.check_url_pattern(pattern)
    assert str(e.value).startswith("--url-pattern") and why in str(e.value)
    argv = [
        "data",
        "prepare",
        "--source",
        "fineweb-edu",
        "--url-pattern",
        pattern,
        "--out",
        str(tmp_path / "d"),
    ]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "error: --url-pattern" in out.err and why in out.err and "downloading" not in out.out + out.err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "pattern, why",
    [
        (
            "http://m/shard_{index[0]}.parquet",
            "--url-pattern: 'http://m/shard_{index[0]}.parquet' is not a str.format pattern with one {index} field "
            "(TypeError: 'int' object is not subscriptable), e.g. https://host/path/shard_{index:05d}.parquet",
        ),
        (
            "http://m/shard_{index.name}.parquet",
            "--url-pattern: 'http://m/shard_{index.name}.parquet' is not a str.format pattern with one {index} "
            "field (AttributeError: 'int' object has no attribute 'name'), e.g. "
            "https://host/path/shard_{index:05d}.parquet",
        ),
        (
            "http://m/shard_{{index}}.parquet",
            "--url-pattern must contain an {index} field, e.g. .../shard_{index:05d}.parquet: "
            "http://m/shard_{{index}}.parquet gives every shard the one URL http://m/shard_{index}.parquet",
        ),
    ],
)
def test_a_url_pattern_whose_index_field_the_index_does_not_fill_is_refused(pattern, why):
    """`{index[0]}` raised an uncaught TypeError; an escaped `{{index}}` was accepted, and every shard was then
    fetched from the one URL."""
    with pytest.raises(ValueError) as e:
        download.check_url_pattern(pattern)
    assert str(e.value) == why


@pytest.mark.parametrize(
    "flag, value", [("--rows-per-shard", "7"), ("--seed", "5"), ("--row-group-size", "7")]
)
def test_an_option_of_local_sources_is_refused_with_a_hub_source(flag, value, tmp_path, capsys, no_sleep):
    """--seed and --row-group-size were silently ignored with a hub source (its shards are kept byte for byte),
    where --rows-per-shard was refused."""
    # nothing listens there: a run that is not refused fails to download (exit 4)
    pattern = "http://127.0.0.1:9/shard_{index:05d}.parquet"
    argv = ["data", "prepare", "--source", "fineweb-edu", "--url-pattern", pattern, flag, value]
    assert main([*argv, "--out", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err == (
        f"raychat data prepare: error: {flag} applies to local sources only: hub shards are kept as downloaded\n"
    )
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("source", ["folder", "debian-docs"])
def test_workers_with_a_local_source_is_refused(source, tmp_path, capsys):
    """--workers (parallel downloads) was silently ignored for a local source, which is read in this process."""
    if source == "folder":
        (tmp_path / "texts").mkdir()
        (tmp_path / "texts" / "a.txt").write_text("a document\n")
        source = str(tmp_path / "texts")
    argv = ["data", "prepare", "--source", source, "--workers", "8", "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"raychat data prepare: error: --workers applies to hub sources only (fineweb-edu, climbmix), not to "
        f"--source {source}\n"
    )
    assert not (tmp_path / "d").exists()


def test_prepare_hub_source_from_a_mirror(tmp_path, no_sleep):
    texts = {i: [f"shard {i} doc {j}" for j in range(i + 2)] for i in (0, 1, 1822)}
    files = {f"/shard_{i:05d}.parquet": parquet_bytes(t) for i, t in texts.items()}
    out = tmp_path / "data"
    with Server(files) as srv:
        srv.plan["/shard_01822.parquet"] = ["500"]
        pattern = f"{srv.url}/shard_{{index:05d}}.parquet"
        manifest = prepare("fineweb-edu", out, num_shards=2, url_pattern=pattern, log=lambda m: None)
    assert manifest["source"] == "fineweb-edu" and manifest["license"] == "ODC-By-1.0"
    assert manifest["documents"] == 2 + 3 + 1824
    assert manifest["bytes"] == sum(len(t.encode()) for ts in texts.values() for t in ts)
    assert [(s["file"], s["split"], s["documents"]) for s in manifest["shards"]] == [
        ("shard_00000.parquet", "train", 2),
        ("shard_00001.parquet", "train", 3),
        ("shard_01822.parquet", "val", 1824),
    ]
    train, val = list_shards(out, verify=True)
    assert [Path(f).name for f in train] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert Path(val).name == "shard_01822.parquet"
    assert all(Path(f).read_bytes() == files["/" + Path(f).name] for f in train + [val])  # kept byte for byte


@pytest.mark.parametrize("head", ["size", "sha256", "hub"])
def test_shards_present_before_a_download_are_reused_when_the_server_says_they_match(
    head, tmp_path, no_sleep
):
    """Without a manifest (a run stopped before writing it) every shard was downloaded again. A present shard is
    now checked with a HEAD request: by its size, or by its sha256 where the server gives one. shard 0 is
    whole; shard 1 holds its first half (what a partial download would be; prepare's are under a temporary
    name: never reused); with a checksum, shard 2 has its size but one byte changed, which its size alone
    cannot tell. The hub gives both in its redirect to a CDN URL that refuses the HEAD."""
    files = {
        f"/shard_{i:05d}.parquet": parquet_bytes([f"shard {i} doc {j}" for j in range(5)]) for i in (0, 1, 2)
    }
    (tmp_path / "shard_00000.parquet").write_bytes(files["/shard_00000.parquet"])
    (tmp_path / "shard_00001.parquet").write_bytes(files["/shard_00001.parquet"][:100])
    changed = bytearray(files["/shard_00002.parquet"])
    changed[50] ^= 1
    if head != "size":
        (tmp_path / "shard_00002.parquet").write_bytes(bytes(changed))
    lines = []
    with Server(files, head=head) as srv:
        paths = download_shards(
            f"{srv.url}/shard_{{index:05d}}.parquet", [0, 1, 2], tmp_path, log=lines.append
        )
    assert all(p.read_bytes() == files["/" + p.name] for p in paths)
    assert sorted(srv.requests) == ["/shard_00001.parquet", "/shard_00002.parquet"]
    if head != "size":
        cdn = ["/cdn" + f for f in files] if head == "hub" else []  # where the hub redirects (a 403)
        assert sorted(srv.heads) == sorted([*files, *cdn])
        assert lines[0] == (
            f"reusing 1 of 3 shards already in {tmp_path} (1 by the server's sha256); 2 other present differ and "
            "are downloaded again"
        )
    else:
        assert sorted(srv.heads) == ["/shard_00000.parquet", "/shard_00001.parquet"]
        assert lines[0] == (
            f"reusing 1 of 3 shards already in {tmp_path} (1 by the server's size); 1 other present differs and is "
            "downloaded again"
        )


def test_a_present_shard_the_server_says_nothing_of_is_not_said_to_differ(tmp_path, no_sleep):
    """A server that refuses HEAD (405) gives neither size nor sha256: the present shard, whole, is downloaded
    again, and the line said it "differs"; it says it could not be checked."""
    files = {
        f"/shard_{i:05d}.parquet": parquet_bytes([f"shard {i} doc {j}" for j in range(5)]) for i in (0, 1)
    }
    (tmp_path / "shard_00000.parquet").write_bytes(files["/shard_00000.parquet"])
    lines = []
    with Server(files, head="refused") as srv:
        download_shards(f"{srv.url}/shard_{{index:05d}}.parquet", [0, 1], tmp_path, log=lines.append)
    assert sorted(srv.requests) == ["/shard_00000.parquet", "/shard_00001.parquet"]
    assert lines[0] == (
        f"reusing 0 of 2 shards already in {tmp_path}; 1 other present could not be checked (the server gave "
        "neither its size nor its sha256) and is downloaded again"
    )


def test_a_prepare_stopped_while_downloading_reuses_the_shards_it_finished(tmp_path, no_sleep):
    """Ctrl-C once shard 0 is downloaded, shard 1 under way (a slow one): shard 1 ends whole, the validation
    shard is not started; the same command again downloads only the validation shard."""
    files = {
        f"/shard_{i:05d}.parquet": parquet_bytes([f"shard {i} doc {j}" for j in range(3)])
        for i in (0, 1, 1822)
    }
    out = tmp_path / "data"

    def interrupt(message: str) -> None:
        if "downloaded shard_00000" in message:
            raise KeyboardInterrupt

    with Server(files) as srv:
        pattern = f"{srv.url}/shard_{{index:05d}}.parquet"
        srv.delay_s["/shard_00001.parquet"] = 1.0  # under way when Ctrl-C comes
        with pytest.raises(KeyboardInterrupt) as e:
            prepare("fineweb-edu", out, num_shards=2, url_pattern=pattern, workers=1, log=interrupt)
        assert str(e.value) == (
            f"{out} holds no finished data now (no manifest.json); run the same command again, which downloads "
            "only the shards not yet downloaded whole"
        )
        assert visible_files(out) == ["shard_00000.parquet", "shard_00001.parquet"]
        assert srv.requests == ["/shard_00000.parquet", "/shard_00001.parquet"]
        srv.requests.clear()
        lines = []
        manifest = prepare("fineweb-edu", out, num_shards=2, url_pattern=pattern, log=lines.append)
    assert f"reusing 2 of 3 shards already in {out} (2 by the server's size)" in lines
    assert srv.requests == ["/shard_01822.parquet"]
    assert [s["documents"] for s in manifest["shards"]] == [3, 3, 3]
    train, val = list_shards(out, verify=True)
    assert all(Path(f).read_bytes() == files["/" + Path(f).name] for f in train + [val])
