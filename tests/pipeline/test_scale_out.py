"""Rollouts fanned out as shards: splitting, the rerun id rule, the pipeline's watch over shards, and a whole
two-iteration run on two worker "hosts" (separate homes) through a real Prefect server and a real S3 server
with one worker killed mid-shard."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import httpx
import pytest

from clawpipe import objstore
from clawpipe.config import Settings
from clawpipe.errors import ConfigError, SandboxError
from clawpipe.net import free_port
from clawpipe.pipeline import fanout, shards
from clawpipe.pipeline.config import HarnessEntry, PipelineConfig
from clawpipe.pipeline.stages import sample_specs
from tests.support.s3 import s3_bucket, s3_server  # noqa: F401

CHAT_LOOP = [HarnessEntry(name="chat-loop", task_set="guess")]

# --- splitting and ids -------------------------------------------------------------------------------


def test_split_makes_even_consecutive_shards() -> None:
    items = list(range(10))
    parts = shards.split(items, 4)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert [x for p in parts for x in p] == items  # nothing lost, nothing twice, order kept
    assert shards.split(items, 10) == [items]
    assert shards.split([], 3) == []
    assert [len(p) for p in shards.split(list(range(9)), 2)] == [2, 2, 2, 2, 1]
    with pytest.raises(ConfigError, match="shard_size"):
        shards.split(items, 0)


def test_rerun_ids_follow_the_attempt_rule() -> None:
    assert shards.attempt_id("g.0", 1) == "g.0"
    assert shards.attempt_id("g.0", 3) == "g.0.a3"
    assert shards.attempt_ids("g.0", 3) == ["g.0", "g.0.a2", "g.0.a3"]
    done = {"g.0": {"rollout_id": "g.0"}, "g.1.a2": {"rollout_id": "g.1.a2"}}
    kept, todo = shards.plan(["g.0", "g.1", "g.2"], done, 3)
    assert kept == {"g.0": done["g.0"], "g.1": done["g.1.a2"]}  # a row under any earlier id is kept
    assert todo == [("g.2", "g.2.a3")]  # the rest runs under an id never used before
    kept, todo = shards.plan(["g.0", "g.1"], {}, 1)
    assert kept == {} and todo == [("g.0", "g.0"), ("g.1", "g.1")]


def test_attempt_counter_survives_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "r" / "shards" / "rollout-0.attempt"
    assert [shards.AttemptCounter(path).next() for _ in range(3)] == [1, 2, 3]
    assert shards.AttemptCounter(path).current == 3


def test_shard_request_travels_as_plain_json() -> None:
    req = shards.ShardRequest(
        cfg={"samples": 2}, run_id="r", iteration=0, batch_id="rollout-0", index=1, attempt=2, policy_version=3,
        evaluation=False, rollout_ids={"g.0": "g.0.a2"}, upstreams=["http://127.0.0.1:1/v1"],
    )  # fmt: skip
    again = shards.ShardRequest.from_params(json.loads(json.dumps(req.to_params())))
    assert again == req and again.key == "rollout-0.s1.a2"


def test_a_fanned_out_run_needs_an_object_store_lake(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, lake_uri=str(tmp_path / "lake"))
    with pytest.raises(ConfigError, match="CLAWPIPE_LAKE_URI"):
        shards.lake_uri_of(settings)


def test_worker_hosts_reach_the_policy_server_by_the_advertised_name() -> None:
    import socket

    from clawpipe.pipeline.services import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") == socket.getfqdn()  # bound everywhere: reached by this host's name


# --- the pipeline's watch, against a scripted runner (beside the real run below) ------------------------


class ScriptedRunner:
    """Shards "run" by writing their rows to the lake; the ones named in ``stall`` start, beat once, then stop
    beating (a killed worker whose flow run stays RUNNING); those in ``starting`` stay taken by a worker and
    never beat (a worker killed while starting the flow run's process: it stays PENDING)."""

    def __init__(self, lake: str, stall: set[int], starting: frozenset[int] = frozenset()) -> None:
        self.lake, self.stall, self.starting = lake, stall, starting
        self.reqs: dict[str, shards.ShardRequest] = {}
        self.given_up: dict[str, str] = {}

    def submit(self, req: shards.ShardRequest) -> str:
        handle = f"h{len(self.reqs)}"
        self.reqs[handle] = req
        if req.index not in self.starting:
            fs, path = fsspec.core.url_to_fs(shards.shard_state_path(self.lake, req, ".json"))
            fs.pipe_file(path, b'{"beat": 1}')
        return handle

    def state(self, handle: str) -> str:
        req = self.reqs[handle]
        if handle in self.given_up:
            return "failed"
        if req.index in self.stall:
            return "running"
        if req.index in self.starting:
            return "starting"
        rows = "".join(
            json.dumps({"rollout_id": rid, "status": "ok", "reward": 1.0, "harness": "chat-loop"}) + "\n"
            for rid in req.rollout_ids.values()
        )
        fs, path = fsspec.core.url_to_fs(shards.results_url(self.lake, "hostA", req))
        fs.pipe_file(path, rows.encode())
        return "completed"

    def give_up(self, handle: str, reason: str) -> None:
        self.given_up[handle] = reason


def test_a_stalled_shard_is_fenced_and_rerun_under_new_ids(tmp_path: Path) -> None:
    cfg = PipelineConfig(
        groups=2, samples=3, shard_size=2, shard_stall_s=10, backend="process", eval_tasks=0, harnesses=CHAT_LOOP
    )
    specs = sample_specs(cfg, "run1", 0, policy_version=0)
    lake = f"memory://lake-{uuid.uuid4().hex[:8]}"
    runner = ScriptedRunner(lake, stall={1})
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    fan = fanout.FanOut(
        cfg, specs, runner, lake, "rollout-0", ["http://u/v1"], shards.AttemptCounter(tmp_path / "attempt"),
        clock=lambda: now[0], sleep=sleep,
    )  # fmt: skip
    out = fan.run()
    assert out["n"] == len(specs) == 6
    assert [r.key for r in fan.submitted] == [
        "rollout-0.s0.a1",
        "rollout-0.s1.a1",
        "rollout-0.s2.a1",
        "rollout-0.s3.a2",
    ]
    stalled, rerun = fan.submitted[1], fan.submitted[3]
    assert fan.given_up == [stalled.key] and "heartbeat stopped" in runner.given_up["h1"]
    assert list(rerun.rollout_ids) == list(stalled.rollout_ids)  # the same rollouts, in the same groups ...
    assert list(rerun.rollout_ids.values()) == [f"{sid}.a2" for sid in stalled.rollout_ids]  # ... under new ids
    assert 10 < now[0] < 20  # noticed once the heartbeat had been still for shard_stall_s
    fs, path = fsspec.core.url_to_fs(shards.shard_state_path(lake, stalled, ".fenced"))
    assert fs.exists(path)  # a late upload by the stalled shard is refused by the shard itself


def test_a_shard_taken_by_a_worker_that_died_starting_it_is_rerun(tmp_path: Path) -> None:
    cfg = PipelineConfig(
        groups=1,
        samples=4,
        shard_size=2,
        shard_stall_s=10,
        shard_start_s=30,
        backend="process",
        eval_tasks=0,
        harnesses=CHAT_LOOP,
    )
    specs = sample_specs(cfg, "run1", 0, policy_version=0)
    lake = f"memory://lake-{uuid.uuid4().hex[:8]}"
    runner = ScriptedRunner(lake, stall=set(), starting=frozenset({0}))
    now = [0.0]
    fan = fanout.FanOut(
        cfg, specs, runner, lake, "rollout-0", [], shards.AttemptCounter(tmp_path / "attempt"),
        clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
    )  # fmt: skip
    assert fan.run()["n"] == 4
    assert fan.given_up == ["rollout-0.s0.a1"] and "no heartbeat" in runner.given_up["h0"]
    assert 30 < now[0] < 40  # the longer start allowance, not shard_stall_s, applied before any heartbeat
    assert list(fan.submitted[-1].rollout_ids.values()) == [f"{sid}.a2" for sid in fan.submitted[0].rollout_ids]


def test_a_batch_whose_shards_never_finish_fails_clearly(tmp_path: Path) -> None:
    cfg = PipelineConfig(
        groups=1, samples=2, shard_size=2, shard_stall_s=5, backend="process", eval_tasks=0, harnesses=CHAT_LOOP
    )
    specs = sample_specs(cfg, "run1", 0, policy_version=0)
    lake = f"memory://lake-{uuid.uuid4().hex[:8]}"
    runner = ScriptedRunner(lake, stall={0, 1, 2})
    now = [0.0]
    fan = fanout.FanOut(
        cfg, specs, runner, lake, "rollout-0", [], shards.AttemptCounter(tmp_path / "attempt"),
        clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
    )  # fmt: skip
    with pytest.raises(SandboxError, match="no result after 3 attempts"):
        fan.run()
    assert len(fan.submitted) == 3 and len(fan.given_up) == 3


# --- the whole thing: two worker hosts, a real Prefect server, a real S3 server, a worker killed --------

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


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_server(api: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        assert server.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"prefect server did not answer: {log.read_text()[-3000:]}")


def _kill_mid_shard(lake: str, homes: dict[str, Path], workers: dict[str, subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Wait until a shard of iteration 0 has finished some but not all of its rollouts; SIGKILL its worker's
    process group and the shard's own (the flow run runs in a session of its own). Returns its heartbeat."""
    hosts = {objstore.host_id(home / "captures"): name for name, home in homes.items()}
    fs, root = objstore.filesystem(f"{lake}/{shards.SHARDS_DIR}")
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        for path in fs.glob(f"{root}/*/0/*.json") if fs.exists(root) else []:
            with contextlib.suppress(FileNotFoundError, ValueError):
                beat = json.loads(fs.cat_file(path))
                if 0 < beat["done"] < beat["total"] and "state" not in beat:
                    name = hosts[beat["host"]]
                    os.killpg(workers[name].pid, signal.SIGKILL)
                    os.killpg(os.getpgid(int(beat["pid"])), signal.SIGKILL)
                    return {**beat, "worker": name, "key": path.rsplit("/", 1)[-1][: -len(".json")]}
        time.sleep(0.2)
    raise AssertionError("no shard of iteration 0 was seen mid-way")


@pytest.mark.slow
def test_two_workers_one_killed_mid_shard_every_call_once(s3_bucket: str, tmp_path: Path) -> None:  # noqa: F811
    from clawpipe.capture import read_segment
    from clawpipe.lake import land, run_sql
    from clawpipe.pipeline.services import stop_host_proxies
    from clawpipe.train.config import TrainConfig
    from clawpipe.train.loading import load_trees

    lake = f"{s3_bucket}/lake"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
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
    server = _spawn(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        tmp_path / "server.log",
    )
    homes = {name: tmp_path / name for name in ("hostA", "hostB", "control")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    cli = [sys.executable, "-m", "clawpipe"]
    try:
        _wait_for_server(api, server, tmp_path / "server.log")
        worker = [*cli, "worker", "--pool", "rollouts", "--slots", "2", "--limit", "1"]  # one shard at a time
        host_env = {
            name: {**env, "CLAWPIPE_HOME": str(homes[name]), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / f"c-{name}")}
            for name in ("hostA", "hostB")
        }
        for name in ("hostA", "hostB"):
            procs[name] = _spawn(worker, host_env[name], tmp_path / f"{name}.log")
        cfg = tmp_path / "fanout.toml"
        cfg.write_text(FANOUT_CONFIG)
        summary = tmp_path / "summary.json"
        control_env = {**env, "CLAWPIPE_HOME": str(homes["control"]), "CLAWPIPE_CAPTURE_CACHE": str(tmp_path / "c")}
        run_cmd = [*cli, "run", "--config", str(cfg), "--summary-out", str(summary)]
        procs["run"] = _spawn(run_cmd, control_env, tmp_path / "run.log")
        killed = _kill_mid_shard(lake, homes, {k: procs[k] for k in ("hostA", "hostB")})
        (record,) = (homes[killed["worker"]] / "proxies").glob("*.json")
        proxy_pid = json.loads(record.read_text())["pid"]
        # the host comes back: a new worker there finds the proxy the killed one's shard started
        procs[f"{killed['worker']}-again"] = _spawn(worker, host_env[killed["worker"]], tmp_path / "again.log")
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
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=60)
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
    fenced = [p.rsplit("/", 1)[-1] for p in fs_shards.glob(f"{shards_root}/*.fenced")]
    assert f"{killed['key']}.fenced" in fenced  # the killed shard was given up ...
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
    assert cut and all(shards.attempt_id(r, 1) == r and ".a" not in r for r in cut)  # the killed attempt's calls landed
    trees, _infos, stats = load_trees(lake, run_id, 0, TrainConfig())
    trained = {s.rollout_id for t in trees for s in t.sequences}
    assert trained and not trained & set(cut)  # ... but none of them is in a trained sequence
    assert stats["calls_without_rollout"] > 0
    assert len(result["iterations"]) == 2 and killed["worker"] in ("hostA", "hostB")


@pytest.mark.slow
def test_one_host_proxy_per_host_shared_by_shards_and_stopped_with_the_worker(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from clawpipe.pipeline.services import host_proxy, stop_host_proxies
    from tests.support.upstream import ScriptedUpstream, say

    up = ScriptedUpstream(default=say("ok")).start()
    home = tmp_path / "host"
    try:
        with ThreadPoolExecutor(2) as pool:  # two shards starting at once on one host
            urls = list(pool.map(lambda _: host_proxy(home, [f"{up.url}/v1"], "admin"), range(2)))
        assert urls[0] == urls[1]
        (record,) = (home / "proxies").glob("*.json")
        pid = json.loads(record.read_text())["pid"]
        assert host_proxy(home, [f"{up.url}/v1"], "admin") == urls[0]  # a later shard reuses it
        assert httpx.get(f"{urls[0]}/admin/health", headers={"authorization": "Bearer admin"}).status_code == 200
        assert stop_host_proxies(home) == 1
        assert not record.exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        stop_host_proxies(home)
        up.stop()
