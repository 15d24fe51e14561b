"""Side calls (titles, memory extraction, sub-agents) of listed harnesses are left out of training.

Real lake (Parquet + DuckDB), real tree builder (clawpipe.trees.build_iteration), real trainer and, for the
pipeline stage, the real `clawpipe train` subprocess with the tiny policy.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from clawpipe import schemas, tables
from clawpipe.errors import TrainingError
from clawpipe.train.config import load_config, make_config
from clawpipe.train.loading import load_trees
from clawpipe.trees import build_iteration
from tests.trees.fixtures import call, read_tree

RUN = "run-side"
SYS = list(range(100, 124))  # the agent's system prompt (tools and all)
TITLE_SYS = list(range(200, 210))  # another system prompt: a title / memory-extraction request
SUB_SYS = list(range(300, 312))  # a sub-agent's system prompt
USER = [1, 2, 3, 4, 5]


def main_lineage(rid: str, seqs: list[int], *, tag: int = 0) -> list[dict]:
    """A multi-turn trajectory: each prompt extends the previous sequence by a tool result."""
    out, ctx = [], SYS + USER
    for k, s in enumerate(seqs):
        comp = [20 + 10 * k + tag + j for j in range(4)]
        out.append(call(f"{rid}-main{k}", rid, s, list(ctx), comp))
        ctx = ctx + comp + [60 + k, 61 + k, 62 + k]
    return out


def side_call(rid: str, seq: int, *, name: str = "side", choice: int = 0, comp: list[int] | None = None) -> dict:
    """A one-shot request under another system prompt that quotes the user's task (like a title call)."""
    return call(f"{rid}-{name}", rid, seq, TITLE_SYS + USER + [9, 9], comp or [70, 71, 72], choice=choice)


def land(lake: Path, calls: list[dict], rollouts: list[tuple[str, str, str, float]], iteration: int = 0) -> None:
    """Land calls and rollouts (rollout_id, group_id, harness, reward) and build both tree scopes."""
    crow = [{**c, "run_id": RUN, "iteration": iteration} for c in calls]
    rrow = [
        dict(rollout_id=r, run_id=RUN, iteration=iteration, group_id=g, harness=h, reward=w, status="succeeded")
        for r, g, h, w in rollouts
    ]
    tables.replace_partition(lake, "model_calls", RUN, iteration, pa.Table.from_pylist(crow, schemas.MODEL_CALLS))
    tables.replace_partition(lake, "rollouts", RUN, iteration, pa.Table.from_pylist(rrow, schemas.ROLLOUTS))
    build_iteration(lake, RUN, iteration)


def loaded_calls(lake: Path, harnesses: list[str], iteration: int = 0) -> tuple[set[str], dict[str, float]]:
    trees, _, stats = load_trees(lake, RUN, iteration, make_config(exclude_side_calls_harnesses=harnesses))
    return {s.call_id for t in trees for s in t.sequences}, stats


@pytest.mark.parametrize("side_seq", [0, 2, 3], ids=["side-first", "side-middle", "side-last"])
def test_side_call_excluded_main_lineage_kept(tmp_path, side_seq):
    """3 main turns + 1 side call with another system prompt, the side call first, in the middle or last:
    listed harness -> the side call is dropped and counted, the 3 main calls are kept; unlisted -> all 4."""
    lake = tmp_path / "lake"
    mseqs = [s for s in range(4) if s != side_seq]
    calls = [*main_lineage("r0", mseqs), side_call("r0", side_seq)]
    land(lake, calls, [("r0", "g0", "qwen-code", 1.0)])
    main_ids = {"r0-main0", "r0-main1", "r0-main2"}

    nodes = read_tree(lake, RUN, 0, "rollout:r0")
    roots = {n["token_ids"][0]: n["branch_cause"] for n in nodes if n["parent_id"] == -1}
    # the builder labels the lineage that starts LATER as 'subagent': the main one when the side call is first
    assert roots == (
        {SYS[0]: "subagent", TITLE_SYS[0]: None} if side_seq == 0 else {SYS[0]: None, TITLE_SYS[0]: "subagent"}
    )

    kept, stats = loaded_calls(lake, ["qwen-code"])
    assert kept == main_ids
    assert stats["side_calls_excluded"] == 1 and stats["calls"] == 3

    kept, stats = loaded_calls(lake, ["codex"])
    assert kept == main_ids | {"r0-side"}
    assert stats["side_calls_excluded"] == 0 and stats["calls"] == 4

    kept, stats = loaded_calls(lake, [])
    assert kept == main_ids | {"r0-side"} and stats["side_calls_excluded"] == 0


