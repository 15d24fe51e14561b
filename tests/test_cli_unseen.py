"""The command line as a new user meets it: every subcommand answers --help and a bad start with one line
and a non-zero exit, never a traceback; bad environment values, a Prefect or MLflow that cannot be reached
and a summary path that cannot be written are refused before any flow starts."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.errors import ConfigError
from clawpipe.tracking import check_tracking_uri

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    ["serve"],
    ["proxy"],
    ["rollout"],
    ["land"],
    ["sql"],
    ["train"],
    ["run"],
    ["deploy"],
    ["worker"],
    ["model", "init"],
    ["model", "publish"],
    ["harness", "list"],
    ["harness", "check"],
    ["harness", "install"],
    ["lake", "check"],
    ["lake", "compact"],
    ["lake", "saved"],
    ["trees", "build"],
    ["trees", "list"],
    ["trees", "show"],
]
NEED_ARGS = [c for c in COMMANDS if c[-1] in ("serve", "proxy", "rollout", "sql", "train", "init", "publish")] + [
    ["harness", "check"],
    ["harness", "install"],
    ["trees", "build"],
    ["trees", "list"],
    ["trees", "show"],
]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(args: list[str], home: Path, timeout: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CLAWPIPE_"))}
    base.update({"CLAWPIPE_HOME": str(home), "COLUMNS": "200", **env})
    return subprocess.run(
        [sys.executable, "-m", "clawpipe", *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=timeout
    )


def _one_line_refusal(out: subprocess.CompletedProcess[str], *wanted: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out.stderr
    for part in wanted:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_answers_help(command: list[str]) -> None:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output and res.exception is None


@pytest.mark.parametrize("command", NEED_ARGS, ids=" ".join)
def test_a_subcommand_missing_its_arguments_says_which(command: list[str], home: Path) -> None:
    res = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert "Missing" in res.output or "Usage:" in res.output
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit)


@pytest.mark.parametrize(
    ("variable", "value", "wanted"),
    [
        ("CLAWPIPE_TORCH_THREADS", "abc", ["CLAWPIPE_TORCH_THREADS", "valid integer", "got 'abc'"]),
        ("CLAWPIPE_HOST_SLOTS", "0", ["CLAWPIPE_HOST_SLOTS", "greater than or equal to 1", "got '0'"]),
        ("CLAWPIPE_SANDBOX_UID_COUNT", "many", ["CLAWPIPE_SANDBOX_UID_COUNT", "got 'many'"]),
        ("CLAWPIPE_HOME", "<file>", ["CLAWPIPE_HOME", "is a file, not a folder"]),
        # read where they are used; a bad value was taken as the default without a word (or a path component)
        ("CLAWPIPE_LAKE_LEASE_TTL", "abc", ["CLAWPIPE_LAKE_LEASE_TTL", "got 'abc'"]),
        ("CLAWPIPE_TRAIN_PROCESS", "bogus", ["CLAWPIPE_TRAIN_PROCESS", "'step'", "got 'bogus'"]),
        ("CLAWPIPE_HOST_ID", "../other", ["CLAWPIPE_HOST_ID", "got '../other'"]),
        ("CLAWPIPE_CAPTURE_UPLOAD", "no", ["CLAWPIPE_CAPTURE_UPLOAD", "got 'no'"]),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(
    tmp_path: Path, variable: str, value: str, wanted: list[str]
) -> None:
    if value == "<file>":
        value = str(tmp_path / "a file")
        Path(value).write_text("not a folder\n")
    out = _cli(["run", "--backend", "process"], tmp_path / "home", **{variable: value})
    line = _one_line_refusal(out, "invalid environment", *wanted)
    assert "fix or unset" in line
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.parametrize("command", [["deploy"], ["worker", "--run-once"]], ids=" ".join)
def test_deploy_and_worker_without_a_prefect_server_refuse_at_once(tmp_path: Path, command: list[str]) -> None:
    # before: deploy registered on a temporary server gone when it returned (exit 0), worker died in a traceback
    start = time.monotonic()
    out = _cli(command, tmp_path / "home")
    _one_line_refusal(out, f"clawpipe {command[0]} needs a running Prefect server", "--api-url", "PREFECT_API_URL")
    assert "Successfully created" not in out.stdout
    assert time.monotonic() - start < 30


POOL_CONFIG = """
groups = 1
samples = 2
backend = "process"
rollout_pool = "rollouts"
[[harnesses]]
name = "chat-loop"
task_set = "guess"
"""


@pytest.mark.parametrize("missing", ["lake", "prefect"])
def test_a_run_on_a_rollout_pool_refuses_at_once_without_a_shared_lake_or_prefect_server(
    tmp_path: Path, missing: str
) -> None:
    # before: checked only in the first rollout batch, after the policy, engine, proxy and MLflow run had
    # started, and again through the batch's two retries
    cfg = tmp_path / "pool.toml"
    cfg.write_text(POOL_CONFIG)
    env = {} if missing == "lake" else {"CLAWPIPE_LAKE_URI": "s3://bucket/lake"}
    out = _cli(["run", "--config", str(cfg)], tmp_path / "home", **env)
    if missing == "lake":
        _one_line_refusal(out, "rollout_pool needs the lake on an object store", "CLAWPIPE_LAKE_URI")
    else:
        line = _one_line_refusal(out, "clawpipe run with rollout_pool = 'rollouts' needs a running Prefect server")
        assert "set PREFECT_API_URL" in line and "--api-url" not in line  # run has no such flag
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.parametrize(
    "command", [["run", "--backend", "process"], ["deploy", "--api-url", "{api}"], ["worker", "--api-url", "{api}"]]
)
def test_an_unreachable_prefect_api_is_refused_before_the_flow_starts(tmp_path: Path, command: list[str]) -> None:
    api = f"http://127.0.0.1:{_closed_port()}/api"
    start = time.monotonic()
    out = _cli([a.format(api=api) for a in command], tmp_path / "home", PREFECT_API_URL=api)
    _one_line_refusal(out, f"the Prefect API at {api} does not answer", "prefect server start")
    assert time.monotonic() - start < 30
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.parametrize("uri", ["http://127.0.0.1:{port}", "sqlite:///{file}/mlflow.db", "{file}/mlruns"])
def test_an_mlflow_that_cannot_be_logged_to_is_refused_before_the_flow_starts(tmp_path: Path, uri: str) -> None:
    # before: the flow started, built the policy, then MLflow retried the dead server for minutes
    blocker = tmp_path / "a file"
    blocker.write_text("x")
    uri = uri.format(port=_closed_port(), file=blocker)
    start = time.monotonic()
    out = _cli(["run", "--backend", "process"], tmp_path / "home", CLAWPIPE_MLFLOW_TRACKING_URI=uri)
    line = _one_line_refusal(out, uri, "CLAWPIPE_MLFLOW_TRACKING_URI")
    assert "does not answer" in line or f"{blocker} is a file" in line
    assert time.monotonic() - start < 30
    assert not (tmp_path / "home" / "runs").exists()


@pytest.fixture
def health_server() -> Iterator[str]:
    """A loopback HTTP server whose /health answers 200, as MLflow's does."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_reachable_and_writable_tracking_uris_pass(tmp_path: Path, health_server: str) -> None:
    check_tracking_uri(health_server)
    check_tracking_uri(f"sqlite:///{tmp_path / 'new folder' / 'réseau' / 'mlflow.db'}")  # made on the way
    check_tracking_uri(str(tmp_path / "mlruns"))
    check_tracking_uri("postgresql://db.example/mlflow")  # left to MLflow
    with pytest.raises(ConfigError, match="does not answer"):
        check_tracking_uri(f"http://127.0.0.1:{_closed_port()}")


