"""Download pre-shuffled text shards from the Hugging Face hub (or any mirror with the same URL pattern).

Sources (parquet shards with a `text` column, named shard_{index:05d}.parquet; the last one is pinned as the
validation shard, as nanochat does):
  fineweb-edu  karpathy/fineweb-edu-100b-shuffle: shards 0..1822, ~94 MB each; FineWeb-Edu, ODC-By 1.0
  climbmix     karpathy/climbmix-400b-shuffle:    shards 0..6542;             NVIDIA ClimbMix, CC BY-NC 4.0

Each file is fetched into a hidden temporary file beside its destination, checked (complete body, readable
parquet, `text` column, every row group decodes), and only then renamed into place with os.replace, so a
shard under its final name is always complete. Failed attempts (connection errors, HTTP 429/5xx, truncated
or corrupt bodies) are retried with exponential backoff: attempt k waits backoff_s * 2**(k-1) seconds
before attempt k+1. HTTP 400/401/403/404/410 are not retried: asking again cannot help.

A shard already under its final name (a run stopped before its end downloaded it whole) is reused, not
fetched again, when it matches: the sha256 a previous manifest of the same URL pattern records for it, else
what the server says of the file (a HEAD request: server_facts): its sha256 where it gives one (the hub's
X-Linked-Etag), else its size. One line says how many were reused.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import requests

from raychat.atomic import fresh_file
from raychat.data.corpus.shards import DataError, TextColumnError, inspect_shard, sha256_file, shard_name
from raychat.log import log, plural

ATTEMPTS = 5
DOWNLOAD_WORKERS = 4  # shards downloaded at once (raychat.config.data: --workers' default)
BACKOFF_S = 1.0
TIMEOUT_S = 60.0
CHUNK_BYTES = 1 << 20
NOT_RETRIED = {400, 401, 403, 404, 410}


@dataclass(frozen=True)
class HubSource:
    name: str
    url_pattern: str  # str.format pattern with an `index` field
    val_index: int  # the last shard of the dataset, pinned as the validation shard
    license: str
    card: str  # where the dataset and its license are described


HF = "https://huggingface.co/datasets"
HUB_SOURCES = {
    "fineweb-edu": HubSource(
        "fineweb-edu",
        f"{HF}/karpathy/fineweb-edu-100b-shuffle/resolve/main/shard_{{index:05d}}.parquet",
        1822,
        "ODC-By-1.0",
        f"{HF}/HuggingFaceFW/fineweb-edu",
    ),
    "climbmix": HubSource(
        "climbmix",
        f"{HF}/karpathy/climbmix-400b-shuffle/resolve/main/shard_{{index:05d}}.parquet",
        6542,
        "CC-BY-NC-4.0",
        f"{HF}/nvidia/ClimbMix",
    ),
}


class DownloadError(RuntimeError):
    """A shard could not be downloaded (the message names the URL, the attempts and the last error)."""


class NotRetried(DownloadError):
    """The server refused the URL in a way that retrying cannot fix (HTTP 4xx other than 429), or sent a shard
    whose `text` column is not one string a document (shards.TextColumnError)."""


def shard_indices(num_train: int, val_index: int) -> list[int]:
    """[0, 1, ..., num_train-1, val_index]: the first num_train shards, then the pinned validation shard.

    Raises:
        ValueError: num_train < 1 or num_train > val_index (the train shards would reach the validation one).
    """
    if not 1 <= num_train <= val_index:
        raise ValueError(f"num_shards must be in [1, {val_index}] for this source, got {num_train}")
    return list(range(num_train)) + [val_index]


def fetch(url: str, tmp: str, timeout_s: float) -> int:
    """Stream url into tmp, decoded (a server may send it with a Content-Encoding such as gzip); returns the
    byte count written. Raises on HTTP errors and on a body shorter than its Content-Length (which counts the
    bytes as sent, before decoding)."""
    with requests.get(url, stream=True, timeout=timeout_s) as r:
        if r.status_code in NOT_RETRIED:
            raise NotRetried(f"{url}: HTTP {r.status_code} {r.reason} (not retried)")
        r.raise_for_status()
        size = 0
        with open(tmp, "wb") as f:
            for chunk in r.iter_content(CHUNK_BYTES):
                f.write(chunk)
                size += len(chunk)
        expected, received = (
            r.headers.get("Content-Length"),
            r.raw.tell(),
        )  # bytes on the wire, encoded or not
        if expected is not None and received != int(expected):
            raise OSError(f"truncated body: {received} of {expected} bytes")
    return size


def download_file(
    url: str,
    dest: str | Path,
    attempts: int = ATTEMPTS,
    backoff_s: float = BACKOFF_S,
    timeout_s: float = TIMEOUT_S,
    verify: Callable[[str], object] = inspect_shard,
    log: Callable[[str], None] = log,
) -> Path:
    """Download `url` to `dest` atomically, retrying failures; returns dest.

    Args:
        attempts: tries in all (>= 1); backoff_s: wait after the first failure, doubled after each further one.
        verify: called on the complete temporary file; raising DataError/OSError rejects it (and retries).
    Raises:
        DownloadError: every attempt failed, or the server answered 400/401/403/404/410 or sent a shard whose
            `text` is not strings or holds a null (NotRetried: no retry).
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    last: Exception | None = None
    for attempt in range(1, attempts + 1):
        tmp = str(fresh_file(dest))
        try:
            fetch(url, tmp, timeout_s)
            verify(tmp)
            os.replace(tmp, dest)
            return dest
        except NotRetried:
            raise
        except TextColumnError as e:  # the server's file itself: a retry fetches the same
            raise NotRetried(f"{url}: {e} (not retried)") from None
        except (requests.RequestException, OSError, DataError) as e:
            last = e
            if attempt < attempts:
                delay = backoff_s * 2 ** (attempt - 1)
                log(f"  {dest.name}: attempt {attempt}/{attempts} failed ({e}); retrying in {delay:.2f} s")
                time.sleep(delay)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise DownloadError(f"{url}: failed after {attempts} attempts; last error: {last}")


