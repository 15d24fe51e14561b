"""Two iterations of a mix-harness pipeline through the four real CLIs and one reference harness.

`clawpipe run` end to end (Prefect, local engine with the tiny policy, proxy, bwrap sandboxes, lake, trees,
trainer, publish, MLflow): Claude Code, Codex, Qwen Code and OpenClaw (minimal modes) and chat-loop all
play ``say``, whose graded reward differs between the garbage replies of the untrained policy, so every
group has reward variance. Checked from the run summary, the trainer's metrics and the lake: each
iteration's optimizer step trained sequences of every harness, every model call a sandbox made landed
exactly once with the engine's token ids, and the summary (printed, and in MLflow) reports per harness its
rollouts, reward mean and std, calls, prompt and completion tokens, drift branches and spliced tokens,
equal to the lake's.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawpipe import capture, tables
from clawpipe.lake.query import run_audits

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]

HARNESSES = ("claude-code", "codex", "qwen-code", "openclaw", "chat-loop")
SAMPLES = 2
# The config harnesses/REAL_HARNESSES.md shows for this run (keep the two the same).
CONFIG = """
run_name = "mix"
experiment = "mix-real"
iterations = 2
groups = 1
samples = 2
eval_tasks = 0
concurrency = 10
backend = "bwrap"
rollout_timeout_s = 240
train = { learning_rate = 0.002, epochs = 1 }
[[harnesses]]
name = "claude-code"
task_set = "say"
[[harnesses]]
name = "codex"
task_set = "say"
[[harnesses]]
name = "qwen-code"
task_set = "say"
[[harnesses]]
name = "openclaw"
task_set = "say"
[[harnesses]]
name = "chat-loop"
task_set = "say"
"""


@pytest.fixture(scope="module")
def mix_run(tmp_path_factory: pytest.TempPathFactory, cli_installed: None) -> tuple[dict, Path, str, float]:
    """The run's summary, CLAWPIPE_HOME, printed output and wall seconds (one run for every test here)."""
    tmp = tmp_path_factory.mktemp("mix")
    home = tmp / "home"
    cfg = tmp / "mix.toml"
    cfg.write_text(CONFIG)
    summary_path = tmp / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(CLAWPIPE_HOME=str(home), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--config", str(cfg), "--summary-out", str(summary_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    seconds = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads(summary_path.read_text()), home, out.stdout, seconds


def test_each_iteration_trains_every_harness_with_reward_variance(mix_run: tuple[dict, Path, str, float]) -> None:
    summary, home, _, seconds = mix_run
    print(f"mix run: {seconds:.0f} s wall, {summary['seconds']:.0f} s of loop")
    assert [it["iteration"] for it in summary["iterations"]] == [0, 1]
    assert summary["iterations"][-1]["policy_version"] == 2
    con = tables.connect(home / "lake")
    for it in summary["iterations"]:
        assert {h: v["n"] for h, v in it["by_harness"].items()} == dict.fromkeys(HARNESSES, SAMPLES)
        assert set(it["statuses"]) <= {"succeeded", "failed"}, it["statuses"]  # ended by themselves
        train = it["train"]
        for h in HARNESSES:
            # the step's own figures: this harness's rewards differ and its sequences were trained
            assert train[f"reward/std/{h}"] > 0, (it["iteration"], h, train)
            assert train[f"sequences/{h}"] > 0, (it["iteration"], h, train)
            assert it["by_harness"][h]["trained_sequences"] == train[f"sequences/{h}"]
        # the lake agrees: per harness, rewards differ within the group and its rollouts have tree sequences
        # with generated tokens, which the step trained (sequences counted per rollout first: joined row by row,
        # a rollout with two sequences would weigh twice in the std)
        rows = con.sql(
            "select r.harness, stddev_pop(r.reward), coalesce(sum(s.n), 0) from rollouts r left join ("
            "select rollout_id, iteration, count(distinct call_id) n from tree_sequences "
            "where scope = 'rollout' and n_generated > 0 group by all) s using (rollout_id, iteration) "
            "where r.run_id = $r and r.iteration = $i group by 1 order by 1",
            params={"r": summary["run_id"], "i": it["iteration"]},
        ).fetchall()
        assert [h for h, _, _ in rows] == sorted(HARNESSES)
        for h, std, n_seqs in rows:
            assert std == pytest.approx(train[f"reward/std/{h}"]) and std > 0
            assert n_seqs >= train[f"sequences/{h}"] > 0


def test_every_call_lands_exactly_once_with_the_engine_ids(mix_run: tuple[dict, Path, str, float]) -> None:
    summary, home, _, _ = mix_run
    run_id = summary["run_id"]
    con = tables.connect(home / "lake")
    # the sandbox bridge counts each rollout's HTTP requests on its own; the lake holds one call for each
    per_rollout = con.sql(
        "select r.harness, r.rollout_id, r.n_calls, count(c.call_id) filter (where c.choice_index = 0), "
        "bool_and(c.status = 'ok' and c.http_status = 200 and c.token_source = 'upstream' "
        "and len(c.prompt_token_ids) > 0 and len(c.completion_token_ids) > 0) "
        "from rollouts r left join model_calls c using (run_id, iteration, rollout_id) "
        "where r.run_id = $r group by all order by all",
        params={"r": run_id},
    ).fetchall()
    assert len(per_rollout) == len(HARNESSES) * SAMPLES * 2
    for harness, rollout_id, bridged, landed, clean in per_rollout:
        assert landed == bridged >= 1, (harness, rollout_id, bridged, landed)
        assert clean, (harness, rollout_id)  # no 404'd side call, no re-encoded prompt
    # what the proxy captured is what landed: the same call ids, none twice, nothing rejected
    captured = []
    for seg in sorted((home / "captures").rglob("*.seg")):
        captured += [r.header["call_id"] for r in capture.read_segment(seg) if isinstance(r, capture.CaptureRecord)]
    landed_ids = [
        cid
        for (cid,) in con.sql(
            "select call_id from model_calls where choice_index = 0 and run_id = $r", params={"r": run_id}
        ).fetchall()
    ]
    assert len(captured) == len(set(captured)) and sorted(captured) == sorted(landed_ids)
    assert sum(n for _, _, n, _, _ in per_rollout) == len(landed_ids)
    failing = {name: t.num_rows for name, t in run_audits(home / "lake").items() if t.num_rows}
    assert failing == {}
    assert con.sql("select count(*) from rejects").fetchall() == [(0,)]


def test_summary_shows_per_harness_tokens_and_drift(mix_run: tuple[dict, Path, str, float]) -> None:
    summary, home, printed, _ = mix_run
    con = tables.connect(home / "lake")
    params = {"r": summary["run_id"]}
    calls = con.sql(
        "select r.harness, r.iteration, count(*), sum(c.prompt_tokens), sum(c.spliced_tokens) "
        "from rollouts r join model_calls c using (run_id, iteration, rollout_id) "
        "where r.run_id = $r and c.choice_index = 0 group by all",
        params=params,
    ).fetchall()

    def by_harness_iteration(sql: str) -> dict[tuple[str, int], float]:
        return {(h, i): n for h, i, n in con.sql(sql, params=params).fetchall()}

    completion = by_harness_iteration(
        "select r.harness, r.iteration, sum(c.completion_tokens) "
        "from rollouts r join model_calls c using (run_id, iteration, rollout_id) where r.run_id = $r group by all"
    )
    drift = by_harness_iteration(
        "select r.harness, r.iteration, sum(t.branches_drift) from rollouts r join tree_stats t "
        "using (run_id, iteration, rollout_id) where r.run_id = $r and t.scope = 'rollout' group by all"
    )
    lake = {(h, i): (n, p, completion[(h, i)], drift[(h, i)], sp) for h, i, n, p, sp in calls}
    for it in summary["iterations"]:
        for h, v in it["by_harness"].items():
            got = (v["calls"], v["prompt_tokens"], v["completion_tokens"], v["drift_branches"], v["spliced_tokens"])
            assert got == lake[(h, it["iteration"])], (h, it["iteration"])
            assert v["prompt_tokens"] > 0 and v["completion_tokens"] > 0 and v["reward_std"] > 0
    # logged to the run's MLflow run, per iteration (step)
    db = sqlite3.connect(home / "mlflow.db")
    try:
        logged = dict(
            ((key, step), value)
            for key, step, value in db.execute(
                "select m.key, m.step, m.value from metrics m join runs r on r.run_uuid = m.run_uuid "
                "where r.run_uuid = ? and m.key like 'harness/%'",
                (summary["mlflow_run_id"],),
            )
        )
    finally:
        db.close()
    for it in summary["iterations"]:
        for h, v in it["by_harness"].items():
            for key in ("prompt_tokens", "completion_tokens", "drift_branches", "spliced_tokens", "trained_sequences"):
                assert logged[(f"harness/{h}/{key}", it["iteration"])] == v[key], (h, key)
    # printed by `clawpipe run`: one row per harness over the run, with the same sums
    table = printed.split("Per harness, all iterations:", 1)[1]
    for h in HARNESSES:
        row = re.search(rf"^\| {re.escape(h)} \| (.*) \|$", table, re.M)
        assert row, (h, table[:2000])
        cells = [c.strip() for c in row.group(1).split("|")]
        rollouts, _mean, std, calls, prompt, completion, drift, spliced, trained = cells
        sums = [sum(lake[(h, i)][k] for i in (0, 1)) for k in range(5)]
        assert int(rollouts) == 2 * SAMPLES and float(std) > 0
        assert [int(calls), int(prompt), int(completion), int(drift), int(spliced)] == sums
        assert int(trained) > 0
    print(printed[printed.index("| harness |") :][:1500])
