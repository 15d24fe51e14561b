"""A real S3-compatible server for tests: moto's server mode on loopback, one per test session.

``s3_server`` starts ``python -m moto.server`` on a free loopback port; ``s3_bucket`` points the AWS
variables (endpoint, test credentials) at it and creates a fresh bucket per test, returning its URL.
Child processes started by a test inherit the variables, so they reach the same server.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from clawpipe.net import free_port


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=1.0)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {url} (exit code {proc.poll()})") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<fresh bucket>`` on the session's server, with the AWS variables set for this process and its children."""
    pytest.importorskip("s3fs", reason="s3fs is in the s3 and dev extras")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import boto3

    name = f"b{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"
