"""A run's MLflow record is enough to compare it and run it again: its config as a ``config.toml`` artifact
that reads back to the same config and params, and tags for what it used beyond its config (harness, task
set and policy content hashes, a dirty checkout, library versions) that ``mlflow.search_runs`` filters on.
A config whose harness was edited since it was recorded is said, naming the harness."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from clawpipe.pipeline import provenance
from clawpipe.pipeline.config import PipelineConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _policy(tmp_path: Path) -> Path:
    policy = tmp_path / "policy"
    policy.mkdir(exist_ok=True)
    (policy / "config.json").write_text('{"model_type": "test"}')
    return policy


def _harnesses_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    """Copies of the repository's harnesses (and their kit) in ./harnesses, which is searched first."""
    work = tmp_path / "work"
    for name in (*names, "_kit"):
        shutil.copytree(ROOT / "harnesses" / name, work / "harnesses" / name, ignore=shutil.ignore_patterns("*.pyc"))
    monkeypatch.chdir(work)
    return work / "harnesses"


def test_config_toml_reads_back_to_the_same_config(tmp_path: Path) -> None:
    # values TOML writes in more than one way, or not at all: escapes, characters outside the BMP, DEL,
    # floats in exponent form, lists, empty and nested tables, keys that need quotes, fields left None
    tricky = 'say "hi" \\ tab\t newline\n é 😀 del\x7f'
    configs = [
        PipelineConfig(
            backend="process",
            policy=str(_policy(tmp_path)),
            rollout_timeout_s=90.5,
            harnesses=[
                {"name": "chat-loop", "task_set": "say", "weight": 0.25, "groups": 3, "env": {"MY_VAR": tricky}},
                {"name": "tool-agent", "task_set": "calc"},
            ],
            train={"learning_rate": 1e-05, "betas": [0.9, 0.999], "epochs": 2},
        ),
        PipelineConfig(train={}),  # no trainer settings at all: must stay empty, not become the defaults
        PipelineConfig(),
    ]
    for i, cfg in enumerate(configs):
        rec = {"harnesses": {"chat-loop": "a" * 16}, "task_sets": {"pkg.mod:attr": "b" * 16}, "git": "g"}
        path = tmp_path / f"c{i}.toml"
        path.write_text(provenance.config_toml(cfg, rec, f"run-{i}"))
        again = load_config(path)
        assert again.model_dump() == cfg.model_dump(), path.read_text()
        assert again.train_config().flat_params() == cfg.train_config().flat_params()


def test_random_configs_read_back_from_their_toml_unchanged(tmp_path: Path) -> None:
    import random

    rng = random.Random(7)
    # every control character but NUL (an environment cannot carry it), quotes, backslashes, TOML's own
    # punctuation, DEL, line and paragraph separators, characters outside the BMP
    pool = [chr(c) for c in range(1, 0x20)] + list("\"'\\#=[]{}.,: ab\x7f\u2028\u00e9\U0001f600\U0010fffd")
    floats = [5e-324, 1e-05, 0.1, 1.0, 2.5, 1e16, 123456.789, 1 / 3]
    for i in range(200):
        env = {f"K{j}": "".join(rng.choice(pool) for _ in range(rng.randrange(0, 12))) for j in range(3)}
        cfg = PipelineConfig(
            backend="process",
            run_name=f"r{i}",
            seed=rng.randrange(0, 2**32),
            samples=rng.randrange(2, 9),
            rollout_timeout_s=rng.choice([None, rng.choice(floats[1:5])]),
            harnesses=[
                {"name": "chat-loop", "task_set": "guess", "weight": rng.choice(floats), "env": env},
                {"name": "tool-agent", "task_set": "calc", "groups": rng.choice([None, 1, 7])},
            ],
            train={"learning_rate": rng.choice([1e-05, 0.002, 0.01]), "epochs": rng.randrange(1, 4)},
        )
        path = tmp_path / "c.toml"
        path.write_text(provenance.config_toml(cfg, {"git": "g"}, f"run-{i}"), encoding="utf-8")
        assert load_config(path).model_dump() == cfg.model_dump(), path.read_text(encoding="utf-8")


