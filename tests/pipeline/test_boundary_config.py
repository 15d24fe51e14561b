"""The pipeline config as a careless user writes it: every bad value is one ConfigError, raised before anything
starts, that names the key, shows the value given and says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.configfile import read_config, write_config
from clawpipe.errors import ConfigError
from clawpipe.pipeline.config import MAX_ROLLOUTS_PER_ITERATION, PipelineConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
ENTRY = '[[harnesses]]\nname = "chat-loop"\ntask_set = "guess"\n'


def _entry(**extra: str) -> str:
    return ENTRY + "".join(f"{k} = {v}\n" for k, v in extra.items())


def _harness(name: str) -> str:
    return f'[[harnesses]]\nname = "{name}"\ntask_set = "guess"\n'


def _error(tmp_path: Path, toml: str) -> str:
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    return str(info.value)


@pytest.mark.parametrize(
    ("toml", "wanted"),
    [
        # floats that are not numbers
        ("rollout_timeout_s = inf\n", ["rollout_timeout_s", "finite number", "got inf"]),
        ("rollout_timeout_s = nan\n", ["rollout_timeout_s", "finite number", "got nan"]),
        ("shard_stall_s = inf\n", ["shard_stall_s", "finite number", "got inf"]),
        ("shard_timeout_s = 1e300\n", ["shard_timeout_s", "less than or equal to 604800", "got 1e+300"]),
        (_entry(weight="inf"), ["harnesses.0.weight", "finite number", "got inf"]),
        (_entry(weight="nan"), ["harnesses.0.weight", "finite number", "got nan"]),
        ("train = { learning_rate = inf }\n", ["train", "learning_rate = inf is not finite"]),
        ("train = { learning_rate = nan }\n", ["train", "learning_rate = nan is not finite"]),
        ("train = { betas = [0.9, inf] }\n", ["train", "betas = [0.9, inf] is not finite"]),
        # TOML types taken as written, not converted
        ('groups = "4"\n', ["groups", "valid integer", "got '4'"]),
        ("groups = true\n", ["groups", "valid integer", "got True"]),
        ("iterations = 2.0\n", ["iterations", "valid integer", "got 2.0"]),
        ('samples = "many"\n', ["samples", "valid integer", "got 'many'"]),
        ("seed = -1\n", ["seed", "greater than or equal to 0", "got -1"]),
        ("seed = 99999999999999999999\n", ["seed", "less than or equal to 4294967295"]),
        # zero and negative counts
        ("groups = 0\n", ["groups", "greater than or equal to 1", "got 0"]),
        ("eval_tasks = -1\n", ["eval_tasks", "greater than or equal to 0", "got -1"]),
        # unknown keys name the keys that are
        ("grups = 4\n", ["grups: unknown key", "groups", "samples", "iterations"]),
        (_entry(wieght="2.0"), ["harnesses.0.wieght: unknown key", "env, groups, name, task_set, weight"]),
        ("train = { learning_rat = 0.1 }\n", ["learning_rat: unknown key", "learning_rate"]),
        # names
        ('run_name = "abc\\n"\n', ["run_name", "'abc\\n'", "letters, digits"]),
        ('run_name = "a/b"\n', ["run_name", "'a/b'"]),
        ('run_name = ".."\n', ["run_name", "'..'"]),
        ('run_name = "réseau"\n', ["run_name", "'réseau'"]),
        (f'run_name = "{"r" * 1000}"\n', ["run_name", "1-64 letters"]),
        (_harness("../../etc"), ["harnesses.0.name", "'../../etc' is not a harness folder name", "under harnesses/"]),
        (_harness("/tmp/evil"), ["harnesses.0.name", "'/tmp/evil'", "no paths"]),
        (_harness("evil.toml"), ["harnesses.0.name", "'evil.toml'"]),
        (_harness("chat loop"), ["harnesses.0.name", "'chat loop'"]),
        (_harness("x" * 1000), ["harnesses.0.name", "not a harness folder name"]),
        (_harness(""), ["harnesses.0.name", "''"]),
        # the policy server's bind address is handed to a child's command line
        ('serve_host = "not a host!"\n', ["serve_host", "'not a host!' is neither an IP address nor a host name"]),
        ('serve_host = "--port=1"\n', ["serve_host", "'--port=1'"]),
        # duplicate entries
        (ENTRY + _entry(weight="2.0"), ["chat-loop with task set guess appears twice", "once"]),
        # an env the sandbox could not start with, or one that overrides the runner's own variables
        (_entry(env='{ A = "x\\u0000y" }'), ["harnesses.0.env", "A holds a NUL character"]),
        (_entry(env='{ OPENAI_BASE_URL = "http://elsewhere" }'), ["harnesses.0.env", "may not set OPENAI_BASE_URL"]),
        (_entry(env='{ CLAWPIPE_TASK = "x" }'), ["harnesses.0.env", "may not set CLAWPIPE_TASK"]),
    ],
)
def test_bad_value_names_the_key_the_value_and_the_fix(tmp_path: Path, toml: str, wanted: list[str]) -> None:
    message = _error(tmp_path, toml)
    for part in wanted:
        assert part in message, (part, message)


@pytest.mark.parametrize(
    "toml",
    [
        "groups = 1000000000\n",
        "samples = 1000000000\n",
        "eval_tasks = 1000000000\n",
        "eval_samples = 1000000000\n",
        _entry(groups="1000000000"),
        "groups = 400\nsamples = 200\n",  # each count fine, their product is not
    ],
)
def test_enormous_counts_fail_at_once_naming_the_limit(tmp_path: Path, toml: str) -> None:
    start = time.monotonic()
    message = _error(tmp_path, toml)
    assert time.monotonic() - start < 10.0  # refused by arithmetic: planning 10^9 rollouts would take minutes
    assert "rollouts per iteration" in message and f"{MAX_ROLLOUTS_PER_ITERATION:,}" in message
    assert "lower groups, samples, eval_tasks or eval_samples" in message


def test_the_largest_plan_allowed_still_loads(tmp_path: Path) -> None:
    p = tmp_path / "big.toml"
    p.write_text(f"groups = {MAX_ROLLOUTS_PER_ITERATION // 4}\nsamples = 4\neval_tasks = 0\n{ENTRY}")
    assert load_config(p).rollouts_per_iteration() == MAX_ROLLOUTS_PER_ITERATION


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::1", "localhost", "node-3.cluster.local"])
def test_bind_addresses_and_host_names_are_taken(host: str) -> None:
    assert load_config(serve_host=host).serve_host == host


def test_a_config_handed_to_a_child_reads_back_the_same(tmp_path: Path) -> None:
    """Strict types still read the JSON a parent writes for the flow and the trainer."""
    p = tmp_path / "p.toml"
    p.write_text(
        "rollout_timeout_s = 30\nshard_timeout_s = 600\nseed = 7\n"
        + _entry(weight="0.5", groups="2", env='{ CLAWPIPE_CLI_MODE = "full" }')
    )
    cfg = load_config(p, iterations=3)
    back = read_config(PipelineConfig, write_config(cfg, tmp_path / "child" / "config.json"))
    assert back == cfg and back.rollout_timeout_s == 30.0
    assert PipelineConfig.model_validate(cfg.model_dump()) == cfg  # the run state's copy, resumed


def _run_cli(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CLAWPIPE_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "clawpipe", "run", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("toml", "wanted"),
    [
        ("groups = 1000000000\nbackend = 'process'\n", "rollouts per iteration"),
        ('backend = "process"\n[[harnesses]]\nname = "chat-loop"\ntask_set = "nope"\n', "unknown task set 'nope'"),
    ],
)
def test_cli_refuses_before_any_run_starts(tmp_path: Path, toml: str, wanted: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(toml)
    out = _run_cli(["--config", str(p)], tmp_path / "home")
    assert out.returncode == 2, out.stderr
    assert wanted in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "home" / "runs").exists()  # no run folder, no flow process


@pytest.mark.parametrize("run_id", ["../../elsewhere", "/tmp", "..", "no-such-run-20260101-000000-abcdef"])
def test_resume_of_a_path_or_an_unknown_run_is_refused_before_starting(home: Path, tmp_path: Path, run_id: str) -> None:
    # a state file a path could reach: resuming must not pick it up
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "state.json").write_text("{}")
    (home / "runs" / "real-20260101-000000-abcdef").mkdir(parents=True)
    (home / "runs" / "real-20260101-000000-abcdef" / "state.json").write_text("{}")
    res = CliRunner().invoke(app, ["run", "--resume", run_id])
    assert isinstance(res.exception, ConfigError), res.output
    message = str(res.exception)
    assert run_id in message
    assert "not a run id" in message or "known runs: ['real-20260101-000000-abcdef']" in message


def test_cli_run_refuses_a_policy_that_is_not_a_model_before_starting(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    for policy in (tmp_path / "missing", tmp_path / "not-a-model"):
        p = tmp_path / "p.toml"
        p.write_text(f'backend = "process"\npolicy = "{policy}"\n{ENTRY}')
        out = _run_cli(["--config", str(p)], tmp_path / "home")
        assert out.returncode == 2, out.stderr
        assert f"policy: {policy} has no config.json" in out.stderr
        assert not (tmp_path / "home" / "runs").exists()


def test_deploy_refuses_an_unknown_task_set_before_registering(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    p.write_text('[[harnesses]]\nname = "chat-loop"\ntask_set = "nope"\n')
    env = {**os.environ, "CLAWPIPE_HOME": str(tmp_path / "home"), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "deploy", "--config", str(p)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "unknown task set 'nope'" in out.stderr and "Traceback" not in out.stderr


def test_a_config_that_is_not_utf8_text_or_is_a_folder_is_named(tmp_path: Path) -> None:
    p = tmp_path / "latin1.toml"
    p.write_bytes('run_name = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml is not UTF-8 text \(byte 15\); save it as UTF-8"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a folder; pass a TOML or JSON file"):
        load_config(tmp_path)
