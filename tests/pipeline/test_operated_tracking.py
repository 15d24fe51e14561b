"""MLflow as teams read it: a resumed run adds no second point at a step, runs of two configs have the same
param names, long values and names MLflow refuses never fail a run, and a tracking server that goes away
mid-run is said once while the run goes on."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawpipe import tracking
from clawpipe.net import free_port
from clawpipe.tracking import MAX_KEY_LEN, MAX_PARAM_LEN, make_tracker


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_resumed_run_logs_no_second_point_at_a_step(tmp_path: Path, home: Path) -> None:
    # before: the iteration a kill cut off was trained again on resume and its step logged twice
    uri = _uri(tmp_path)
    first = make_tracker(experiment="resume", tracking_uri=uri)
    run_id = first.start_run("r")
    assert run_id is not None
    for step in (0, 1):
        first.log_metrics({"train/loss": 1.0 + step, "reward/mean": 0.1 * step}, step=step)
    # the resumed process attaches to the same run and redoes step 1, then goes on to step 2
    resumed = make_tracker(experiment="resume", tracking_uri=uri)
    assert resumed.start_run(mlflow_run_id=run_id) == run_id
    resumed.log_metrics({"train/loss": 9.0, "reward/mean": 9.0, "train/new": 3.0}, step=1)
    resumed.log_metrics({"train/loss": 3.0, "reward/mean": 0.2}, step=2)
    resumed.log_metrics({"train/loss": 9.0}, step=2)  # the same tracker logging a step twice keeps one too
    assert _history(uri, run_id, "train/loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert _history(uri, run_id, "reward/mean") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert _history(uri, run_id, "train/new") == [(1, 3.0)]  # a metric new at a redone step is logged


def test_long_values_and_names_mlflow_refuses_never_fail_a_run(tmp_path: Path, home: Path) -> None:
    # before: MLflow refused the batch (names with '@', ',', '../', over 250 characters) and the call raised
    import mlflow

    uri = _uri(tmp_path)
    tracker = make_tracker(experiment="names", tracking_uri=uri)
    run_id = tracker.start_run("r")
    assert run_id is not None
    long_a, long_b = "x" * 7000 + "a", "x" * 7000 + "b"
    tracker.log_params(
        {"prompt": long_a, "other": long_b, "env.KEY@host": 1, "../up": 2, "k" * 300: 3, "k" * 300 + "z": 4}
    )
    tracker.log_metrics({"reward/a@b,c": 1.0, "eval//./x": 2.0, "m" * 300: 3.0, "ok/name:1": 4.0}, step=0)
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    params = run.data.params
    assert len(params["prompt"]) == MAX_PARAM_LEN and params["prompt"].startswith("x" * 5000)
    assert "7001 chars" in params["prompt"] and params["prompt"] != params["other"]  # still told apart
    assert params["env.KEY_host"] == "1" and params["__/up"] == "2"
    long_keys = [k for k in params if k.startswith("kkk")]
    assert len(long_keys) == 2 and all(len(k) == MAX_KEY_LEN for k in long_keys)
    assert set(run.data.metrics) == {"reward/a_b_c", "eval/_/x", tracking.tracking_name("m" * 300), "ok/name:1"}


def test_a_request_the_store_refuses_is_said_and_later_calls_still_log(
    tmp_path: Path, home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    uri = _uri(tmp_path)
    gone = make_tracker(experiment="refused", tracking_uri=uri)
    gone_id = gone.start_run("deleted")
    assert gone_id is not None
    mlflow.MlflowClient(tracking_uri=uri).delete_run(gone_id)  # someone deleted the run in the UI
    caplog.set_level(logging.WARNING, logger="clawpipe.tracking")
    gone.log_metrics({"reward/mean": 1.0}, step=0)
    assert any("refused to log metrics" in r.getMessage() for r in caplog.records), caplog.text
    other = make_tracker(experiment="refused", tracking_uri=uri)
    other_id = other.start_run("other")
    assert other_id is not None
    other.log_metrics({"reward/mean": 2.0}, step=0)  # not dropped as if the store were away
    assert _history(uri, other_id, "reward/mean") == [(0, 2.0)]


def test_runs_of_two_configs_have_the_same_param_names(tmp_path: Path, home: Path) -> None:
    # before: only the train keys a config set were logged (and as given: 1 beside the trainer's 1.0)
    import mlflow
    from clawpipe.config import Settings
    from clawpipe.pipeline.config import PipelineConfig
    from clawpipe.pipeline.stages import open_run

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    settings = Settings(home=home)
    a = PipelineConfig(backend="process", policy=str(policy), experiment="cmp", train={"learning_rate": 0.01})
    b = PipelineConfig(backend="process", policy=str(policy), experiment="cmp", groups=2, train={"epochs": 2})
    runs = [open_run(settings, cfg, run_id=None, resume=False, git_revision="g") for cfg in (a, b)]
    client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)
    pa, pb = (client.get_run(str(r.mlflow_run_id)).data.params for r in runs)
    assert set(pa) == set(pb)
    assert {"train.learning_rate", "train.epochs", "train.clip_high", "groups"} <= set(pa)
    assert (pa["train.epochs"], pb["train.epochs"]) == (str(a.train_config().epochs), "2")
    assert pa["train.learning_rate"] == str(a.train_config().learning_rate)
    assert "train" not in pa  # flattened, not one string of the table


def _start_mlflow(port: int, backend: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_DISABLE_TELEMETRY"] = "true"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_a_tracking_server_gone_mid_run_is_said_once_and_the_run_goes_on(
    tmp_path: Path, home: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: the first call after the server went away retried for minutes, then raised and failed the task
    for key in tracking._HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(tracking, "_RETRY_AFTER_S", 2.0)
    port, backend = free_port(), f"sqlite:///{tmp_path / 'server.db'}"
    uri = f"http://127.0.0.1:{port}"
    server = _start_mlflow(port, backend, tmp_path / "mlflow.log")
    try:
        tracker = make_tracker(experiment="away", tracking_uri=uri)
        run_id = tracker.start_run("r")
        assert run_id is not None
        tracker.log_metrics({"reward/mean": 0.0}, step=0)
        _stop(server)
        caplog.set_level(logging.INFO, logger="clawpipe.tracking")
        t0 = time.monotonic()
        for step in range(1, 7):  # steps of a run going on, each a fresh tracker as the flow's tasks make them
            step_tracker = make_tracker(experiment="away", tracking_uri=uri)
            step_tracker.start_run(mlflow_run_id=run_id)
            step_tracker.log_params({f"p{step}": step})
            step_tracker.log_metrics({"reward/mean": float(step)}, step=step)
            time.sleep(0.5)
        step_tracker.end("FINISHED")
        assert time.monotonic() - t0 < 60
        said = [r.getMessage() for r in caplog.records if "MLflow at" in r.getMessage()]
        assert len(said) == 1 and "failed" in said[0] and uri in said[0], said
        server = _start_mlflow(port, backend, tmp_path / "mlflow.log")
        time.sleep(2.5)  # past the retry time: the next call reaches the server again
        back = make_tracker(experiment="away", tracking_uri=uri)
        back.start_run(mlflow_run_id=run_id)
        back.log_metrics({"reward/mean": 7.0}, step=7)
        said = [r.getMessage() for r in caplog.records if "MLflow at" in r.getMessage()]
        assert len(said) == 2 and "answers again" in said[1] and "dropped" in said[1], said
        assert _history(uri, run_id, "reward/mean") == [(0, 0.0), (7, 7.0)]
    finally:
        _stop(server)
