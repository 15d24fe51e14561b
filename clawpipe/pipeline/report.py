"""What a run reports: the summary of each iteration, its metrics and markdown, and the run's final summary.

Functions over the stages' results, so the flow only wires them and the tests need no Prefect. The one
read: each iteration's figures per harness (rollouts, reward mean and std, calls, prompt and completion
tokens, spliced tokens, drift and rewrite branches; sql/pipeline/harness_summary.sql) come from the lake,
beside the sequences the training step took of each harness (its ``sequences/<harness>`` metric).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import duckdb

from clawpipe.errors import LakeError
from clawpipe.pipeline.state import RunState

log = logging.getLogger(__name__)

_TRAIN_PREFIXES = ("loss/", "reward/", "kl", "entropy", "sequences/")
# Per-harness figures of an iteration, from the lake (the SQL's columns besides harness and rollouts).
HARNESS_FIELDS = (
    "reward_std",
    "calls",
    "prompt_tokens",
    "completion_tokens",
    "spliced_tokens",
    "drift_branches",
    "rewrite_branches",
)


def harness_details(lake_dir: str | Path, run_id: str, iteration: int) -> dict[str, dict[str, Any]]:
    """Per harness, one run iteration's training rollouts from the lake: HARNESS_FIELDS (and ``rollouts``)."""
    from clawpipe.sqlfiles import sql_text
    from clawpipe.tables import connect

    con = connect(lake_dir, tables=("model_calls", "rollouts", "tree_stats"), partition=(run_id, int(iteration)))
    try:
        rel = con.sql(sql_text("pipeline/harness_summary"), params={"run_id": run_id, "iteration": int(iteration)})
        names = rel.columns
        rows = rel.fetchall()
    finally:
        con.close()
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        values = dict(zip(names, row, strict=True))
        harness = str(values.pop("harness"))
        values.pop("reward_mean")  # the rollouts' own summary has it (failed rollouts counted alike)
        # the std as computed: rounded, two rewards 1e-5 apart (a learning signal) would read as none
        out[harness] = {k: (float(v) if k == "reward_std" else int(v)) for k, v in values.items()}
    return out


def _by_harness(
    rollouts: dict[str, Any], trees: dict[str, Any], trained: dict[str, Any], lake_dir: str | Path | None
) -> dict[str, dict[str, Any]]:
    """The rollouts' per-harness counts and rewards with the lake's figures and the step's sequences merged
    in. The lake is read when the reconstruction summary names its run and iteration; a lake that cannot be
    read leaves the figures out (logged), never the iteration."""
    by_harness = {h: dict(v) for h, v in rollouts["by_harness"].items()}
    if trees.get("run_id") is not None and trees.get("iteration") is not None:
        if lake_dir is None:
            from clawpipe.config import get_settings

            lake_dir = get_settings().lake_dir
        try:
            details = harness_details(lake_dir, str(trees["run_id"]), int(trees["iteration"]))
        except (duckdb.Error, LakeError, OSError) as exc:
            log.warning("per-harness figures of %s iteration %s left out: %s", trees["run_id"], trees["iteration"], exc)
            details = {}
        for harness, figures in details.items():
            entry = by_harness.setdefault(harness, {"n": figures["rollouts"], "reward_mean": 0.0})
            entry.update({k: figures[k] for k in HARNESS_FIELDS})
    metrics = trained.get("metrics", {})
    for harness, entry in by_harness.items():
        if f"sequences/{harness}" in metrics:
            entry["trained_sequences"] = int(metrics[f"sequences/{harness}"])
    return by_harness


def iteration_summary(
    iteration: int,
    *,
    rollouts: dict[str, Any],
    trees: dict[str, Any],
    trained: dict[str, Any],
    policy_version: int,
    evaluation: dict[str, Any] | None,
    seconds: float,
    lake_dir: str | Path | None = None,
) -> dict[str, Any]:
    """One iteration in a JSON-ready dict: rewards (train and eval), statuses, tree sizes, train metrics, and
    per harness its rollouts' figures from the lake (``lake_dir``, default the project's; see _by_harness)."""
    return {
        "iteration": iteration,
        "reward_mean": rollouts["reward_mean"],
        "by_harness": _by_harness(rollouts, trees, trained, lake_dir),
        "statuses": rollouts["statuses"],
        "eval_reward_mean": _mode(evaluation, "greedy"),
        "eval_sampled_reward_mean": _mode(evaluation, "sampled"),
        "eval_by_harness": evaluation["by_harness"] if evaluation else None,
        "policy_version": policy_version,
        "policy_dir": trained["checkpoint"],
        "trees": {
            k: trees.get(k) for k in ("n_trees", "flattened_tokens", "unique_tokens", "drift_count", "spliced_tokens")
        },
        "train": {k: v for k, v in trained.get("metrics", {}).items() if k.startswith(_TRAIN_PREFIXES)},
        "seconds": round(seconds, 1),
    }


