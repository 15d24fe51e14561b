"""One iteration of a mix-harness pipeline through two real CLIs and one reference harness.

`clawpipe run` end to end (Prefect, local engine with the tiny policy, proxy, bwrap sandboxes, lake, trees,
trainer, publish): Claude Code and Codex play `fixit` in their minimal modes, chat-loop plays `guess`.
The tiny policy earns nothing on fixit; what is checked is that every rollout of every harness ends by
itself, their calls land with the engine's token ids, trees build, and the policy is trained once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawpipe import tables

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

CONFIG = """
run_name = "mix"
experiment = "mix-real"
iterations = 1
groups = 1
samples = 2
eval_tasks = 0
concurrency = 6
backend = "bwrap"
rollout_timeout_s = 240
train = { learning_rate = 0.002, epochs = 1 }
[[harnesses]]
name = "claude-code"
task_set = "fixit"
[[harnesses]]
name = "codex"
task_set = "fixit"
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


def test_one_mix_harness_iteration_through_real_clis(tmp_path: Path, cli_installed: None) -> None:
    home = tmp_path / "home"
    cfg = tmp_path / "mix.toml"
    cfg.write_text(CONFIG)
    summary_path = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(CLAWPIPE_HOME=str(home), PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--config", str(cfg), "--summary-out", str(summary_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads(summary_path.read_text())
    [it] = summary["iterations"]
    assert {h: v["n"] for h, v in it["by_harness"].items()} == {"claude-code": 2, "codex": 2, "chat-loop": 2}
    assert set(it["statuses"]) <= {"succeeded", "failed"}, it["statuses"]  # ended by themselves
    assert it["policy_version"] == 1
    con = tables.connect(home / "lake")
    rows = con.sql(
        "select r.harness, count(*), bool_and(c.token_source = 'upstream'), bool_and(len(c.prompt_token_ids) > 0) "
        "from model_calls c join rollouts r using (run_id, iteration, rollout_id) "
        "where c.run_id = $r group by 1 order by 1",
        params={"r": summary["run_id"]},
    ).fetchall()
    assert [(h, ok_src, ok_ids) for h, _, ok_src, ok_ids in rows] == [
        ("chat-loop", True, True),
        ("claude-code", True, True),
        ("codex", True, True),
    ]
    assert all(n >= 2 for _, n, _, _ in rows), rows  # at least one call per rollout
    trees = con.sql(
        "select count(distinct rollout_id) from tree_stats where run_id = $r and scope = 'rollout'",
        params={"r": summary["run_id"]},
    ).fetchall()
    assert trees == [(6,)]
