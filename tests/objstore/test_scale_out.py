"""A fanned-out pipeline run end to end: two worker "hosts" (separate homes, each its own `clawpipe worker` and
capture proxy) through a real Prefect server, captures and lake on a real S3 server (moto on loopback), one
worker and its shard killed mid-shard in iteration 0. Every call lands exactly once, every rollout row once,
every group is complete, and the killed shard's calls land but are in no trained sequence."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawpipe import objstore
from clawpipe.net import free_port
from clawpipe.pipeline import attempts, shards
from tests.support.prefect_server import spawn, start_server, wait_until_healthy

FANOUT_CONFIG = """
run_name = "fanout"
experiment = "scale-out"
iterations = 2
groups = 2
samples = 4
eval_tasks = 0
backend = "process"
concurrency = 1
rollout_pool = "rollouts"
shard_size = 4
shard_stall_s = 10
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


def _mid_shard(
    lake: str, deadline_s: float = 400, skip: frozenset[str] = frozenset(), left: int = 1
) -> tuple[str, dict[str, Any]]:
    """The key and heartbeat of a shard of iteration 0 (not one in ``skip``) once it has finished some of its
    rollouts and has at least ``left`` still to run."""
    fs, root = objstore.filesystem(f"{lake}/{shards.SHARDS_DIR}")
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for path in fs.glob(f"{root}/*/0/*.json") if fs.exists(root) else []:
            with contextlib.suppress(FileNotFoundError, ValueError):
                beat = json.loads(fs.cat_file(path))
                key = path.rsplit("/", 1)[-1][: -len(".json")]
                if 0 < beat["done"] <= beat["total"] - left and "state" not in beat and key not in skip:
                    return key, beat
        time.sleep(0.2)
    raise AssertionError("no shard of iteration 0 was seen mid-way")


