"""A run reruns from its MLflow record alone: ``clawpipe run --config`` of the ``config.toml`` artifact
downloaded with the MLflow client runs the same config (the same params), and a harness edited since the
first run is named in a warning while the rerun still runs, its new content hash in its tags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
run_name = "first"
experiment = "rerun"
iterations = 1
groups = 1
samples = 2
eval_tasks = 0
concurrency = 2
backend = "process"
train = { learning_rate = 0.002, epochs = 1 }

[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


def _run(work: Path, home: Path, config: Path, summary: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    env.update({"CLAWPIPE_HOME": str(home), "PYTHONUNBUFFERED": "1"})
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--config", str(config), "--summary-out", str(summary)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


def test_a_run_reruns_from_its_config_artifact_and_an_edited_harness_is_named(tmp_path: Path) -> None:
    import mlflow

    work, home = tmp_path / "work", tmp_path / "home"
    for name in ("chat-loop", "_kit"):  # ./harnesses is searched first: these copies are the ones run
        shutil.copytree(ROOT / "harnesses" / name, work / "harnesses" / name, ignore=shutil.ignore_patterns("*.pyc"))
    (work / "first.toml").write_text(CONFIG)
    _run(work, home, work / "first.toml", tmp_path / "1.json")
    first = json.loads((tmp_path / "1.json").read_text())
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{home.resolve() / 'mlflow.db'}")
    artifact = Path(client.download_artifacts(first["mlflow_run_id"], "config.toml", str(tmp_path)))
    with open(work / "harnesses" / "chat-loop" / "harness.py", "a") as f:
        f.write("\n# an edit between the two runs\n")
    out = _run(work, home, artifact, tmp_path / "2.json")
    second = json.loads((tmp_path / "2.json").read_text())
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and f"harness chat-loop is not what run {first['run_id']} used" in warned[0], out.stderr
    assert [s["iteration"] for s in second["iterations"]] == [0]  # warned, not refused
    a, b = (client.get_run(r["mlflow_run_id"]).data for r in (first, second))
    for params, run in ((a.params, first), (b.params, second)):
        assert params.pop("run_id") == run["run_id"]
        params.pop("git_revision")  # the checkout may have moved on between the two runs; it is a tag too
    assert a.params == b.params and a.params["run_name"] == "first" and a.params["iterations"] == "1"
    key = "clawpipe.harness.chat-loop.sha256"
    assert a.tags[key] != b.tags[key] and a.tags["clawpipe.harness_kit.sha256"] == b.tags["clawpipe.harness_kit.sha256"]
    assert a.tags["clawpipe.policy.origin"] == "built tiny seed 0" == b.tags["clawpipe.policy.origin"]
    assert a.tags["clawpipe.policy.sha256"] == b.tags["clawpipe.policy.sha256"]
    # the printed summary, and the trained policy it ended with, to serve or start another run from
    summary_md = Path(client.download_artifacts(first["mlflow_run_id"], "summary.md", str(tmp_path / "md")))
    assert summary_md.read_text() == first["markdown"] and "| iteration |" in first["markdown"]
    assert a.tags["clawpipe.final_policy.version"] == "1"
    assert (Path(a.tags["clawpipe.final_policy.dir"]) / "config.json").is_file()
    assert a.tags["clawpipe.final_policy.dir"].startswith(a.tags["clawpipe.run_dir"])
