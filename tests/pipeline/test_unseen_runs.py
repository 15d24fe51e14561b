"""A run id driven twice: a second `clawpipe run --resume` of a run another process is running is refused
(by the CLI before Prefect starts, and by the flow process itself should both start at once), a resume
never takes a new config, and a run whose process was SIGKILLed can be resumed at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe.errors import ConfigError
from clawpipe.pipeline.state import RunState, run_lock

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "unseen-20260101-000000-abcdef"
HOLDER = """
import sys, time
from pathlib import Path
from clawpipe.pipeline.state import run_lock
with run_lock(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env.update({"CLAWPIPE_HOME": str(home), "COLUMNS": "200"})
    return env


def _saved_run(home: Path) -> Path:
    state = RunState(run_id=RUN_ID, config={"backend": "process"}, policy_dir=str(home / "models" / "p"))
    return state.save(home / "runs")


def _hold(home: Path) -> subprocess.Popen[str]:
    """Another process running the run: it holds the run's lock until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(home / "runs"), RUN_ID], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _refused_as_running(out: subprocess.CompletedProcess[str], pid: int) -> None:
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr
    assert f"run {RUN_ID} is already running (process {pid})" in out.stderr
    assert f"clawpipe run --resume {RUN_ID}" in out.stderr


def test_a_run_another_process_is_running_is_not_resumed_twice(tmp_path: Path) -> None:
    home = tmp_path / "home"
    state_file = _saved_run(home)
    before = state_file.read_bytes()
    holder = _hold(home)
    try:
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "clawpipe", "run", "--resume", RUN_ID],
            cwd=ROOT,
            env=_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        _refused_as_running(out, holder.pid)
        assert time.monotonic() - start < 30  # before Prefect's temporary server (~20 s here) starts
        # the flow process checks for itself: two resumes started together both pass the CLI's look
        out = subprocess.run(
            [sys.executable, "-m", "flows.pipeline", "--run-id", RUN_ID, "--resume"],
            cwd=ROOT,
            env=_env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        _refused_as_running(out, holder.pid)
        assert "Starting temporary server" not in out.stdout + out.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert state_file.read_bytes() == before  # the refused resumes left the run as it was
    # a SIGKILLed holder leaves no lock behind: resume works at once, and this process now holds it
    with run_lock(home / "runs", RUN_ID):
        assert (home / "runs" / RUN_ID / "run.lock").read_text() == str(os.getpid())  # names its holder
        with pytest.raises(ConfigError, match="already running"), run_lock(home / "runs", RUN_ID):
            pass


@pytest.mark.parametrize(
    ("extra", "flags"),
    [
        (["--config", "{config}"], "--config"),
        (["--iterations", "5"], "--iterations"),
        (["--backend", "docker", "--mode", "async"], "--backend, --mode"),
    ],
)
def test_a_resume_with_a_new_config_is_refused_not_ignored(tmp_path: Path, extra: list[str], flags: str) -> None:
    # before: the flags were dropped without a word and the run went on with its first config
    home = tmp_path / "home"
    state_file = _saved_run(home)
    config = tmp_path / "other.toml"
    config.write_text("iterations = 7\n")
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--resume", RUN_ID, *[a.format(config=config) for a in extra]],
        cwd=ROOT,
        env=_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"--resume continues {RUN_ID} with the config it started with; drop {flags}" in out.stderr
    assert "Traceback" not in out.stderr
    assert json.loads(state_file.read_text())["config"] == {"backend": "process"}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_terminated_clawpipe_run_stops_its_flow_and_leaves_the_run_resumable(tmp_path: Path) -> None:
    # before: SIGTERM ended the clawpipe process alone; the flow ran on, orphaned, holding the run's lock
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawpipe", "run", "--backend", "process", "--iterations", "5"],
        cwd=ROOT,
        env=_env(home),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        flow_pid = None
        while time.monotonic() < deadline and flow_pid is None:
            assert proc.poll() is None
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            flow_pid = next((int(c) for c in children if b"flows.pipeline" in _cmdline(int(c))), None)
            time.sleep(0.2)
        assert flow_pid is not None, "clawpipe run never started its flow process"
        under_way = time.monotonic() + 30
        while time.monotonic() < under_way and not any(p.read_text() for p in home.glob("runs/*/run.lock")):
            time.sleep(0.2)  # the flow is under way once it holds its run's lock
        proc.send_signal(signal.SIGTERM)  # to clawpipe run alone, as `kill PID` does
        assert proc.wait(timeout=120) != 0
        deadline = time.monotonic() + 45  # five iterations take minutes: only a stopped flow ends in time
        while time.monotonic() < deadline and _alive(flow_pid):
            time.sleep(0.2)
        assert not _alive(flow_pid), "the flow process outlived clawpipe run"
        (lock,) = home.glob("runs/*/run.lock")
        with run_lock(home / "runs", lock.parent.name):  # free: the run can be resumed
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run's process group
        proc.wait()


def test_a_new_run_under_an_existing_run_id_is_refused_not_overwritten(tmp_path: Path) -> None:
    from clawpipe.config import Settings
    from clawpipe.pipeline.config import PipelineConfig
    from clawpipe.pipeline.stages import open_run

    home = tmp_path / "home"
    state_file = _saved_run(home)
    before = state_file.read_bytes()
    settings = Settings(home=home)
    cfg = PipelineConfig(backend="process", iterations=3)
    with pytest.raises(ConfigError, match=f"run {RUN_ID} exists already; continue it with --resume {RUN_ID}"):
        open_run(settings, cfg, run_id=RUN_ID, resume=False, git_revision="x")
    assert state_file.read_bytes() == before
