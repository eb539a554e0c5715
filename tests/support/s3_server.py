"""A real S3-compatible server on loopback for tests: moto's `moto_server` (moto[s3] 5.x + flask).

moto pins python-dateutil < 3 through botocore while kubernetes 37 needs >= 3, so the server lives in a venv
of its own (`make s3-server` builds .venv/s3 from constraints-s3.txt); the tests talk to it over HTTP only,
through pyarrow.fs, as a cluster talks to S3. `$MOTO_SERVER` points at another moto_server binary.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raychat.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
MOTO_SERVER = Path(os.environ.get("MOTO_SERVER") or REPO / ".venv" / "s3" / "bin" / "moto_server")
# What a cluster node has in place of an IAM role: any key works with moto. No EC2 metadata look-ups.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class S3Server:
    proc: subprocess.Popen
    endpoint: str  # http://127.0.0.1:<port>

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client (pyarrow, boto3, the AWS CLI) at this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def filesystem(self, **options) -> pafs.S3FileSystem:
        """A pyarrow S3FileSystem for this server with explicit options (S3FileSystem() itself does not read
        AWS_ENDPOINT_URL; only FileSystem.from_uri does)."""
        return pafs.S3FileSystem(
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_DEFAULT_REGION"],
            endpoint_override=self.endpoint,
            scheme="http",
            **options,
        )

    def make_bucket(self, prefix: str = "raychat") -> str:
        """Create a new bucket with a unique name; returns the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.filesystem(allow_bucket_creation=True).create_dir(name)
        return name

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def start_s3_server(log: Path, timeout_s: float = 60) -> S3Server:
    """Start moto_server on a free loopback port; returns once it answers HTTP."""
    if not MOTO_SERVER.is_file():
        raise FileNotFoundError(f"{MOTO_SERVER} is missing: run `make s3-server` (or set MOTO_SERVER)")
    (port,) = free_ports(1)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    server = S3Server(proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(server.endpoint + "/", timeout=2)
            return server
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"moto_server did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.3)