def check_url_pattern(url_pattern: str, flag: str = "--url-pattern") -> str:
    """`url_pattern` when it is an http(s) URL with an {index} field that str.format can fill (the downloader
    fetches pattern.format(index=i) with requests, which speaks http and https only).

    Raises ValueError naming `flag`: no {index} field that the index fills (none, or an escaped `{{index}}`:
    shards 0 and 1 would have one URL), a pattern str.format refuses with an int index (an unclosed brace, a
    field other than index, `{index[0]}`, `{index.name}`), or another scheme (file://, a local path)."""
    try:
        example, second = url_pattern.format(index=0), url_pattern.format(index=1)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(
            f"{flag}: {url_pattern!r} is not a str.format pattern with one {{index}} field "
            f"({type(e).__name__}: {e}), e.g. https://host/path/shard_{{index:05d}}.parquet"
        ) from None
    if example == second:
        raise ValueError(
            f"{flag} must contain an {{index}} field, e.g. .../shard_{{index:05d}}.parquet: {url_pattern} "
            f"gives every shard the one URL {example}"
        )
    if requests.utils.urlparse(example).scheme not in ("http", "https"):
        raise ValueError(f"{flag}: {url_pattern!r} is not an http(s) URL (shards are downloaded with HTTP)")
    return url_pattern


REUSED = ("manifest", "sha256", "size")  # reusable's answers that reuse a present shard


def server_facts(response: requests.Response) -> tuple[int | None, str | None]:
    """(size in bytes, sha256) that a HEAD response, redirects followed, gives of the file; None each where it
    does not. The hub's redirect to its CDN carries both (X-Linked-Size; X-Linked-Etag: the sha256 in quotes
    of a file stored with Git LFS or Xet), and the CDN's URL may refuse a HEAD (signed for GET); another
    server gives the size as the Content-Length of a 2xx answer."""
    size = sha256 = None
    for r in [*response.history, response]:
        tag = r.headers.get("X-Linked-Etag", "").removeprefix("W/").strip('"').lower()
        sha256 = tag if re.fullmatch(r"[0-9a-f]{64}", tag) else sha256
        linked = r.headers.get("X-Linked-Size", "")
        size = int(linked) if linked.isdigit() else size
    length = response.headers.get("Content-Length", "")
    if size is None and response.ok and length.isdigit():
        size = int(length)
    return size, sha256


