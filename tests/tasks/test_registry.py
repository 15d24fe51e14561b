"""The task-set registry and task-file checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ConfigError, ManifestError
from clawpipe.tasks import TaskSet, get_task_set, list_task_sets, load_task, register_task_set


class Echo:
    """A minimal task set: reward 1 when the work dir holds out/echo.txt."""

    name = "echo"

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return [
            {"task_set": "echo", "task_id": f"echo-{seed}-{i}", "prompt": "say hi", "data": {}, "max_turns": 1}
            for i in range(n)
        ]

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        pass

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        return float((workdir / "out" / "echo.txt").exists()), {}


ECHO = Echo()


def test_builtins_are_listed_and_satisfy_the_protocol() -> None:
    assert {"guess", "calc", "fixit"} <= set(list_task_sets())
    for name in ("guess", "calc", "fixit"):
        task_set = get_task_set(name)
        assert isinstance(task_set, TaskSet) and task_set.name == name


def test_unknown_name_says_what_exists() -> None:
    with pytest.raises(ConfigError, match="guess"):
        get_task_set("nope")
    with pytest.raises(ConfigError, match="cannot import"):
        get_task_set("no.such.module:thing")
    with pytest.raises(ConfigError):
        register_task_set(object())  # type: ignore[arg-type]


def test_register_and_import_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from clawpipe import tasks

    monkeypatch.setattr(tasks, "_REGISTRY", {})  # leave the process-wide registry as it was
    register_task_set(ECHO)
    assert get_task_set("echo") is ECHO and "echo" in list_task_sets()
    assert get_task_set("tests.tasks.test_registry:ECHO") is ECHO
    assert get_task_set("tests.tasks.test_registry:Echo").name == "echo"


def test_generate_rejects_an_unknown_split() -> None:
    with pytest.raises(ManifestError, match="split"):
        get_task_set("guess").generate(1, seed=0, split="test")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{", "not valid JSON"),
        ("[]", "JSON object"),
        (json.dumps({"task_set": "guess"}), "missing `task_id`"),
        (json.dumps({"task_set": "g", "task_id": "x", "prompt": "p", "data": {}, "max_turns": "4"}), "max_turns"),
        (json.dumps({"task_set": "g", "task_id": "x", "prompt": "p", "data": {}, "max_turns": 0}), ">= 1"),
    ],
)
def test_load_task_rejects_malformed_files(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "task.json"
    path.write_text(content)
    with pytest.raises(ManifestError, match=match):
        load_task(path)
    with pytest.raises(ManifestError, match="cannot read"):
        load_task(tmp_path / "missing.json")


def test_load_task_accepts_generated_tasks(tmp_path: Path) -> None:
    for name in ("guess", "calc", "fixit"):
        task = get_task_set(name).generate(1, seed=0)[0]
        (tmp_path / f"{name}.json").write_text(json.dumps(task))
        assert load_task(tmp_path / f"{name}.json") == task


def test_one_task_check_for_task_files_and_runner_specs(tmp_path: Path) -> None:
    from clawpipe import sandbox, tasks
    from clawpipe.sandbox.manifest import load_task_file

    assert sandbox.validate_task is tasks.validate_task
    good = get_task_set("guess").generate(1, seed=0)[0]
    for bad, match in [
        ({**good, "task_id": "a/b"}, "without '/'"),  # the task loader used to accept it
        ({**good, "sampling": [0.5]}, "`sampling` must be an object"),  # the runner's check used to accept it
        ({**good, "max_turns": True}, "`max_turns` must be int"),
        ({**good, "data": {"x": float("nan")}}, "not plain JSON"),
    ]:
        for loader in (load_task, load_task_file):
            path = tmp_path / "task.json"
            path.write_text(json.dumps(bad))
            with pytest.raises(ManifestError, match=match):
                loader(path)
