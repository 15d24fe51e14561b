"""Scale-out: rollouts per minute fanned out to 1 and to 2 Prefect workers, and landing from an object store.

Run: ``.venv/bin/python bench/scale_out.py [--rollouts N] [--shard-size N] [--calls N]``. Starts, on
loopback, a Prefect server, an S3-compatible server (moto) and a scripted policy upstream, then:

1. Fans a batch of ``--rollouts`` chat-loop rollouts (process backend, guess tasks, each answered "ok" by
   the scripted upstream, so the sandboxes' own work is tiny) out as shards of ``--shard-size`` over the
   ``rollout-shard`` deployment, first with one worker host (``clawpipe worker``, its own home), then with
   two. Wall time from submission to the last row in the bucket gives rollouts per minute; the ratio
   2 workers / 1 worker shows how much of a shard is coordination (a flow run's process start, the host
   proxy, the flush) rather than sandbox work on this 2-core machine.
2. Lands ``--calls`` production-shaped small calls (bench/data.py) from local disk into a local lake, and
   the same segments uploaded to the bucket from there into a lake in the bucket: calls per second of
   wall time each (landing from the store includes mirroring the new segments into the local cache).

Prints human lines, the machine's load average, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import data  # noqa: E402


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url, timeout=2)
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer at {url}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def fan_out_child(rollouts: int, shard_size: int, upstream: str, batch: str) -> None:
    """Child process body (the pipeline's side): fan one batch out over the pool; print seconds and rows."""
    from clawpipe.config import get_settings
    from clawpipe.pipeline import fanout
    from clawpipe.pipeline.config import HarnessEntry, PipelineConfig
    from clawpipe.pipeline.stages import sample_specs
    from flows.rollout_shard import PrefectShards, ensure_deployment

    cfg = PipelineConfig(
        harnesses=[HarnessEntry(name="chat-loop", task_set="guess")],
        groups=max(1, rollouts // 4),
        samples=4,
        eval_tasks=0,
        backend="process",
        concurrency=2,  # two sandboxes per shard: a host with 4 slots runs two shards at once
        rollout_pool="bench-rollouts",
        shard_size=shard_size,
        shard_stall_s=60,
    )
    ensure_deployment("bench-rollouts")
    specs = sample_specs(cfg, f"bench-{batch}", 0, policy_version=0)
    runner = PrefectShards("bench-rollouts")
    t0 = time.perf_counter()
    with runner.client:
        out = fanout.fan_out(cfg, specs, runner=runner, settings=get_settings(), batch_id=batch, upstreams=[upstream])
    print(json.dumps({"seconds": time.perf_counter() - t0, "rows": out["n"], "statuses": out["statuses"]}))


def fan_out(env: dict[str, str], work: Path, workers: int, args: argparse.Namespace, upstream: str) -> dict[str, Any]:
    procs = []
    for w in range(workers):
        home = work / f"w{workers}-{w}"
        wenv = {**env, "CLAWPIPE_HOME": str(home)}
        cmd = [sys.executable, "-m", "clawpipe", "worker", "--pool", "bench-rollouts", "--slots", "4"]
        procs.append(_spawn(cmd, wenv, work / f"worker-{workers}-{w}.log"))
    try:
        time.sleep(8)  # the workers register and poll; their start is not part of a batch
        cenv = {**env, "CLAWPIPE_HOME": str(work / f"control{workers}")}
        code = (
            "import sys; sys.path.insert(0, 'bench'); import scale_out; "
            f"scale_out.fan_out_child({args.rollouts}, {args.shard_size}, {upstream!r}, 'b{workers}')"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=cenv, cwd=ROOT, capture_output=True, text=True, timeout=1800
        )
        if out.returncode != 0:
            raise RuntimeError(f"fan-out with {workers} workers failed:\n{out.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            _stop(p)
    result["rollouts_per_min"] = result["rows"] / result["seconds"] * 60
    return result


def land_child(captures: str, lake: str) -> None:
    from clawpipe.lake import land

    t0 = time.perf_counter()
    rep = land(captures, lake)
    print(json.dumps({"calls": rep.calls, "seconds": time.perf_counter() - t0}))


def landing(env: dict[str, str], work: Path, calls: int, bucket: str) -> dict[str, Any]:
    from clawpipe import objstore
    from clawpipe.proxy.upload import Uploader

    cap = work / "cap"
    data.write_segments(cap, calls, data.shape("small"), per_segment=500, run_id="bench-land")
    url = objstore.captures_url(f"{bucket}/lake")
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    Uploader(cap, url, host="bench").upload_once()
    out: dict[str, Any] = {}
    for name, src, lake in (("local", str(cap), str(work / "lake")), ("object_store", url, f"{bucket}/lake")):
        code = f"import sys; sys.path.insert(0, 'bench'); import scale_out; scale_out.land_child({src!r}, {lake!r})"
        lenv = {**env, "CLAWPIPE_CAPTURE_CACHE": str(work / f"cache-{name}")}
        run = subprocess.run([sys.executable, "-c", code], env=lenv, cwd=ROOT, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"landing from {name} failed:\n{run.stderr[-3000:]}")
        got = json.loads(run.stdout.strip().splitlines()[-1])
        out[name] = {"calls": got["calls"], "calls_per_s": got["calls"] / got["seconds"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=4)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()

    import boto3

    from clawpipe.net import free_port
    from tests.support.upstream import ScriptedUpstream, say

    work = Path(tempfile.mkdtemp(prefix="clawpipe-bench-scale-"))
    s3_port, api_port = free_port(), free_port()
    s3_url, api = f"http://127.0.0.1:{s3_port}", f"http://127.0.0.1:{api_port}/api"
    bucket = f"s3://bench{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CLAWPIPE_", "MLFLOW_"))}
    env.update(
        {
            "PREFECT_HOME": str(work / "prefect"),
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "DO_NOT_TRACK": "true",
            "AWS_ENDPOINT_URL": s3_url,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "CLAWPIPE_LAKE_URI": f"{bucket}/lake",
            "PYTHONPATH": str(ROOT),
        }
    )
    s3 = _spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)], env, work / "s3.log")
    server = _spawn(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(api_port)],
        env,
        work / "prefect.log",
    )
    up = ScriptedUpstream(default=say("ok")).start()
    try:
        _wait_http(s3_url, s3, "moto")
        boto3.client(
            "s3", endpoint_url=s3_url, aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
        ).create_bucket(Bucket=bucket[len("s3://") :])
        _wait_http(f"{api}/health", server, "prefect server")
        one = fan_out(env, work, 1, args, f"{up.url}/v1")
        print(f"1 worker:  {one['rows']} rollouts in {one['seconds']:.1f} s = {one['rollouts_per_min']:.1f}/min")
        two = fan_out(env, work, 2, args, f"{up.url}/v1")
        print(f"2 workers: {two['rows']} rollouts in {two['seconds']:.1f} s = {two['rollouts_per_min']:.1f}/min")
        land = landing(env, work, args.calls, bucket)
        print(
            f"landing {args.calls} small calls: local {land['local']['calls_per_s']:.0f}/s, "
            f"object store {land['object_store']['calls_per_s']:.0f}/s"
        )
    finally:
        up.stop()
        _stop(server)
        _stop(s3)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(
        json.dumps(
            {
                "bench": "scale_out",
                "rollouts": args.rollouts,
                "shard_size": args.shard_size,
                "rollouts_per_min_1_worker": round(one["rollouts_per_min"], 1),
                "rollouts_per_min_2_workers": round(two["rollouts_per_min"], 1),
                "ratio_2_over_1": round(two["rollouts_per_min"] / one["rollouts_per_min"], 2),
                "landing_calls_per_s_local": round(land["local"]["calls_per_s"], 1),
                "landing_calls_per_s_object_store": round(land["object_store"]["calls_per_s"], 1),
                "ratio_object_store_over_local": round(
                    land["object_store"]["calls_per_s"] / land["local"]["calls_per_s"], 2
                ),
                "loadavg": [round(x, 2) for x in load],
            }
        )
    )


if __name__ == "__main__":
    main()