def _mode(evaluation: dict[str, Any] | None, mode: str) -> float | None:
    return evaluation.get("by_mode", {}).get(mode) if evaluation else None


def iteration_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of one iteration: reward overall and per harness, eval reward, wall time."""
    metrics = {"reward/mean": summary["reward_mean"], "iteration/seconds": summary["seconds"]}
    for harness, v in summary["by_harness"].items():
        metrics[f"reward/{harness}"] = v["reward_mean"]
        for key in (*HARNESS_FIELDS, "trained_sequences"):
            if v.get(key) is not None:
                metrics[f"harness/{harness}/{key}"] = float(v[key])
    for key, name in (("eval_reward_mean", "eval/reward_greedy"), ("eval_sampled_reward_mean", "eval/reward_sampled")):
        if summary.get(key) is not None:
            metrics[name] = summary[key]
    for harness, v in (summary["eval_by_harness"] or {}).items():
        metrics[f"eval/reward/{harness}"] = v["reward_mean"]
    metrics.update(overlap_metrics(summary.get("overlap")))
    for key in ("drift_count", "spliced_tokens"):  # prompt ids re-encoded apart from / carried over from sampling
        if (summary.get("trees") or {}).get(key) is not None:
            metrics[f"trees/{key}"] = float(summary["trees"][key])
    return metrics


def overlap_metrics(overlap: dict[str, Any] | None) -> dict[str, float]:
    """An async step's staleness and waits: calls per age (``staleness/age_<a>``, the step's histogram),
    calls trained and dropped, oldest and mean trained age, the seconds each side waited for the other and
    the seconds the step's publish waited for the previous step's evaluation (``wait/publish_s``)."""
    if not overlap:
        return {}
    metrics = {f"staleness/age_{age}": float(n) for age, n in overlap["ages"].items()}
    for key in ("trained_calls", "dropped_calls", "max_age", "mean_age"):
        metrics[f"staleness/{key}"] = float(overlap[key])
    metrics["staleness/skipped_step"] = float(bool(overlap.get("skipped")))
    for key in ("trainer_wait_s", "producer_wait_s", "publish_wait_s"):
        if overlap.get(key) is not None:
            metrics[f"wait/{key[:-7]}_s"] = float(overlap[key])
    return metrics


def reward_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the per-harness reward table artifact (with the lake's figures where the summary has them)."""
    return [
        {
            "harness": h,
            "rollouts": v["n"],
            "reward_mean": round(v["reward_mean"], 4),
            **{k: v[k] for k in (*HARNESS_FIELDS, "trained_sequences") if k in v},
        }
        for h, v in summary["by_harness"].items()
    ]


HARNESS_HEADER = (
    "| harness | rollouts | reward mean | reward std | calls | prompt tokens | completion tokens | "
    "drift branches | spliced tokens | trained sequences |\n|---|---|---|---|---|---|---|---|---|---|"
)


def harness_row(harness: str, v: dict[str, Any]) -> str:
    """One markdown row of the per-harness table; figures the summary lacks show as blank cells."""
    cells = [v.get(k) for k in ("calls", "prompt_tokens", "completion_tokens", "drift_branches", "spliced_tokens")]
    std = "" if v.get("reward_std") is None else f"{v['reward_std']:.3f}"
    rest = " | ".join("" if c is None else str(c) for c in [*cells, v.get("trained_sequences")])
    return f"| {harness} | {v['n']} | {v['reward_mean']:.3f} | {std} | {rest} |"


def run_harness_table(its: list[dict[str, Any]]) -> str:
    """Per harness over the whole run: rollouts and figures summed, reward mean and std of the rollouts
    pooled (from each iteration's mean and std); '' when no iteration has the lake's figures."""
    totals: dict[str, dict[str, Any]] = {}
    for s in its:
        for h, v in s["by_harness"].items():
            if "calls" not in v:
                continue
            t = totals.setdefault(h, {"n": 0, "sum": 0.0, "sumsq": 0.0})
            n, mean, std = v["n"], v["reward_mean"], v.get("reward_std") or 0.0
            t["n"] += n
            t["sum"] += n * mean
            t["sumsq"] += n * (std * std + mean * mean)
            for k in ("calls", "prompt_tokens", "completion_tokens", "drift_branches", "spliced_tokens"):
                t[k] = t.get(k, 0) + int(v.get(k) or 0)
            if v.get("trained_sequences") is not None:
                t["trained_sequences"] = t.get("trained_sequences", 0) + int(v["trained_sequences"])
    if not totals:
        return ""
    rows = []
    for h, t in totals.items():
        mean = t["sum"] / t["n"] if t["n"] else 0.0
        var = max(0.0, t["sumsq"] / t["n"] - mean * mean) if t["n"] else 0.0
        rows.append(harness_row(h, {**t, "reward_mean": mean, "reward_std": var**0.5}))
    return f"Per harness, all iterations:\n\n{HARNESS_HEADER}\n" + "\n".join(rows) + "\n\n"


