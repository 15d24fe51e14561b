"""Pipeline config: defaults are valid, bad input fails before anything starts and names the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clawpipe.errors import ConfigError
from clawpipe.pipeline.config import PipelineConfig, load_config
from clawpipe.pipeline.stages import summarize_results


def test_defaults_train_through_two_harnesses() -> None:
    cfg = load_config()
    assert len({h.name for h in cfg.harnesses}) >= 2
    assert cfg.backend == "bwrap"


def test_toml_and_overrides(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    p.write_text('iterations = 3\nbackend = "process"\n[[harnesses]]\nname = "chat-loop"\ntask_set = "guess"\n')
    cfg = load_config(p, iterations=5)
    assert cfg.iterations == 5 and cfg.backend == "process" and [h.name for h in cfg.harnesses] == ["chat-loop"]


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('backend = "chroot"', "backend"),
        ("samples = 1", "samples"),
        ("iterations = 0", "iterations"),
        ("bogus = 1", "bogus"),
        ('[[harnesses]]\nname = "x"\n', "harnesses.0.task_set"),
        ("train = { learning_rate = -1.0 }", "learning_rate"),
        ('train = { algorithm = "dpo" }', "algorithm"),
        ('[[harnesses]]\nname = "chat-loop"\ntask_set = "guess"\nenv = { CLAWPIPE_TASK = "x" }', "may not set"),
        ('[[harnesses]]\nname = "chat-loop"\ntask_set = "guess"\nenv = { "1X" = "x" }', "harnesses.0.env"),
    ],
)
def test_invalid_config_names_the_field(tmp_path: Path, toml: str, field: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(toml + "\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert field in str(exc.value)


def test_cli_rejects_bad_config_before_starting(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('backend = "chroot"\n')
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--config", str(p)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "backend" in out.stderr and "bwrap" in out.stderr
    assert "prefect" not in out.stderr.lower()  # nothing started


def test_cli_mode_override_is_validated_before_starting() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--mode", "later"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "mode" in out.stderr and "async" in out.stderr
    assert "prefect" not in out.stderr.lower()


def test_unknown_harness_and_task_set_pairing_is_rejected() -> None:
    from clawpipe.pipeline.stages import check_prerequisites

    cfg = PipelineConfig.model_validate(
        {"harnesses": [{"name": "chat-loop", "task_set": "calc"}], "backend": "process"}
    )
    with pytest.raises(ConfigError, match="does not support task set"):
        check_prerequisites(cfg)


def test_summarize_results_counts_failures_as_zero() -> None:
    rows = [
        {"harness": "a", "status": "succeeded", "reward": 1.0},
        {"harness": "a", "status": "timeout", "reward": None},
        {"harness": "b", "status": "infra_error", "reward": None},
    ]
    s = summarize_results(rows)
    assert s["by_harness"] == {"a": {"n": 2, "reward_mean": 0.5}}
    assert s["statuses"] == {"succeeded": 1, "timeout": 1, "infra_error": 1}


def test_missing_sandbox_tool_names_the_fix(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path), "CLAWPIPE_HOME": str(tmp_path / "home")}  # no bwrap on this PATH
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", "--iterations", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert "apt-get install -y bubblewrap" in out.stderr and "backend" in out.stderr
    assert not (tmp_path / "home" / "runs").exists()  # nothing started


def test_rollout_ids_are_unique_within_a_run() -> None:
    from clawpipe.pipeline.stages import sample_specs

    cfg = load_config(groups=6, samples=3)
    specs = [s for it in range(4) for s in sample_specs(cfg, "run", it, policy_version=it)]
    specs += [s for it in range(4) for s in sample_specs(cfg, "run", it, policy_version=it, evaluation=True)]
    ids = [s.id for s in specs]
    assert len(ids) == len(set(ids)) == 4 * (6 * 3 * 2 + cfg.eval_tasks * (1 + cfg.eval_samples) * 2)
    groups = {s.group_id for s in specs if not s.eval}
    assert len(groups) == 4 * 6 * 2  # a group is one task for one harness in one iteration
    greedy = [s for s in specs if s.eval and s.group_id.startswith("eval.greedy.")]
    assert len(greedy) == 4 * cfg.eval_tasks * 2
    assert all(s.task["sampling"]["temperature"] == 0.0 for s in greedy)


def test_harness_entry_env_reaches_the_rollouts_over_the_manifest_env(tmp_path: Path) -> None:
    from clawpipe.pipeline.stages import sample_specs
    from clawpipe.sandbox.manifest import find_harness

    p = tmp_path / "p.toml"
    p.write_text(
        '[[harnesses]]\nname = "claude-code"\ntask_set = "fixit"\nenv = { CLAWPIPE_CLI_MODE = "full", X_EXTRA = "1" }\n'
        '[[harnesses]]\nname = "chat-loop"\ntask_set = "guess"\n'
    )
    specs = sample_specs(load_config(p), "run", 0, policy_version=0)
    cli = [s.harness for s in specs if getattr(s.harness, "name", None) == "claude-code"]
    assert cli and all(m.env["CLAWPIPE_CLI_MODE"] == "full" and m.env["X_EXTRA"] == "1" for m in cli)
    base = find_harness("claude-code")
    assert base.env["CLAWPIPE_CLI_MODE"] == "minimal"  # the manifest itself is unchanged
    assert all(cli[0].env[k] == v for k, v in base.env.items() if k not in ("CLAWPIPE_CLI_MODE", "X_EXTRA"))
    assert {s.harness for s in specs if isinstance(s.harness, str)} == {"chat-loop"}  # no env: by name


def test_the_gpu_config_in_real_harnesses_md_loads(tmp_path: Path) -> None:
    """The documented mixed real-CLI config stays valid: full mode per entry, the reference harness beside."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "harnesses" / "REAL_HARNESSES.md").read_text()
    (block,) = [b for b in re.findall(r"```toml\n(.*?)```", doc, re.S) if 'engine = "vllm"' in b]
    p = tmp_path / "gpu.toml"
    p.write_text(block)
    cfg = load_config(p)
    modes = {h.name: h.env.get("CLAWPIPE_CLI_MODE") for h in cfg.harnesses}
    assert modes == {"claude-code": "full", "codex": "full", "qwen-code": "full", "openclaw": "full", "chat-loop": None}
    assert cfg.engine == "vllm"


def test_rollout_ids_are_unique_across_runs_even_when_started_together() -> None:
    from clawpipe.pipeline.stages import sample_specs
    from clawpipe.pipeline.state import new_run_id

    cfg = load_config(groups=2, samples=2)
    runs = [new_run_id(cfg.run_name) for _ in range(20)]
    assert len(set(runs)) == len(runs)
    ids = [s.id for run in runs[:2] for s in sample_specs(cfg, run, 0, policy_version=0)]
    assert len(ids) == len(set(ids)) == 2 * 2 * 2 * len(cfg.harnesses)