@pytest.mark.parametrize("where", ["folder", "no parent"])
def test_a_summary_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path, where: str) -> None:
    # before: the summary was written after the last iteration, so the whole run ended in a traceback
    folder = tmp_path / "dir with space" / "réseau"
    folder.mkdir(parents=True)
    target = folder if where == "folder" else folder / "missing" / "summary.json"
    out = _cli(["run", "--backend", "process", "--summary-out", str(target)], tmp_path / "home")
    line = _one_line_refusal(out, f"--summary-out {target}")
    assert ("is a folder" in line) if where == "folder" else ("does not exist; create it first" in line)
    assert not (tmp_path / "home" / "runs").exists()


def test_a_config_path_with_spaces_and_non_ascii_is_read_and_named(tmp_path: Path) -> None:
    p = tmp_path / "dir with space" / "réseau config.toml"
    p.parent.mkdir()
    p.write_text('backend = "process"\ntrain = { learning_rat = 0.1 }\n')
    out = _cli(["run", "--config", str(p)], tmp_path / "home")
    _one_line_refusal(out, str(p), "learning_rat: unknown key", "learning_rate")


@pytest.mark.parametrize(
    ("toml", "wanted"),
    [
        ("[train]\nlearning_rat = 0.1\n", "learning_rat: unknown key (did you mean learning_rate?)"),
        ("grups = 4\n", "grups: unknown key (did you mean groups?)"),
        ('[[harnesses]]\nname = "chat-loop"\ntask_sett = "guess"\n', "task_sett: unknown key (did you mean task_set?)"),
        # a trainer key written at the top level: it had no hint at all
        ("learning_rat = 0.1\n", "learning_rat: unknown key (did you mean train.learning_rate, in the train table?)"),
        ("epochs = 2\n", "epochs: unknown key (did you mean train.epochs, in the train table?)"),
    ],
)
def test_a_misspelt_key_names_its_close_match(tmp_path: Path, toml: str, wanted: str) -> None:
    from clawpipe.pipeline.config import load_config

    p = tmp_path / "typo.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert wanted in str(info.value)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_a_yaml_config_is_named_as_yaml_not_as_broken_toml(tmp_path: Path, suffix: str) -> None:
    p = tmp_path / f"pipeline{suffix}"
    p.write_text("groups: 2\ntrain:\n  learning_rate: 0.01\n")
    out = _cli(["run", "--config", str(p)], tmp_path / "home")
    _one_line_refusal(out, f"{p} is YAML", "write it as TOML (key = value) or JSON")