def test_title_first_and_memory_extraction_last(tmp_path):
    """A title call before the first turn AND a memory extraction after the last: both side lineages go."""
    lake = tmp_path / "lake"
    memory = call("r0-memory", "r0", 4, SUB_SYS + USER, [80, 81])
    calls = [side_call("r0", 0, name="title"), *main_lineage("r0", [1, 2, 3]), memory]
    land(lake, calls, [("r0", "g0", "qwen-code", 1.0)])
    kept, stats = loaded_calls(lake, ["qwen-code"])
    assert kept == {"r0-main0", "r0-main1", "r0-main2"}
    assert stats["side_calls_excluded"] == 2


def test_interleaved_subagent_with_more_calls_than_main(tmp_path):
    """A sub-agent lineage of 4 calls interleaved in a 2-call main trajectory (main starts and ends the
    rollout): the sub-agent's calls are the side calls even though they outnumber the main ones."""
    lake = tmp_path / "lake"
    m0, m1 = main_lineage("r0", [0, 5])
    sub, ctx = [], [*SUB_SYS, 7, 7]
    for k in range(4):
        comp = [90 + 5 * k + j for j in range(3)]
        sub.append(call(f"r0-sub{k}", "r0", k + 1, list(ctx), comp))
        ctx = ctx + comp + [95 + k]
    land(lake, [m0, *sub, m1], [("r0", "g0", "claude-code", 0.5)])
    kept, stats = loaded_calls(lake, ["claude-code"])
    assert kept == {"r0-main0", "r0-main1"}
    assert stats["side_calls_excluded"] == 4


def test_interleaved_subagent_through_a_second_proxy(tmp_path):
    """The same interleaved sub-agent, its 4 calls through a second proxy (numbered 0-3 there, as each proxy
    numbers a rollout's calls from 0): ranked by seq, the main lineage's last call (seq 1) came before the
    sub-agent's and the sub-agent would pass for the main one; ranked by time, as for any rollout whose seq
    numbers clash, the main trajectory still starts and ends the rollout."""
    lake = tmp_path / "lake"
    t0 = datetime(2026, 12, 1, tzinfo=UTC)
    m0, m1 = main_lineage("r0", [0, 1])
    m0["t_start"], m1["t_start"] = t0, t0 + timedelta(seconds=5)
    sub, ctx = [], [*SUB_SYS, 7, 7]
    for k in range(4):
        comp = [90 + 5 * k + j for j in range(3)]
        sub.append({**call(f"r0-sub{k}", "r0", k, list(ctx), comp), "t_start": t0 + timedelta(seconds=k + 1)})
        ctx = ctx + comp + [95 + k]
    land(lake, [m0, *sub, m1], [("r0", "g0", "claude-code", 0.5)])
    kept, stats = loaded_calls(lake, ["claude-code"])
    assert kept == {"r0-main0", "r0-main1"}
    assert stats["side_calls_excluded"] == 4


def test_identical_side_samples_and_main_retry(tmp_path):
    """Two choices of a side call with the same sample (the second owns no node of its own) are both dropped;
    a retry of a main turn (a 'retry' branch, not a side lineage) is kept."""
    lake = tmp_path / "lake"
    calls = main_lineage("r0", [0, 2, 3])
    calls.append(side_call("r0", 1, choice=0))
    calls.append(side_call("r0", 1, choice=1))
    calls.append(call("r0-retry", "r0", 4, calls[1]["prompt_token_ids"], [55, 56]))
    land(lake, calls, [("r0", "g0", "codex", 1.0)])
    causes = {n["branch_cause"] for n in read_tree(lake, RUN, 0, "rollout:r0")}
    assert {"retry", "subagent"} <= causes
    kept, stats = loaded_calls(lake, ["codex"])
    assert kept == {"r0-main0", "r0-main1", "r0-main2", "r0-retry"}
    assert stats["side_calls_excluded"] == 2


def group_lake(lake: Path, iteration: int = 0) -> None:
    """One group, 2 rollouts of a listed harness (main + side call each) and 2 of an unlisted one (same shape)."""
    calls, rolls = [], []
    for i, (rid, harness) in enumerate(
        [("q0", "qwen-code"), ("q1", "qwen-code"), ("c0", "chat-loop"), ("c1", "chat-loop")]
    ):
        calls += [*main_lineage(rid, [0, 2, 3], tag=i), side_call(rid, 1, comp=[70 + i, 71, 72])]
        rolls.append((rid, "g0", harness, float(i % 2)))
    land(lake, calls, rolls, iteration)


