"""Work dirs of any depth: walks, copies and removal without recursion, and a result row for every rollout."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from clawpipe.capture import read_results
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.fstree import KEEP_FDS, copy_tree, remove_tree, walk
from clawpipe.sandbox.workdir import scrub_report, scrub_workdir
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness


def make_deep(root: Path, depth: int) -> None:
    """root/d/d/.../d (``depth`` levels) holding a file and a symlink to /etc/passwd at the bottom, made through
    directory descriptors (the full path is far beyond PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    with open(os.open("bottom.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("deep")
    os.symlink("/etc/passwd", "escape", dir_fd=fd)
    os.close(fd)


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """pytest's tmp_path, emptied with remove_tree afterwards: pytest's own clean-up recurses and would fail."""
    yield tmp_path
    for child in tmp_path.iterdir():
        remove_tree(child)


def open_fds(under: Path | None = None) -> int:
    """This process's open descriptors; with ``under``, only those on paths below it (what a walk of that
    tree opens), so a descriptor another thread opens meanwhile does not count."""
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(under))
    return n


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1500, pytest.param(10000, marks=pytest.mark.slow)])
def test_walk_copy_scrub_and_remove_at_any_depth(tmp_path: Path, depth: int) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "top.txt").write_text("top")
    make_deep(work, depth)
    fds = open_fds(tmp_path)
    assert fds == 0
    others = {(e.depth, e.name) for e in walk(work) if e.name != "d"}
    assert others == {(1, "top.txt"), (depth + 1, "bottom.txt"), (depth + 1, "escape")}
    assert max(e.depth for e in walk(work)) == depth + 1
    assert open_fds(tmp_path) == fds  # every descriptor the walk opened is closed again

    copy = tmp_path / "copy"
    copy_tree(work, copy)
    bottom = [e for e in walk(copy) if e.name in ("bottom.txt", "escape")]
    assert [(e.depth, e.name) for e in bottom] == [(depth + 1, "bottom.txt"), (depth + 1, "escape")]

    removed = scrub_workdir(work)
    assert removed == ["/".join(["d"] * depth + ["escape"])]  # the escaping link, found at the bottom
    assert [e.name for e in walk(work) if e.name == "escape"] == []

    remove_tree(work)
    remove_tree(copy)
    assert not work.exists() and not copy.exists()
    assert open_fds(tmp_path) == fds


def test_the_standard_library_cannot_do_this(tmp_path: Path) -> None:
    """Why fstree exists: os.walk recurses (and skips what it cannot open), shutil.rmtree recurses."""
    make_deep(tmp_path, 1500)
    with pytest.raises(RecursionError):
        list(os.walk(tmp_path))
    with pytest.raises(RecursionError):
        shutil.rmtree(tmp_path / "d")


def test_copy_keeps_modes_links_and_leaves_out_fifos(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "run.sh").write_text("#!/bin/sh\n")
    (src / "sub" / "run.sh").chmod(0o755)
    os.symlink("sub/run.sh", src / "link")
    os.mkfifo(src / "pipe")
    copy_tree(src, tmp_path / "dst")
    dst = tmp_path / "dst"
    assert (dst / "sub" / "run.sh").read_text() == "#!/bin/sh\n"
    assert (dst / "sub" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert os.readlink(dst / "link") == "sub/run.sh"
    assert not (dst / "pipe").exists()


def test_copy_keeps_hard_links_and_stops_at_its_byte_budget(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 1000)
    for i in range(50):
        os.link(src / "a", src / f"a{i}")
    (src / "b").write_bytes(b"b" * 3000)  # over what is left of the budget after "a"
    (src / "c").write_bytes(b"c" * 500)
    left_out = copy_tree(src, tmp_path / "dst", max_bytes=2000)
    dst = tmp_path / "dst"
    assert {(dst / f"a{i}").stat().st_ino for i in range(50)} == {(dst / "a").stat().st_ino}
    assert (dst / "a").read_bytes() == b"a" * 1000 and (dst / "c").read_bytes() == b"c" * 500
    assert not (dst / "b").exists() and left_out == 1


def test_a_parked_ancestor_swapped_during_the_walk_is_an_error(tmp_path: Path) -> None:
    make_deep(tmp_path, KEEP_FDS + 10)
    it = walk(tmp_path)
    for e in it:
        if e.depth == KEEP_FDS + 5:
            break
    # Move a parked (closed) ancestor aside and put a look-alike in its place: climbing back must notice.
    os.rename(tmp_path / "d" / "d", tmp_path / "moved")
    (tmp_path / "d" / "d").mkdir()
    with pytest.raises(OSError, match="moved while it was walked"):
        list(it)


DEEP_HARNESS = """
import os
fd = os.open(os.environ["CLAWPIPE_WORKDIR"], os.O_RDONLY | os.O_DIRECTORY)
for _ in range(DEPTH):
    os.mkdir("d", dir_fd=fd)
    fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
os.symlink("/etc/passwd", "answer.txt", dir_fd=fd)
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write("42")
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", pytest.param("bwrap", marks=pytest.mark.sandbox)])
def test_deep_work_dirs_end_with_a_result_row_and_are_removed(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    harnesses = [
        load_manifest(make_harness(tmp_path / "h", f"deep{n}", DEEP_HARNESS.replace("DEPTH", str(n))))
        for n in (1500, 10000)
    ]
    task = echo.generate(1)[0]
    specs = [
        RolloutSpec(run_id="deep", iteration=0, harness=m, task=task, model="m", sample_idx=i)
        for i, m in enumerate(harnesses)
    ]
    scratch = tmp_path / "scratch"
    res = run_rollouts(
        specs,
        proxy_url=upstream.url,
        backend=backend,
        concurrency=2,
        results_path=tmp_path / "results.jsonl",
        secret=b"s",
        scratch_dir=scratch,
        task_sets={"echo": echo},
    )
    assert [(r.status, r.reward) for r in res] == [("succeeded", 1.0), ("succeeded", 1.0)]
    for r, depth in zip(res, (1500, 10000), strict=True):
        path = "/".join(["d"] * depth + ["answer.txt"])
        assert json.loads(r.reward_info or "{}")["scrubbed"] == scrub_report([path])["scrubbed"]
    assert len(list(read_results(tmp_path / "results.jsonl"))) == 2
    assert [p for p in scratch.rglob("*") if p.name == "work"] == []  # work dirs removed
