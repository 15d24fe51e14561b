"""What a run reports: the summary of each iteration, its metrics and markdown, and the run's final summary.

Pure functions over the stages' results, so the flow only wires them and the tests need no Prefect.
"""

from __future__ import annotations

from typing import Any

from clawpipe.pipeline.state import RunState

_TRAIN_PREFIXES = ("loss/", "reward/", "kl", "entropy")


def iteration_summary(
    iteration: int,
    *,
    rollouts: dict[str, Any],
    trees: dict[str, Any],
    trained: dict[str, Any],
    policy_version: int,
    evaluation: dict[str, Any] | None,
    seconds: float,
) -> dict[str, Any]:
    """One iteration in a JSON-ready dict: rewards (train and eval), statuses, tree sizes, train metrics."""
    return {
        "iteration": iteration,
        "reward_mean": rollouts["reward_mean"],
        "by_harness": rollouts["by_harness"],
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
    calls trained and dropped, oldest and mean trained age, and the seconds each side waited for the other."""
    if not overlap:
        return {}
    metrics = {f"staleness/age_{age}": float(n) for age, n in overlap["ages"].items()}
    for key in ("trained_calls", "dropped_calls", "max_age", "mean_age"):
        metrics[f"staleness/{key}"] = float(overlap[key])
    metrics["staleness/skipped_step"] = float(bool(overlap.get("skipped")))
    for key in ("trainer_wait_s", "producer_wait_s"):
        if overlap.get(key) is not None:
            metrics[f"wait/{key[:-7]}_s"] = float(overlap[key])
    return metrics


def reward_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the per-harness reward table artifact."""
    return [
        {"harness": h, "rollouts": v["n"], "reward_mean": round(v["reward_mean"], 4)}
        for h, v in summary["by_harness"].items()
    ]


def iteration_markdown(run_id: str, summary: dict[str, Any], mlflow_run_id: str | None, example: dict[str, Any]) -> str:
    """The markdown artifact of one iteration, with the most branched rollout tree when there is one."""
    rows = "\n".join(f"| {h} | {v['n']} | {v['reward_mean']:.3f} |" for h, v in summary["by_harness"].items())
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
        f"| harness | rollouts | reward |\n|---|---|---|\n{rows}\n\n"
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
        held_out += (
            f"async: oldest trained call {max(o['max_age'] for o in steps)} versions behind, {dropped} stale calls "
            f"dropped, trainer waited {sum(o['trainer_wait_s'] for o in steps):.0f} s; "
        )
    md = (
        f"# clawpipe run {state.run_id}\n\n" + "\n".join(lines) + "\n\n"
        f"reward first {first:.3f} -> last {last:.3f} ({change(first, last)}; mean of the last 3 iterations "
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