def _kill_mid_shard(lake: str, homes: dict[str, Path], workers: dict[str, subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Wait until a shard of iteration 0 has finished some but not all of its rollouts; SIGKILL its worker's
    process group and the shard's own (the flow run runs in a session of its own). Returns its heartbeat."""
    hosts = {objstore.host_id(home / "captures"): name for name, home in homes.items()}
    key, beat = _mid_shard(lake)
    name = hosts[beat["host"]]
    os.killpg(workers[name].pid, signal.SIGKILL)
    os.killpg(os.getpgid(int(beat["pid"])), signal.SIGKILL)
    return {**beat, "worker": name, "key": key}


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each process group still running, then a minute for it to end."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)


def _env(tmp_path: Path, api: str, lake: str) -> dict[str, str]:
    """The environment every process of a fanned-out test shares: its Prefect server, the lake in the bucket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env.update(
        {
            "PREFECT_HOME": str(tmp_path / "prefect"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "DO_NOT_TRACK": "true",
            "PYTHONUNBUFFERED": "1",
            "CLAWPIPE_LAKE_URI": lake,
        }
    )
    return env


@pytest.mark.slow
def test_two_workers_one_killed_mid_shard_every_call_once(s3_bucket: str, tmp_path: Path) -> None:
    from clawpipe.capture import read_segment
    from clawpipe.lake import land, run_sql
    from clawpipe.pipeline.services import stop_host_proxies
    from clawpipe.train.config import TrainConfig
    from clawpipe.train.loading import load_trees

    lake = f"{s3_bucket}/lake"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(tmp_path, api, lake)
    server = start_server(port, env, tmp_path / "server.log")
    homes = {name: tmp_path / name for name in ("hostA", "hostB", "control")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    cli = [sys.executable, "-m", "clawpipe"]
    try:
        wait_until_healthy(api, server, tmp_path / "server.log")
        worker = [*cli, "worker", "--pool", "rollouts", "--slots", "2", "--limit", "1"]  # one shard at a time
        host_env = {
            name: {**env, "CLAWPIPE_HOME": str(homes[name]), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / f"c-{name}")}
            for name in ("hostA", "hostB")
        }
        for name in ("hostA", "hostB"):
            procs[name] = spawn(worker, host_env[name], tmp_path / f"{name}.log")
        cfg = tmp_path / "fanout.toml"
        cfg.write_text(FANOUT_CONFIG)
        summary = tmp_path / "summary.json"
        control_env = {**env, "CLAWPIPE_HOME": str(homes["control"]), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / "c")}
        run_cmd = [*cli, "run", "--config", str(cfg), "--summary-out", str(summary)]
        procs["run"] = spawn(run_cmd, control_env, tmp_path / "run.log")
        killed = _kill_mid_shard(lake, homes, {k: procs[k] for k in ("hostA", "hostB")})
        (record,) = (homes[killed["worker"]] / "proxies").glob("*.json")
        proxy_pid = json.loads(record.read_text())["pid"]
        # the host comes back: a new worker there finds the proxy the killed one's shard started
        procs[f"{killed['worker']}-again"] = spawn(worker, host_env[killed["worker"]], tmp_path / "again.log")
        assert procs["run"].wait(timeout=500) == 0, (tmp_path / "run.log").read_text()[-6000:]
        result = json.loads(summary.read_text())
        run_id = result["run_id"]
        for name in ("hostA", "hostB"):  # each host's sandbox cap is a Prefect global limit with its slots
            host = objstore.host_id(homes[name] / "captures")
            limit = httpx.get(f"{api}/v2/concurrency_limits/sandboxes-{host}", timeout=10).json()
            assert limit["limit"] == 2
        os.kill(proxy_pid, 0)  # the killed worker's host proxy outlived it ...
        assert json.loads(record.read_text())["pid"] == proxy_pid  # ... and was never replaced
    finally:
        _stop(procs)
        for name in ("hostA", "hostB"):
            stop_host_proxies(homes[name])  # the killed worker's proxy outlived it: seal and upload, then stop
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)

    # nothing was left behind: every call any proxy captured is in the bucket, and the lake already has it
    os.environ["CLAWPIPE_CAPTURE_CACHE"] = str(tmp_path / "c-final")
    try:
        assert land(objstore.captures_url(lake), lake).calls == 0
    finally:
        os.environ.pop("CLAWPIPE_CAPTURE_CACHE")
    fs, root = objstore.filesystem(objstore.captures_url(lake))
    captured: list[str] = []
    for path in fs.glob(f"{root}/*/*.seg"):
        local = tmp_path / "segs" / path.rsplit("/", 2)[-2] / path.rsplit("/", 1)[-1]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local))
        captured += [rec.header["call_id"] for rec in read_segment(local) if not isinstance(rec, tuple)]
    assert len(captured) == len(set(captured)) > 0

    def one(sql: str) -> dict[str, Any]:
        rows: list[dict[str, Any]] = run_sql(lake, sql).to_pylist()
        return rows[0]

    calls = one(f"select count(*) n, count(distinct call_id) d from model_calls where run_id = '{run_id}'")
    assert calls["n"] == calls["d"] == len([c for c in captured])  # every call in the lake exactly once
    rows = one(f"select count(*) n, count(distinct rollout_id) d from rollouts where run_id = '{run_id}'")
    assert rows["n"] == rows["d"] == 2 * 2 * 4  # every rollout row once: 2 iterations x 2 groups x 4 samples
    groups = run_sql(lake, f"select group_id, count(*) n from rollouts where run_id = '{run_id}' group by 1")
    assert sorted(g["n"] for g in groups.to_pylist()) == [4, 4, 4, 4]  # every group complete
    fs_shards, shards_root = objstore.filesystem(f"{lake}/{shards.SHARDS_DIR}/{run_id}/0")
    decisions = {p.rsplit("/", 1)[-1]: fs_shards.cat_file(p) for p in fs_shards.glob(f"{shards_root}/*.decision")}
    fenced = [name for name, outcome in decisions.items() if outcome == shards.GIVEN_UP.encode()]
    assert f"{killed['key']}.decision" in fenced  # the killed shard was given up ...
    rerun = one(
        f"select count(*) n from rollouts where run_id = '{run_id}' and iteration = 0 and rollout_id like '%.a_'"
    )
    assert rerun["n"] == 4 * len(fenced)  # ... and its rollouts (4 a shard) ran again under new ids in their groups
    cut = (
        run_sql(
            lake,
            f"select distinct c.rollout_id from model_calls c anti join rollouts r using (rollout_id) "
            f"where c.run_id = '{run_id}' and c.iteration = 0",
        )
        .column(0)
        .to_pylist()
    )
    assert cut and all(
        attempts.attempt_id(r, 1) == r and ".a" not in r for r in cut
    )  # the killed attempt's calls landed
    trees, _infos, stats = load_trees(lake, run_id, 0, TrainConfig())
    trained = {s.rollout_id for t in trees for s in t.sequences}
    assert trained and not trained & set(cut)  # ... but none of them is in a trained sequence
    assert stats["calls_without_rollout"] > 0
    assert len(result["iterations"]) == 2 and killed["worker"] in ("hostA", "hostB")


@pytest.mark.slow
def test_a_fanned_out_run_cancelled_through_prefect_cancels_its_shard_on_the_worker(
    s3_bucket: str, tmp_path: Path
) -> None:
    """One shard's flow run cancelled in the UI: that shard stops and the run goes on, rerunning its unfinished
    rollouts. Then the run's flow run cancelled while a shard runs on a worker: the run stops, and so does the
    shard (before, the worker ran it to its end for a run that had stopped): its flow run ends Cancelled and
    its process exits while the worker lives on. ``--resume`` then finishes the batch with every call and
    every rollout row once."""
    from clawpipe.lake import run_sql
    from clawpipe.pipeline.services import stop_host_proxies

    lake = f"{s3_bucket}/cancel-lake"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(tmp_path, api, lake)
    server = start_server(port, env, tmp_path / "server.log")
    host, control = tmp_path / "hostA", tmp_path / "control"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    cli = [sys.executable, "-m", "clawpipe"]
    try:
        wait_until_healthy(api, server, tmp_path / "server.log")
        host_env = {**env, "CLAWPIPE_HOME": str(host), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / "c-host")}
        procs["worker"] = spawn([*cli, "worker", "--pool", "rollouts", "--slots", "2", "--limit", "1"], host_env,
                                tmp_path / "worker.log")  # fmt: skip
        cfg = tmp_path / "fanout.toml"
        cfg.write_text(FANOUT_CONFIG.replace("iterations = 2", "iterations = 1"))
        control_env = {**env, "CLAWPIPE_HOME": str(control), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / "c")}
        procs["run"] = spawn([*cli, "run", "--config", str(cfg)], control_env, tmp_path / "run.log")
        cancel = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
        shard_runs = {"flows": {"name": {"any_": ["rollout-shard"]}}}
        first_key, first = _mid_shard(lake, left=2)  # not about to end before the cancel reaches it
        (one,) = [
            s
            for s in httpx.post(f"{api}/flow_runs/filter", json=shard_runs, timeout=10).json()
            if s["name"].endswith(first_key)
        ]
        r = httpx.post(f"{api}/flow_runs/{one['id']}/set_state", json=cancel, timeout=10)
        assert r.status_code in (200, 201), r.text
        ended, rerun = f"shard {first_key} ended cancelled", f"shard {first_key} ended with "
        deadline = time.monotonic() + 90
        while rerun not in (tmp_path / "run.log").read_text() and time.monotonic() < deadline:
            assert procs["run"].poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            time.sleep(0.5)
        text = (tmp_path / "run.log").read_text()
        assert ended in text and rerun in text and text.index(ended) < text.index(rerun), text[-4000:]
        assert re.search(rf"{re.escape(rerun)}\d+ of 4 rollouts unfinished; rerunning", text), text[-4000:]
        assert procs["run"].poll() is None  # the run goes on

        _key, beat = _mid_shard(lake, skip=frozenset({first_key}), left=2)
        body = {"flows": {"name": {"any_": ["pipeline"]}}}
        (pipeline,) = httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()
        r = httpx.post(f"{api}/flow_runs/{pipeline['id']}/set_state", json=cancel, timeout=10)
        assert r.status_code in (200, 201), r.text
        assert procs["run"].wait(timeout=120) == 1, (tmp_path / "run.log").read_text()[-4000:]
        assert re.search(r"batch rollout-0: shard \S+ cancelled", (tmp_path / "run.log").read_text())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            runs = httpx.post(f"{api}/flow_runs/filter", json=shard_runs, timeout=10).json()
            states = [s["state_type"] for s in runs]
            shard_alive = any(os.path.exists(f"/proc/{b['pid']}") for b in (first, beat))
            if not shard_alive and not {"RUNNING", "PENDING", "CANCELLING", "SCHEDULED"} & set(states):
                break
            time.sleep(0.5)
        assert "CANCELLED" in states and not {"RUNNING", "PENDING", "CANCELLING", "SCHEDULED"} & set(states), states
        assert not shard_alive, "the cancelled shard's process still runs"
        assert procs["worker"].poll() is None  # the worker stopped the shard, not itself
        (state_file,) = control.glob("runs/*/state.json")
        run_id = state_file.parent.name
        resumed = subprocess.run([*cli, "run", "--resume", run_id], env=control_env, capture_output=True, text=True,
                                 timeout=500)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-4000:]
    finally:
        _stop(procs)
        stop_host_proxies(host)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    calls = run_sql(lake, f"select count(*) n, count(distinct call_id) d from model_calls where run_id = '{run_id}'")
    (row,) = calls.to_pylist()
    assert row["n"] == row["d"] > 0  # every call once
    ids = run_sql(lake, f"select rollout_id from rollouts where run_id = '{run_id}'").column(0).to_pylist()
    specs = [re.sub(r"\.a\d+$", "", r) for r in ids]
    assert len(ids) == len(set(specs)) == 2 * 4  # every planned rollout once: under its id or a later attempt's