def test_a_run_records_its_config_as_an_artifact_that_starts_a_run_with_the_same_params(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    from clawpipe.config import Settings
    from clawpipe.pipeline.stages import open_run

    _harnesses_here(tmp_path, monkeypatch, "chat-loop", "tool-agent")
    settings = Settings(home=home)
    cfg = PipelineConfig(
        backend="process",
        policy=str(_policy(tmp_path)),
        experiment="rerun",
        groups=2,
        harnesses=[{"name": "tool-agent", "task_set": "calc", "env": {"MY_VAR": "x"}}],
        train={"epochs": 2},
    )
    first = open_run(settings, cfg, run_id=None, resume=False, git_revision="rev1")
    client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)
    downloaded = Path(client.download_artifacts(str(first.mlflow_run_id), "config.toml", str(tmp_path / "dl")))
    assert downloaded.read_text() == (home / "runs" / first.run_id / "config.toml").read_text()
    second = open_run(settings, load_config(downloaded), run_id=None, resume=False, git_revision="rev1")
    a, b = (client.get_run(str(s.mlflow_run_id)).data for s in (first, second))
    assert a.params.pop("run_id") == first.run_id and b.params.pop("run_id") == second.run_id
    assert a.params == b.params and len(a.params) > 40
    # what the run used beyond its config, as tags; the same content gives the same hashes
    tags = a.tags
    assert tags["clawpipe.harnesses"] == "tool-agent" and tags["clawpipe.task_sets"] == "calc"
    assert len(tags["clawpipe.harness.tool-agent.sha256"]) == provenance.HASH_HEX
    assert tags["clawpipe.harness_kit.sha256"] and tags["clawpipe.task_set.calc.sha256"]
    assert tags["clawpipe.policy.origin"] == "folder" and tags["clawpipe.policy.dir"] == cfg.policy
    assert tags["clawpipe.git_dirty"] in ("true", "false")
    assert {"clawpipe.version.torch", "clawpipe.version.transformers", "clawpipe.version.clawpipe"} <= set(tags)
    # the same content, the same hashes (the checkout's diff aside: others may edit it between the runs)
    own = ("clawpipe.run_id", "clawpipe.run_dir", "clawpipe.git_dirty", "clawpipe.git_diff_sha256")
    same = {k: v for k, v in tags.items() if k.startswith("clawpipe.") and k not in own}
    assert len(same) >= 12
    assert {k: b.tags[k] for k in same} == same
    assert first.provenance["harnesses"] == {"tool-agent": tags["clawpipe.harness.tool-agent.sha256"]}
    # where its outputs are: the state, logs and checkpoints on this host, the lake
    assert tags["clawpipe.run_dir"] == str(home.resolve() / "runs" / first.run_id)
    assert tags["clawpipe.lake"] == str(home.resolve() / "lake") and tags["clawpipe.host"]
    artifacts = {f.path for f in client.list_artifacts(str(first.mlflow_run_id))}
    if tags["clawpipe.git_dirty"] == "true":  # the uncommitted changes it ran with, told apart by their hash
        diff = Path(client.download_artifacts(str(first.mlflow_run_id), "git.diff", str(tmp_path / "dl"))).read_text()
        assert artifacts == {"config.toml", "git.diff"} and diff.strip()
        assert tags["clawpipe.git_diff_sha256"] == hashlib.sha256(diff.encode()).hexdigest()[: provenance.HASH_HEX]
    else:
        assert artifacts == {"config.toml"} and "clawpipe.git_diff_sha256" not in tags


def test_a_lake_url_is_tagged_without_its_credentials(tmp_path: Path) -> None:
    lake = "s3://AKIAKEY:s3cr3t@bucket/team/lake?endpoint_override=http://10.0.0.1:9000&secret_key=s3cr3t"
    tags = provenance.location_tags(lake, tmp_path / "runs" / "r", "flow-1")
    assert tags["clawpipe.lake"] == "s3://bucket/team/lake" and tags["clawpipe.flow_run_id"] == "flow-1"
    assert "s3cr3t" not in json.dumps(tags) and "AKIAKEY" not in json.dumps(tags)