def reusable(url: str, dest: Path, known_sha256: dict[str, str], timeout_s: float = TIMEOUT_S) -> str | None:
    """How the file `dest`, already under its final name, was found to be `url`'s ("manifest": the sha256
    `known_sha256` records for it; "sha256": the server's sha256; "size": the server's size: server_facts);
    None where it differs; "unchecked" where the server said neither (a HEAD request that failed or was
    refused) and a previous manifest of this pattern does not list it. Only REUSED answers reuse the file."""
    if dest.name in known_sha256:
        return "manifest" if sha256_file(dest) == known_sha256[dest.name] else None
    try:
        with requests.head(url, allow_redirects=True, timeout=timeout_s) as r:
            size, sha256 = server_facts(r)
    except requests.RequestException:
        return "unchecked"
    if sha256 is not None:
        return "sha256" if sha256_file(dest) == sha256 else None
    if size is not None:
        return "size" if dest.stat().st_size == size else None
    return "unchecked"


def reused_line(checks: dict[int, str | None], total: int, out: Path) -> str:
    """The one line of the shards found in `out` before downloading: `checks` (index -> reusable's answer)
    of each present one, of `total` shards, e.g. "reusing 2 of 3 shards already in runs/data (1 by the
    previous manifest's sha256, 1 by the server's size); 1 other present differs and is downloaded again"; the
    shards the server said nothing of are said apart ("could not be checked")."""
    ways = {
        "manifest": "the previous manifest's sha256",
        "sha256": "the server's sha256",
        "size": "the server's size",
    }
    counts = {way: n for way in ways if (n := sum(c == way for c in checks.values()))}
    reused = sum(counts.values())
    line = f"reusing {reused:,} of {plural(total, 'shard')} already in {out}"
    if counts:
        line += " (" + ", ".join(f"{n:,} by {ways[way]}" for way, n in counts.items()) + ")"
    if stale := sum(c is None for c in checks.values()):
        line += f"; {stale:,} other present {'differs and is' if stale == 1 else 'differ and are'} downloaded again"
    if unchecked := sum(c == "unchecked" for c in checks.values()):
        line += (
            f"; {unchecked:,} other present could not be checked (the server gave neither "
            f"{'its size nor its sha256) and is' if unchecked == 1 else 'their sizes nor sha256s) and are'} "
            "downloaded again"
        )
    return line


def download_shards(
    url_pattern: str,
    indices: list[int],
    out_dir: str | Path,
    workers: int = DOWNLOAD_WORKERS,
    attempts: int = ATTEMPTS,
    backoff_s: float = BACKOFF_S,
    timeout_s: float = TIMEOUT_S,
    known_sha256: dict[str, str] | None = None,
    log: Callable[[str], None] = log,
) -> list[Path]:
    """Download shard_{index:05d}.parquet for every index, `workers` at a time; returns their paths in order.

    Args:
        url_pattern: e.g. HUB_SOURCES["fineweb-edu"].url_pattern; `{index}` is filled with each index.
        known_sha256: file name -> sha256 of shards already downloaded from this same pattern (from a
            previous manifest). A file present under its final name is reused, not fetched again, where it
            matches that sha256, or, where none is known, what the server says of it (reusable); the
            log's one line says how many (reused_line).
    Raises:
        ValueError: url_pattern is not an http(s) pattern with an {index} field (check_url_pattern), or
            workers < 1.
        DownloadError: one or more shards failed (all failures are listed; the other shards are kept).
    """
    check_url_pattern(url_pattern, "url_pattern")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    known = known_sha256 or {}
    present = [i for i in indices if (out / shard_name(i)).is_file()]

    def check(i: int) -> str | None:
        return reusable(url_pattern.format(index=i), out / shard_name(i), known, timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(present)))) as pool:
        checks = dict(zip(present, pool.map(check, present)))
    if present:
        log(reused_line(checks, len(indices), out))
    todo = [i for i in indices if checks.get(i) not in REUSED]
    errors = []
    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo))))
    try:
        futures = {
            pool.submit(
                download_file,
                url_pattern.format(index=i),
                out / shard_name(i),
                attempts,
                backoff_s,
                timeout_s,
                log=log,
            ): i
            for i in todo
        }
        for done, future in enumerate(as_completed(futures), start=1):
            try:
                path = future.result()
                log(f"  downloaded {path.name} ({path.stat().st_size / 1e6:.1f} MB) [{done}/{len(todo)}]")
            except DownloadError as e:
                errors.append(str(e))
    finally:  # Ctrl-C: the shards not started are not fetched; those under way end whole (or not at all)
        pool.shutdown(cancel_futures=True)
    if errors:
        raise DownloadError(
            f"{len(errors)} of {len(indices)} shards failed:\n  " + "\n  ".join(sorted(errors))
        )
    return [out / shard_name(i) for i in indices]
