"""S3-compatible stores that behave unlike the one the lake was built on, through a forwarder in front of the
real test server (tests/support/s3_faults.py): a store that ignores ``If-None-Match`` (so two writers could both
commit) is refused before anything is committed, with a message saying why; a store shedding load with ``503
SlowDown`` still gets every call landed exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clawpipe import objstore
from clawpipe.errors import LakeError
from clawpipe.lake import land, run_sql
from clawpipe.proxy.upload import Uploader
from clawpipe.tables import LakeFS
from tests.objstore.captures import write_captures
from tests.support.s3_faults import FaultyS3

pytestmark = pytest.mark.slow


@contextmanager
def _faulty(s3_server: str, monkeypatch: pytest.MonkeyPatch, **kw: tuple[str, ...]) -> Iterator[FaultyS3]:
    """The forwarder as this process's S3 endpoint, then the real server again. s3fs keeps one filesystem
    per configuration in the process, so its cache is cleared on both sides."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    with FaultyS3(s3_server, **kw) as store:
        monkeypatch.setenv("AWS_ENDPOINT_URL", store.url)
        try:
            yield store
        finally:
            monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
            s3fs.S3FileSystem.clear_instance_cache()


def test_a_store_that_ignores_if_none_match_is_refused_before_a_commit(
    s3_bucket: str, s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap, _n = write_captures(tmp_path, 2, 5)
    with _faulty(s3_server, monkeypatch, drop=("if-none-match",)) as store:
        lake = LakeFS(f"{s3_bucket}/lake")
        with pytest.raises(LakeError, match="does not support conditional writes") as err:
            lake.create_exclusive("_manifest/batch-00000000000000000001.json", b"{}")
        assert "If-None-Match" in str(err.value) and f"{s3_bucket.removeprefix('s3://')}/lake/_manifest" in str(
            err.value
        )
        with pytest.raises(LakeError, match="does not support conditional writes"):
            land(cap, f"{s3_bucket}/lake2")
        assert any(m == "PUT" for m, _ in store.seen)  # the probe went through the faulty store
    # nothing was committed, and no probe object was left behind
    s3 = LakeFS(s3_bucket).fsspec
    names = [p.rsplit("/", 1)[-1] for p in s3.find(s3_bucket)]
    assert not [n for n in names if n.startswith("batch-")]
    assert not [n for n in names if n.startswith(".clawpipe-conditional-probe-")]


def test_a_store_that_honours_if_none_match_is_checked_once_per_process(
    s3_bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _faulty(s3_server, monkeypatch) as store:
        lake = LakeFS(f"{s3_bucket}/lake")
        assert lake.create_exclusive("_manifest/a.json", b"1")
        assert not lake.create_exclusive("_manifest/a.json", b"2")
        puts = sum(m == "PUT" for m, _ in store.seen)
        assert lake.create_exclusive("_manifest/b.json", b"1")
        assert sum(m == "PUT" for m, _ in store.seen) == puts + 1  # no second probe
        assert lake.read_bytes("_manifest/a.json") == b"1"


def test_a_store_shedding_load_with_slow_down_still_lands_every_call_once(
    s3_bucket: str, s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLAWPIPE_CAPTURE_CACHE", str(tmp_path / "cache"))
    cap, n = write_captures(tmp_path, 3, 10)
    with _faulty(s3_server, monkeypatch) as store:
        url = objstore.captures_url(f"{s3_bucket}/lake")
        store.slow_down.update(PUT=2)
        Uploader(cap, url, host="h1").upload_once()
        store.slow_down.update(PUT=2, GET=2, HEAD=1)
        report = land(url, f"{s3_bucket}/lake", batch_bytes=4096)
        assert store.refused >= 5  # every 503 was met and retried
        assert (report.calls, report.rejects) == (n, 0)
        store.slow_down.update(GET=2)
        assert land(url, f"{s3_bucket}/lake").calls == 0
        rows = run_sql(
            f"{s3_bucket}/lake", "select count(*) as n, count(distinct call_id) as d from model_calls"
        ).to_pylist()
        assert rows == [{"n": n, "d": n}]