def test_a_run_whose_tracking_store_is_away_still_records_what_it_used(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe import config
    from clawpipe.net import free_port
    from clawpipe.pipeline.stages import open_run

    monkeypatch.setenv("CLAWPIPE_MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config.get_settings.cache_clear()
    settings = config.get_settings()
    cfg = PipelineConfig(
        backend="process", policy=str(_policy(tmp_path)), harnesses=[{"name": "chat-loop", "task_set": "say"}]
    )
    state = open_run(settings, cfg, run_id=None, resume=False, git_revision="g")
    assert state.mlflow_run_id is None  # untracked, not failed
    saved = json.loads((settings.runs_dir / state.run_id / "state.json").read_text())
    assert set(saved["provenance"]["harnesses"]) == {"chat-loop"}
    assert load_config(settings.runs_dir / state.run_id / "config.toml").model_dump() == cfg.model_dump()


def test_runs_are_found_by_harness_with_mlflow_search(tmp_path: Path, home: Path) -> None:
    import mlflow
    from clawpipe.config import Settings
    from clawpipe.pipeline.stages import open_run

    settings = Settings(home=home)
    policy = str(_policy(tmp_path))
    mixes = {
        "calc": [{"name": "tool-agent", "task_set": "calc"}],
        "mix": [{"name": "chat-loop", "task_set": "guess"}, {"name": "tool-agent", "task_set": "guess"}],
        "chat": [{"name": "chat-loop", "task_set": "say"}],
    }
    for name, harnesses in mixes.items():
        cfg = PipelineConfig(backend="process", policy=policy, experiment="find", run_name=name, harnesses=harnesses)
        open_run(settings, cfg, run_id=None, resume=False, git_revision="g")
    client = mlflow.MlflowClient(tracking_uri=settings.tracking_uri)
    experiment = client.get_experiment_by_name("find")
    assert experiment is not None

    def names(filter_string: str) -> list[str]:
        runs = client.search_runs([experiment.experiment_id], filter_string=filter_string)
        return sorted(r.data.params["run_name"] for r in runs)

    # the filter the README shows, as the MLflow UI's search box and mlflow.search_runs take it
    assert names("tags.\"clawpipe.harnesses\" LIKE '%tool-agent%'") == ["calc", "mix"]
    assert names("tags.\"clawpipe.task_sets\" = 'say'") == ["chat"]


def test_an_edited_harness_hashes_differently_and_a_rerun_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harnesses = _harnesses_here(tmp_path, monkeypatch, "chat-loop", "compacting-agent")
    cfg = PipelineConfig(backend="process", policy=str(_policy(tmp_path)))
    rec, _ = provenance.record(cfg, Path(str(cfg.policy)), "rev1")
    assert provenance.rerun_warnings(cfg, {"run_id": "r1", **rec}) == []
    with open(harnesses / "chat-loop" / "harness.py", "a") as f:
        f.write("\n# tuned the prompt\n")
    said = provenance.rerun_warnings(cfg, {"run_id": "r1", **rec})
    assert len(said) == 1 and "harness chat-loop" in said[0] and "r1" in said[0], said
    assert str(harnesses / "chat-loop") in said[0] and rec["harnesses"]["chat-loop"] in said[0]
    again, _ = provenance.record(cfg, Path(str(cfg.policy)), "rev1")
    assert again["harnesses"]["chat-loop"] != rec["harnesses"]["chat-loop"]
    assert again["harnesses"]["compacting-agent"] == rec["harnesses"]["compacting-agent"]
    # the shared kit and the policy folder are compared too
    with open(harnesses / "_kit" / "harness_kit.py", "a") as f:
        f.write("\n# kit edit\n")
    (Path(str(cfg.policy)) / "config.json").write_text('{"model_type": "other"}')
    said = provenance.rerun_warnings(cfg, {"run_id": "r1", **rec})
    assert [s.split(" is not ")[0] for s in said] == ["harness chat-loop", "the harness kit", f"policy {cfg.policy}"]


def test_a_run_resumed_after_its_harness_was_edited_says_so_in_its_log_and_tags(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import mlflow
    from clawpipe.config import Settings
    from clawpipe.pipeline.stages import open_run

    harnesses = _harnesses_here(tmp_path, monkeypatch, "chat-loop", "compacting-agent")
    settings = Settings(home=home)
    cfg = PipelineConfig(backend="process", policy=str(_policy(tmp_path)), experiment="resume")
    state = open_run(settings, cfg, run_id=None, resume=False, git_revision="g")
    caplog.set_level(logging.WARNING, logger="clawpipe.pipeline.provenance")
    open_run(settings, None, run_id=state.run_id, resume=True, git_revision="g")  # unchanged: nothing said
    assert not [r for r in caplog.records if r.name == "clawpipe.pipeline.provenance"]
    state.complete({"policy_dir": str(cfg.policy), "policy_version": 1}, peak_memory_mb=1.0)
    state.save(settings.runs_dir)
    with open(harnesses / "compacting-agent" / "harness.py", "a") as f:
        f.write("\n# edited while the run was stopped\n")
    (Path(str(cfg.policy)) / "config.json").write_text("{}")  # the initial policy: not what a resume runs
    open_run(settings, None, run_id=state.run_id, resume=True, git_revision="g")
    said = [r.getMessage() for r in caplog.records if r.name == "clawpipe.pipeline.provenance"]
    assert len(said) == 1 and "resumes at iteration 1 with harness compacting-agent changed" in said[0], said
    tags = mlflow.MlflowClient(tracking_uri=settings.tracking_uri).get_run(str(state.mlflow_run_id)).data.tags
    assert tags["clawpipe.changed_on_resume.it1"] == "harness compacting-agent"


def test_the_cli_warns_about_an_edited_harness_before_the_run_starts(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from clawpipe.cli import app

    harnesses = _harnesses_here(tmp_path, monkeypatch, "chat-loop", "compacting-agent")
    cfg = PipelineConfig(backend="process", policy=str(_policy(tmp_path)))
    rec, _ = provenance.record(cfg, Path(str(cfg.policy)), "rev1")
    path = tmp_path / "config.toml"
    path.write_text(provenance.config_toml(cfg, rec, "r1"))
    (harnesses / "compacting-agent" / "harness.py").write_text("print('rewritten')\n")
    # the tracking check after the warning refuses this store, so nothing beyond the checks runs here
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CLAWPIPE_MLFLOW_TRACKING_URI", f"sqlite:///{blocker}/mlflow.db")
    from clawpipe import config

    config.get_settings.cache_clear()
    out = CliRunner().invoke(app, ["run", "--config", str(path)])
    config.get_settings.cache_clear()
    assert "warning: harness compacting-agent is not what run r1 used" in out.output, out.output
    assert "chat-loop" not in out.output.split("warning:")[1]


def test_a_big_folder_hashes_its_large_files_by_size_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    large, small = folder / "model.safetensors", folder / "config.json"
    large.write_bytes(b"\1" * 4096)
    small.write_text("{}")
    before = provenance.folder_digest(folder)
    st = large.stat()
    large.write_bytes(b"\2" * 4096)  # same size; mtime put back below
    os.utime(large, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert provenance.folder_digest(folder) != before  # a small folder is read whole
    monkeypatch.setattr(provenance, "BIG_FOLDER_BYTES", 1024)
    monkeypatch.setattr(provenance, "LARGE_FILE_BYTES", 1024)
    big = provenance.folder_digest(folder)
    large.write_bytes(b"\3" * 4096)
    os.utime(large, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert provenance.folder_digest(folder) == big  # not read: counted by size and mtime
    small.write_text('{"a": 1}')
    assert provenance.folder_digest(folder) != big  # small files of a big folder are still read
    small.write_text("{}")
    assert provenance.folder_digest(folder) == big
    os.utime(large, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched (a copy, a rewrite): counts
    touched = provenance.folder_digest(folder)
    large.chmod(0o755)
    assert len({big, touched, provenance.folder_digest(folder)}) == 3  # so does the executable bit


def test_a_dirty_checkout_is_tagged_with_its_changes(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    assert provenance.git_state(tmp_path) == ("unknown", "")  # no checkout
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-q", "-m", "a")
    assert provenance.git_state(tmp_path) == ("false", "")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")
    dirty, diff = provenance.git_state(tmp_path)
    assert dirty == "true" and "+x = 2" in diff and "?? new.py" in diff


def test_tags_are_named_and_cut_as_params_are(tmp_path: Path, home: Path) -> None:
    # before: tags went to the store as given; a sqlite store keeps '@' in a name and cuts a long value
    # silently at 8000 characters, so a cut value could not be told from another with the same start
    import mlflow
    from clawpipe.tracking import make_tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = make_tracker(experiment="tags", tracking_uri=uri)
    run_id = tracker.start_run("r", tags={"clawpipe.harness.a@b.sha256": "x", "long": "y" * 9000})
    assert run_id is not None
    tags = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).data.tags
    assert tags["clawpipe.harness.a_b.sha256"] == "x" and "9000 chars" in tags["long"]
