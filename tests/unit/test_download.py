"""Hub shard downloads against a loopback HTTP server that fails on purpose (no network beyond 127.0.0.1)."""

from __future__ import annotations

import http.server
import io
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
    close), "404"; once the list is empty the file is served normally. While answering a request, it records
    whether the download's final file already exists (`final_seen`), which must never be True."""

    def __init__(self, files: dict[str, bytes], watch_dir: Path | None = None):
        self.files, self.plan, self.requests, self.final_seen = files, {}, [], []
        self.watch_dir = watch_dir
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(self.path)
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
