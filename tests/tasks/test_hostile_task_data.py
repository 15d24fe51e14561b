"""Hostile task data: a task file whose starting files are named to land outside the work dir (``../``,
absolute paths, links planted in the work dir) writes nothing outside it; the runner, which prepares work
dirs as root, gives that rollout alone a row saying what is wrong, and the rest of the batch runs."""

from __future__ import annotations

import copy
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.tasks import get_task_set, write_workdir_file
from tests.sandbox.support import Upstream, make_harness

FIXIT = get_task_set("fixit")
LEAVE = "import os\n"  # a harness that changes nothing: the planted bug stays


def _task_with_files(files: dict[str, Any]) -> dict[str, Any]:
    task = copy.deepcopy(FIXIT.generate(1, seed=3)[0])
    task["data"]["files"] = files
    return task


def _escapes(marker: str, outside: Path) -> list[str]:
    return [
        "../" * 40 + f"tmp/{marker}",
        f"sub/../../{marker}",
        str(outside / marker),
        f"/tmp/{marker}",
        f"./{marker}",
        f"a//{marker}",
        "",
    ]


@pytest.mark.parametrize("index", range(7))
def test_a_starting_file_named_outside_the_work_dir_is_refused_and_not_written(tmp_path: Path, index: int) -> None:
    marker = f"escaped-{uuid.uuid4().hex[:8]}"
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    name = _escapes(marker, outside)[index]
    with pytest.raises(ManifestError, match="not a plain relative path inside the work dir"):
        FIXIT.prepare(_task_with_files({"solution.py": "x = 1\n", name: "owned\n"}), work)
    assert not (outside / marker).exists() and not Path("/tmp", marker).exists()
    assert not (tmp_path / marker).exists()


def test_a_link_in_the_work_dir_is_never_followed(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outside.mkdir()
    (work / "sub").symlink_to(outside)
    (work / "solution.py").symlink_to(outside / "target.py")
    with pytest.raises(ManifestError, match=re.escape("cannot create starting file 'sub/x.py'")):
        write_workdir_file(work, "sub/x.py", "owned\n")
    with pytest.raises(ManifestError, match=re.escape("cannot create starting file 'solution.py'")):
        write_workdir_file(work, "solution.py", "owned\n")
    assert list(outside.iterdir()) == []


def test_unusable_files_and_names_say_what_is_wrong(tmp_path: Path) -> None:
    for files, message in (
        ([], "data.files, an object"),
        ({"check.py": "print(1)\n"}, "without check.py"),
        ({"solution.py": 7}, "a name and a text"),
        ({"a\0b": "x"}, "not a plain relative path"),
    ):
        work = tmp_path / uuid.uuid4().hex
        work.mkdir()
        with pytest.raises(ManifestError, match=message):
            FIXIT.prepare(_task_with_files(files), work)
    task = _task_with_files({"solution.py": "x = 1\n"})
    task["data"]["function"] = "f(); import os"
    with pytest.raises(ManifestError, match="function name"):
        FIXIT.prepare(task, tmp_path)


def test_nested_starting_files_are_written_below_the_work_dir(tmp_path: Path) -> None:
    FIXIT.prepare(_task_with_files({"solution.py": "x = 1\n", "lib/util/helpers.py": "y = 2\n"}), tmp_path)
    assert (tmp_path / "lib" / "util" / "helpers.py").read_text() == "y = 2\n"
    assert (tmp_path / "check.py").is_file() and (tmp_path / "solution.py").read_text() == "x = 1\n"


@pytest.mark.sandbox
@pytest.mark.slow
def test_the_runner_rejects_that_rollout_alone_and_writes_nothing_on_the_host(tmp_path: Path) -> None:
    marker = f"escaped-{uuid.uuid4().hex[:8]}"
    outside = tmp_path / "outside"
    outside.mkdir()
    good = FIXIT.generate(1, seed=3)[0]
    bad_relative = _task_with_files({"solution.py": "x = 1\n", "../" * 40 + f"tmp/{marker}": "owned\n"})
    bad_absolute = _task_with_files({"solution.py": "x = 1\n", str(outside / marker): "owned\n"})
    m = load_manifest(make_harness(tmp_path / "harnesses", "idle", LEAVE, task_sets=["fixit"]))
    specs = [
        RolloutSpec(run_id="r", iteration=0, harness=m, task=t, model="m", rollout_id=name)
        for name, t in (("good", good), ("relative", bad_relative), ("absolute", bad_absolute))
    ]
    up = Upstream()
    try:
        res = run_rollouts(
            specs,
            proxy_url=up.url,
            backend="bwrap",
            concurrency=3,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
        )
    finally:
        up.close()
    by_id = {r.rollout_id: r for r in res}
    assert by_id["good"].status == "succeeded" and by_id["good"].reward == 0.0  # the bug is still there
    for name in ("relative", "absolute"):
        r = by_id[name]
        assert r.status == "infra_error" and r.attempt == 1, (name, r.status, r.attempt)
        assert "not a plain relative path inside the work dir" in (r.error or ""), r.error
    assert not Path("/tmp", marker).exists() and not (outside / marker).exists()
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(row["rollout_id"] for row in rows) == ["absolute", "good", "relative"]
    assert not any(marker in name for _, _, names in os.walk(tmp_path) for name in names)


def _line(**fields: Any) -> str:
    task = {"task_set": "guess", "task_id": "t1", "prompt": "p", "data": {}, "max_turns": 1, **fields}
    return json.dumps(task)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_line().encode()[:-3] + b'\xff"}\n', r"tasks.jsonl:1: not UTF-8"),
        (("\n" + _line()).encode() + b"\n\xc3\x28\n", r"tasks.jsonl:3: not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
        (_line(task_id="a\0b").encode(), "printable characters"),
        (_line(task_id="two\nlines").encode(), "printable characters"),
        (_line(task_id="x" * 201).encode(), "1 to 200 printable characters"),
    ],
)
def test_a_task_file_that_is_not_utf8_too_deep_or_badly_named_is_a_clear_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    from clawpipe.sandbox import load_task_file

    p = tmp_path / "tasks.jsonl"
    p.write_bytes(content)
    with pytest.raises(ManifestError, match=message):
        load_task_file(p)


def test_a_task_nested_too_deep_is_refused_by_the_task_check() -> None:
    from clawpipe.tasks import validate_task

    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    task = {"task_set": "guess", "task_id": "t", "prompt": "p", "data": {"x": deep}, "max_turns": 1}
    with pytest.raises(ManifestError, match="nested too deep"):
        validate_task(task)
