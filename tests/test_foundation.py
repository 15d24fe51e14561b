"""The foundation: schemas round-trip through Parquet and DuckDB, keys, capture framing, CLI speed."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe import capture, keys, schemas
from clawpipe.errors import KeyVerificationError

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)


def _sample_value(field: pa.Field, i: int):
    t = field.type
    if pa.types.is_string(t):
        return f"{field.name}-{i}"
    if pa.types.is_integer(t):
        return i + 1
    if pa.types.is_floating(t):
        return 0.5 + i
    if pa.types.is_boolean(t):
        return i % 2 == 0
    if pa.types.is_timestamp(t):
        return NOW
    if pa.types.is_list(t):
        v = t.value_type
        if pa.types.is_string(v):
            return ["a", "b"]
        if pa.types.is_floating(v):
            return [-0.25, -1.5]
        return [1, 2, 3]
    raise AssertionError(f"no sample for {t}")


@pytest.mark.parametrize("name", sorted(schemas.TABLES))
def test_schema_round_trips_through_parquet_and_duckdb(tmp_path: Path, name: str) -> None:
    schema = schemas.TABLES[name]
    rows = [{f.name: _sample_value(f, i) for f in schema} for i in range(3)]
    table = pa.Table.from_pylist(rows, schema=schema)
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    back = pq.read_table(path)
    assert back.schema.equals(schema, check_metadata=False)
    assert back.to_pylist() == rows
    via_duckdb = duckdb.connect().sql(f"select * from read_parquet('{path}')").to_arrow_table()
    assert via_duckdb.column_names == schema.names
    assert via_duckdb.to_pylist() == rows


def test_rollout_key_verifies_and_rejects_forgery() -> None:
    secret = b"s" * 32
    key = keys.mint_key(secret, run_id="run1", iteration=3, rollout_id="r-7")
    assert keys.verify_key(secret, key) == keys.RolloutKey("run1", 3, "r-7")
    other = keys.mint_key(secret, run_id="run1", iteration=3, rollout_id="r-8")
    forged = key.rsplit(".", 1)[0] + "." + other.rsplit(".", 1)[1]
    with pytest.raises(KeyVerificationError, match="does not verify"):
        keys.verify_key(secret, forged)
    with pytest.raises(KeyVerificationError, match="does not verify"):
        keys.verify_key(b"x" * 32, key)
    with pytest.raises(KeyVerificationError, match="malformed"):
        keys.verify_key(secret, "sk-whatever")


def test_capture_frames_survive_a_torn_tail(tmp_path: Path) -> None:
    seg = tmp_path / "a.open"
    recs = [({"call_id": f"c{i}", "seq": i}, b'{"q":%d}' % i, b"resp" * i) for i in range(5)]
    data = b"".join(capture.encode_record(*r) for r in recs)
    seg.write_bytes(data + capture.encode_record({"call_id": "torn"}, b"x", b"y")[:-3])
    got = [r for r in capture.read_segment(seg) if isinstance(r, capture.CaptureRecord)]
    assert [(r.header, r.request, r.response) for r in got] == recs
    assert capture.recover_segment(seg) > 0
    assert seg.stat().st_size == len(data)
    sealed = capture.seal_segment(seg)
    assert sealed.suffix == ".seg" and len(list(capture.read_segment(sealed))) == 5


def test_capture_reports_corruption_in_sealed_segment(tmp_path: Path) -> None:
    seg = tmp_path / "b.seg"
    good = capture.encode_record({"call_id": "c0"}, b"{}", b"{}")
    bad = bytearray(capture.encode_record({"call_id": "c1"}, b"{}", b"{}"))
    bad[-1] ^= 0xFF
    seg.write_bytes(good + bytes(bad))
    out = list(capture.read_segment(seg))
    assert isinstance(out[0], capture.CaptureRecord)
    assert out[1] == (len(good), "frame checksum mismatch")


def test_results_reader_skips_torn_line_and_flags_bad_json(tmp_path: Path) -> None:
    path = tmp_path / "results-1.jsonl"
    capture.append_result(path, {"rollout_id": "a"})
    with open(path, "ab") as f:
        f.write(b'not json\n{"rollout_id": "torn')
    out = list(capture.read_results(path))
    assert out[0][1] == {"rollout_id": "a"}
    assert out[1][1] is None and "bad result line" in out[1][2]
    assert len(out) == 2


def test_cli_help_imports_nothing_heavy() -> None:
    """`clawpipe --help` stays fast because no room's heavy library loads with the CLI (bench/cli_startup.py
    measures the time)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    code = (
        "import sys; import clawpipe.cli; "
        "heavy=[m for m in ('torch','transformers','prefect','mlflow','duckdb','fastapi','docker') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"
    helped = subprocess.run([sys.executable, "-m", "clawpipe", "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0
    for command in ("serve", "proxy", "rollout", "land", "sql", "trees", "train", "run", "deploy", "worker"):
        assert command in helped.stdout


def test_settings_prepare_offline_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from clawpipe import config

    for var in ("PREFECT_HOME", "MLFLOW_TRACKING_URI", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        monkeypatch.delenv(var, raising=False)
    s = config.prepare_environment()
    assert os.environ["PREFECT_HOME"] == str(home.resolve() / "prefect")
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{home.resolve() / 'mlflow.db'}"
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert s.secret() == s.secret() and len(s.secret()) >= 32
    assert oct((home / "secret").stat().st_mode & 0o777) == "0o600"


@pytest.mark.docker
def test_private_docker_engine_runs_a_container(docker_host: str, tmp_path: Path) -> None:
    import io
    import tarfile

    import docker

    client = docker.DockerClient(base_url=docker_host)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("etc")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    client.api.import_image_from_data(buf.getvalue(), repository="clawpipe-test-empty", tag="1")
    out = client.containers.run(
        "clawpipe-test-empty:1",
        ["/usr/bin/echo", "hello from docker"],
        volumes={
            "/usr": {"bind": "/usr", "mode": "ro"},
            "/lib": {"bind": "/lib", "mode": "ro"},
            "/lib64": {"bind": "/lib64", "mode": "ro"},
        },
        network_mode="none",
        remove=True,
    )
    assert out.strip() == b"hello from docker"


def test_keys_are_refused_for_ids_landing_would_reject() -> None:
    """A rollout whose calls could never land fails when its key is minted, before anything is captured."""
    secret = b"k" * 32
    with pytest.raises(KeyVerificationError, match="201 characters long; at most 200"):
        keys.mint_key(secret, run_id="r" * 201, iteration=0, rollout_id="x")
    for bad_id in ("my run", ".hidden", "a\\b"):
        with pytest.raises(KeyVerificationError, match="letters, digits"):
            keys.mint_key(secret, run_id=bad_id, iteration=0, rollout_id="x")
    for bad in (-1, 2**31, True):
        with pytest.raises(KeyVerificationError, match="iteration="):
            keys.mint_key(secret, run_id="run1", iteration=bad, rollout_id="x")
    assert keys.verify_key(secret, keys.mint_key(secret, run_id="r" * 200, iteration=2**31 - 1, rollout_id="x"))


def test_pid_alive_tells_a_running_process_from_a_reaped_one() -> None:
    import subprocess
    import sys

    from clawpipe.procs import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_alive(os.getpid()) and pid_alive(1)
    assert not pid_alive(child.pid)
