"""The Ray auth token (token authentication, on by default in the Ray this project pins): where raychat finds it,
and how Ray's own clients in this process get it.

Found, first wins, in `--token-file`, RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, then
~/.ray/auth_token (Ray's own order, docs.ray.io "Ray token authentication"); find_token also says where it came
from, for the messages (refused_message).

Two kinds of client take it: the dashboard's REST API (the Jobs SDK given an http:// address) as an
`Authorization: Bearer` header the caller sends; and every client of the GCS (gRPC: `ray.init(address=HOST:6379)`,
a JobSubmissionClient given a GCS address, which asks the GCS for the dashboard's URL), which reads it from Ray's
own loader and sends it only in token mode. Ray reads RAY_AUTH_MODE once, when its core loads, and never turns
token mode on by itself for an explicit address (ray._private.worker.init), so a token found here reached no GCS:
hand_to_ray puts it where Ray looks.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode

AUTH_MODE_ENV = "RAY_AUTH_MODE"  # ray._private.authentication.authentication_token_setup.AUTH_MODE_ENV_VAR


def find_token(token_file: str | None = None) -> tuple[str | None, str]:
    """(the Ray auth token or None, where it came from: "--token-file <path>", "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH <path>", "<home>/.ray/auth_token" or "no token"). Order: token_file,
    $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token.

    Raises FileNotFoundError / ValueError when an explicitly named file is missing, not a regular file or
    empty."""
    if token_file:
        return _read_token(Path(token_file), "--token-file"), f"--token-file {token_file}"
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = os.environ["RAY_AUTH_TOKEN_PATH"]
        return _read_token(Path(path), "RAY_AUTH_TOKEN_PATH"), f"RAY_AUTH_TOKEN_PATH {path}"
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file():
        return _read_token(default, str(default)), str(default)
    return None, "no token"


def load_token(token_file: str | None = None) -> str | None:
    """The Ray auth token, or None (see find_token)."""
    return find_token(token_file)[0]


def hand_to_ray(token_file: str | None = None) -> tuple[str | None, str]:
    """Find the token (find_token) and make Ray's GCS clients in this process send it: token mode
    (RAY_AUTH_MODE=token, for this process and the ones it starts) and, from `token_file`, RAY_AUTH_TOKEN (the
    first place Ray's loader looks). Nothing changes when no token is found, nor when RAY_AUTH_MODE is set and
    no token_file is given (a mode set on purpose, e.g. `disabled`, wins over a token found by default).
    Returns find_token's pair.

    Raises FileNotFoundError / ValueError as find_token."""
    token, source = find_token(token_file)
    if token is None or (os.environ.get(AUTH_MODE_ENV) and not token_file):
        return token, source
    if token_file:
        os.environ["RAY_AUTH_TOKEN"] = token
    os.environ[AUTH_MODE_ENV] = "token"
    AuthenticationTokenLoader.instance().reset_cache()
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        Config.initialize("")  # Ray's config holds the mode read when its core loaded: read it again
    return token, source


def check_gcs_address(address: str | None) -> None:
    """Refuse an --address that is a dashboard URL (http:// or https://: what `raychat submit` and `raychat jobs`
    take) for a command that connects to the cluster's GCS (ray.init), where Ray's own error blames RAY_ADDRESS,
    over three lines. Raises ValueError naming --address."""
    if address and address.partition("://")[0].lower() in ("http", "https"):
        raise ValueError(
            f"--address {address} is a Ray dashboard URL (what `raychat submit` and `raychat jobs` take); this "
            "command connects to the cluster's GCS: give HOST:PORT, e.g. 127.0.0.1:6379 (what `ray start "
            "--address` takes)"
        )


@contextlib.contextmanager
def token_for(address: str | None, token_file: str | None = None):
    """Within: this process's Ray GCS clients send the token (hand_to_ray(token_file)), for a `ray.init` of
    `address` (None: RAY_ADDRESS, else a new local cluster). A ConnectionError raised within because the
    cluster refused the token (token_refusal) becomes one ConnectionError of refused_message's line.

    Raises FileNotFoundError / ValueError as find_token, on entering."""
    _, source = hand_to_ray(token_file)
    try:
        yield
    except ConnectionError as e:
        if (reason := token_refusal(e)) is None:
            raise
        where = address or os.environ.get("RAY_ADDRESS", "")
        raise ConnectionError(refused_message(where, source, reason)) from e


def refused_message(address: str, source: str, reason: str) -> str:
    """One line for a cluster at `address` that refused the token from `source` (see find_token), or the lack
    of one, for `reason` (Ray's line)."""
    if source == "no token":
        return (
            f"--token-file: the Ray cluster at {address} requires a token and none was found (--token-file, "
            f"RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token): {reason}"
        )
    flag, _, where = source.partition(" ")
    return f"{flag}: the Ray cluster at {address} refused the token {f'in {where}' if where else 'given'} ({reason})"


def token_refusal(error: BaseException) -> str | None:
    """Ray's line saying that a GCS refused the token, found in `error` or what it came from (ray.init puts its
    GCS client's AuthenticationError into the text of a RuntimeError, which a ConnectionError wraps); None when
    the error is about something else."""
    seen: BaseException | None = error
    while seen is not None:
        for line in str(seen).splitlines():
            if "InvalidAuthToken" in line:
                return line.split(". ")[0].strip()
        seen = seen.__cause__ or seen.__context__
    return None


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _read_token(path: Path, source: str) -> str:
    if not path.exists():
        raise FileNotFoundError(f"{source}: token file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{source}: token file {path} is not a regular file")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"{source}: token file {path} is empty")
    return token