@pytest.mark.parametrize(
    ("toml", "wanted"),
    [
        (
            "groups = 2\nsamples = [\n",
            "(at end of document) (the file ends at line 3: a value or bracket is left open)",
        ),
        ("groups = 2\ngroups = 3\n", "(at line 2, column"),
        ("iterations = 1\n[train\nepochs = 1\n", "(at line 2, column"),
    ],
)
def test_a_toml_syntax_error_gives_its_line(tmp_path: Path, toml: str, wanted: str) -> None:
    p = tmp_path / "broken.toml"
    p.write_text(toml)
    out = _cli(["run", "--config", str(p)], tmp_path / "home")
    _one_line_refusal(out, f"{p} is not valid TOML", wanted)


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["proxy", "--upstream", "http://127.0.0.1:9", "--port", "0", "--capture-dir", "{file}"], "{file} is a file"),
        (["model", "init", "{file}"], "{file} is a file where a folder is needed"),
        (["model", "init", "{file}/réseau policy"], "{file} is a file where a folder is needed"),
        (["land", "--lake", "{file}"], "{file} is a file where a folder is needed"),
        (["harness", "check", "chat-loop", "--transcript", "{missing}"], "No such file or directory: {missing}"),
    ],
)
def test_a_path_that_is_a_file_or_missing_is_one_line_naming_it(tmp_path: Path, args: list[str], wanted: str) -> None:
    # before: FileExistsError, NotADirectoryError or FileNotFoundError tracebacks
    blocker = tmp_path / "dir with space" / "a file"
    blocker.parent.mkdir()
    blocker.write_text("x")
    names = {"file": str(blocker), "missing": str(tmp_path / "nowhere" / "t.json")}
    out = _cli([a.format(**names) for a in args], tmp_path / "home", timeout=60)
    _one_line_refusal(out, wanted.format(**names), "check the path given")


def test_publish_to_a_server_that_is_not_there_says_so(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    out = _cli(["model", "publish", str(tmp_path), "--policy-version", "1", "--url", url], tmp_path / "home")
    _one_line_refusal(out, f"nothing answers at {url}", "clawpipe serve --model DIR")


def test_serving_a_model_id_that_is_not_cached_fails_at_once(tmp_path: Path) -> None:
    # before: the hub download was retried with backoff for over a minute (the engine runs offline)
    start = time.monotonic()
    out = _cli(["serve", "--model", "no-such-org/no-such-model", "--port", "0"], tmp_path / "home", timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "error: cannot load a tokenizer from no-such-org/no-such-model" in out.stderr
    assert "Retrying" not in out.stderr
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("lake", ["home", "file"])
def test_sql_without_a_lake_names_where_it_looked_not_a_flag_never_given(tmp_path: Path, lake: str) -> None:
    # before: "Invalid value: --lake ...: no lake there", in a boxed panel, for a --lake nobody passed
    env = {}
    if lake == "file":
        (tmp_path / "afile").write_text("x\n")
        env["CLAWPIPE_LAKE_URI"] = str(tmp_path / "afile")
    out = _cli(["sql", "select 1"], tmp_path / "home", **env)
    line = _one_line_refusal(out, "no lake at ", "clawpipe land", "--lake FOLDER", "CLAWPIPE_LAKE_URI")
    assert ("a file, not a folder" if lake == "file" else "no such folder") in line
    assert "Invalid value" not in out.stderr


@pytest.mark.parametrize("command", [["lake", "check"], ["lake", "compact"]], ids=" ".join)
def test_a_mistyped_lake_is_refused_not_audited_or_created(tmp_path: Path, command: list[str]) -> None:
    # before: `lake check` passed every audit on no data and `lake compact` created the folder, both exit 0
    lake = tmp_path / "no such lake" / "réseau"
    out = _cli([*command, "--lake", str(lake)], tmp_path / "home")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no lake there" in out.stderr and "audits passed" not in out.stdout
    assert not lake.exists()