def iteration_markdown(run_id: str, summary: dict[str, Any], mlflow_run_id: str | None, example: dict[str, Any]) -> str:
    """The markdown artifact of one iteration, with the most branched rollout tree when there is one."""
    rows = "\n".join(harness_row(h, v) for h, v in summary["by_harness"].items())
    tree = ""
    if example:
        text = "\n".join(example["text"].splitlines()[:40])
        tree = (
            f"## Tree `{example['tree_id']}` (most branched rollout)\n\n```\n{text}\n```\n\n"
            f"HTML: `{example['html']}`; any tree: `clawpipe trees show <tree_id> --format html`.\n"
        )
    return (
        f"# {run_id}, iteration {summary['iteration']}\n\n"
        f"MLflow run: `{mlflow_run_id}` (experiment in the MLflow UI)\n\n"
        f"{HARNESS_HEADER}\n{rows}\n\n"
        f"policy_version now {summary['policy_version']}; trees {summary['trees']}.\n\n{tree}"
    )


def change(first: float, later: float) -> str:
    """How ``later`` compares with ``first``: a ratio where the first is positive, a difference otherwise."""
    if first > 0:
        return f"x{later / first:.2f}"
    return f"{later - first:+.3f}"


def final_summary(state: RunState, seconds: float) -> dict[str, Any]:
    """Reward curve (train and greedy eval), first vs last, peak memory; as dict and markdown."""
    its = state.completed
    lines = [
        "| iteration | reward (train) | reward (eval, sampled) | reward (eval, greedy) | per harness |",
        "|---|---|---|---|---|",
    ]
    for s in its:
        per = ", ".join(f"{h} {v['reward_mean']:.3f}" for h, v in s["by_harness"].items())
        sampled, greedy = (_cell(s.get(k)) for k in ("eval_sampled_reward_mean", "eval_reward_mean"))
        lines.append(f"| {s['iteration']} | {s['reward_mean']:.3f} | {sampled} | {greedy} | {per} |")
    first = its[0]["reward_mean"] if its else 0.0
    last = its[-1]["reward_mean"] if its else 0.0
    tail = [s["reward_mean"] for s in its[-3:]]
    last3 = sum(tail) / len(tail) if tail else 0.0
    evals = [s["eval_sampled_reward_mean"] for s in its if s.get("eval_sampled_reward_mean") is not None]
    held_out = f"held-out (sampled) first {evals[0]:.3f} -> last {evals[-1]:.3f}; " if evals else ""
    steps = [s["overlap"] for s in its if s.get("overlap")]
    if steps:
        dropped = sum(o["dropped_calls"] for o in steps)
        age = max(o["max_age"] for o in steps)
        held_out += (
            f"async: oldest trained call {age} version{'' if age == 1 else 's'} behind, {dropped} stale calls "
            f"dropped, trainer waited {sum(o['trainer_wait_s'] for o in steps):.0f} s; "
        )
    md = (
        f"# clawpipe run {state.run_id}\n\n"
        + "\n".join(lines)
        + "\n\n"
        + run_harness_table(its)
        + f"reward first {first:.3f} -> last {last:.3f} ({change(first, last)}; mean of the last 3 iterations "
        f"{last3:.3f}, {change(first, last3)}); {held_out}"
        f"policy_version {state.policy_version}; peak memory of all processes {state.peak_memory_mb:.0f} MB; "
        f"{seconds:.0f} s. MLflow run {state.mlflow_run_id}.\n"
    )
    return {
        "run_id": state.run_id,
        "first_reward": first,
        "last_reward": last,
        "last3_reward": last3,
        "eval_sampled_first": evals[0] if evals else None,
        "eval_sampled_last": evals[-1] if evals else None,
        "iterations": its,
        "peak_memory_mb": state.peak_memory_mb,
        "mlflow_run_id": state.mlflow_run_id,
        "seconds": seconds,
        "markdown": md,
    }


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def slug(text: str) -> str:
    """A Prefect artifact key part: lower-case letters, digits and dashes, at most 40 characters."""
    return "".join(c if c.isalnum() else "-" for c in text.lower())[:40]