def test_group_trees_only_listed_harness_excluded(tmp_path):
    lake = tmp_path / "lake"
    group_lake(lake)
    kept, stats = loaded_calls(lake, ["qwen-code"])
    assert {c for c in kept if c.startswith("q")} == {f"q{i}-main{k}" for i in range(2) for k in range(3)}
    assert {c for c in kept if c.startswith("c")} == {
        f"c{i}-{n}" for i in range(2) for n in ("main0", "main1", "main2", "side")
    }
    assert stats["side_calls_excluded"] == 2 and stats.get("calls_not_in_tree", 0) == 0


def test_needs_rollout_trees(tmp_path):
    lake = tmp_path / "lake"
    calls = [*main_lineage("r0", [0, 1]), side_call("r0", 2)]
    crow = [{**c, "run_id": RUN, "iteration": 0} for c in calls]
    tables.replace_partition(lake, "model_calls", RUN, 0, pa.Table.from_pylist(crow, schemas.MODEL_CALLS))
    roll = [
        dict(rollout_id="r0", run_id=RUN, iteration=0, group_id="g0", harness="codex", reward=1.0, status="succeeded")
    ]
    tables.replace_partition(lake, "rollouts", RUN, 0, pa.Table.from_pylist(roll, schemas.ROLLOUTS))
    build_iteration(lake, RUN, 0, scopes=("group",))
    assert loaded_calls(lake, [])[1]["calls"] == 3
    with pytest.raises(TrainingError, match="rollout-scope trees"):
        loaded_calls(lake, ["codex"])


def test_config_field_from_toml(tmp_path):
    p = tmp_path / "train.toml"
    p.write_text('exclude_side_calls_harnesses = ["codex", "qwen-code"]\n')
    cfg = load_config(p)
    assert cfg.exclude_side_calls_harnesses == ["codex", "qwen-code"]
    assert make_config().exclude_side_calls_harnesses == []
    assert cfg.flat_params()["exclude_side_calls_harnesses"] == "['codex', 'qwen-code']"


@pytest.mark.slow
def test_pipeline_train_stage_fills_list_from_manifests_and_step_reports_count(home, tmp_path):
    """The pipeline's train stage lists the harnesses whose manifest says exclude_side_calls = true (qwen-code,
    not chat-loop); the real trainer subprocess then drops their side calls and reports the count."""
    from clawpipe.config import get_settings
    from clawpipe.pipeline import stages
    from clawpipe.pipeline.config import HarnessEntry, PipelineConfig
    from clawpipe.serving.policy import init_policy

    settings = get_settings()
    group_lake(Path(settings.lake_dir))
    policy = init_policy(tmp_path / "policy", size="tiny", seed=0)
    harnesses = [HarnessEntry(name="qwen-code", task_set="fixit"), HarnessEntry(name="chat-loop", task_set="guess")]
    cfg = PipelineConfig(harnesses=harnesses, train={"learning_rate": 1e-3})
    out = tmp_path / "out"
    result = stages.train(cfg, settings, RUN, 0, policy_dir=policy, out_dir=out)
    written = json.loads((out / "train-config-0.json").read_text())  # the whole config the trainer ran with
    assert written["learning_rate"] == 1e-3 and written["exclude_side_calls_harnesses"] == ["qwen-code"]
    m = result["metrics"]
    assert m["load/side_calls_excluded"] == 2
    assert m["load/calls"] == m["sequences"] == 14  # 4 rollouts x 3 main calls + the 2 unlisted side calls
    assert result["policy_version"] == 1

    # a user's own setting wins over the manifests
    cfg = PipelineConfig(harnesses=harnesses, train={"learning_rate": 1e-3, "exclude_side_calls_harnesses": []})
    stages_out = tmp_path / "out2"
    result = stages.train(cfg, settings, RUN, 0, policy_dir=policy, out_dir=stages_out)
    assert json.loads((stages_out / "train-config-0.json").read_text())["exclude_side_calls_harnesses"] == []
    assert result["metrics"]["load/side_calls_excluded"] == 0
    assert json.loads((stages_out / "metrics-0.json").read_text())["metrics"]["load/calls"] == 16
