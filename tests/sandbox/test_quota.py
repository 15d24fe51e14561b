"""Per-rollout disk quotas: a harness that writes past [resources] disk_mb gets `disk_quota`, its neighbour
and the host's disks are unaffected."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox import runner as runner_module
from clawpipe.sandbox.limits import Limits
from clawpipe.sandbox.quota import quota_inodes
from tests.sandbox.support import URLLIB_HARNESS, EchoTaskSet, Upstream, make_harness

FILL_WORKDIR = """
import os, sys
chunk = b"x" * (1 << 20)
written = 0
try:
    with open(os.path.join(os.environ["CLAWPIPE_WORKDIR"], "big.bin"), "wb") as f:
        for _ in range(64):
            f.write(chunk)
            f.flush()
            written += 1
except OSError as exc:
    print(f"stopped after {written} MiB: {exc}", file=sys.stderr)
"""

FILL_LOGS = """
import sys
line = "y" * 1023 + "\\n"
for _ in range(64 * 1024):
    sys.stdout.write(line)
"""

MANY_FILES = """
import os
for i in range(40):
    with open(os.path.join(os.environ["CLAWPIPE_WORKDIR"], f"part{i}.bin"), "wb") as f:
        f.write(b"z" * (1 << 20))
"""

EMPTY_FILES = """
import os, sys
made = 0
try:
    for i in range(20000):
        os.close(os.open(os.path.join(os.environ["CLAWPIPE_WORKDIR"], f"e{i}"), os.O_CREAT | os.O_WRONLY))
        made += 1
except OSError as exc:
    print(f"stopped after {made} files: {exc}", file=sys.stderr)
print(f"made {made}", file=sys.stderr)
"""

# Within a 16 MB quota: one 1 MiB file under 200 more names (hard links take no space) and 20 sparse files
# of 15 MiB that hold no block at all.
LINKS_AND_HOLES = """
import os
work = os.environ["CLAWPIPE_WORKDIR"]
with open(os.path.join(work, "one.bin"), "wb") as f:
    f.write(b"q" * (1 << 20))
for i in range(200):
    os.link(os.path.join(work, "one.bin"), os.path.join(work, f"link{i}"))
for i in range(20):
    with open(os.path.join(work, f"hole{i}"), "wb") as f:
        f.truncate(15 << 20)
"""

SHOUT = """
import os, sys
chunk = b"s" * (1 << 20)
for _ in range(200):
    sys.stdout.buffer.write(chunk)  # one endless line, far past the quota
sys.stdout.flush()
sys.stderr.write("the end of stderr\\n")
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w").write("41")
"""


def run(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, backend: str, harnesses: list[Any], **kw: Any
) -> list[Any]:
    """One rollout of the echo task per harness, all at once; ``kw`` goes to run_rollouts."""
    task = echo.generate(1)[0]
    specs = [
        RolloutSpec(run_id="quota", iteration=0, harness=m, task=task, model="m", sample_idx=i)
        for i, m in enumerate(harnesses)
    ]
    return run_rollouts(
        specs,
        proxy_url=upstream.url,
        backend=backend,
        concurrency=len(specs),
        results_path=tmp_path / "results.jsonl",
        secret=b"s",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        **kw,
    )


def disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("backend", ["process", pytest.param("bwrap", marks=pytest.mark.sandbox)])
def test_writing_past_the_quota_is_disk_quota_and_the_neighbour_is_unaffected(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    quota = {"disk_mb": 16}
    fill = load_manifest(make_harness(tmp_path / "h", "fill", FILL_WORKDIR, resources=quota))
    logs = load_manifest(make_harness(tmp_path / "h", "logs", FILL_LOGS, resources=quota))
    normal = load_manifest(make_harness(tmp_path / "h", "normal", URLLIB_HARNESS, resources=quota))
    free = disk_free(tmp_path)
    res = run(tmp_path, upstream, echo, backend, [fill, logs, normal])
    assert [r.status for r in res] == ["disk_quota", "disk_quota", "succeeded"], [r.stderr_tail[-300:] for r in res]
    assert "disk quota ([resources] disk_mb = 16)" in res[0].error  # stderr itself hit the quota: it says nothing
    assert res[2].reward == 1.0 and res[2].n_calls == 1
    # 64 MiB written twice, none of it on the host's disk (the margin absorbs other processes' writes)
    assert free - disk_free(tmp_path) < 32 << 20
    assert not [p for p in (tmp_path / "scratch").rglob("*") if p.name == "work"]  # unmounted and removed


@pytest.mark.sandbox
def test_empty_files_past_the_inode_share_are_disk_quota(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    """Empty files take no blocks: without an inode cap, 16 MB of quota held millions of them (each one charged
    to the host-side walk that scrubs the work dir, and copied to disk for --keep-workdirs)."""
    quota = {"disk_mb": 16}
    many = load_manifest(make_harness(tmp_path / "h", "many", EMPTY_FILES, resources=quota))
    normal = load_manifest(make_harness(tmp_path / "h", "normal", URLLIB_HARNESS, resources=quota))
    res = run(tmp_path, upstream, echo, "bwrap", [many, normal])
    assert [r.status for r in res] == ["disk_quota", "succeeded"], [r.stderr_tail[-300:] for r in res]
    made = int(res[0].stderr_tail.rsplit("made ", 1)[1].split()[0])
    assert made <= quota_inodes(16) and "No space left on device" in res[0].stderr_tail
    assert f"limit of {quota_inodes(16)} files" in res[0].error
    assert res[1].reward == 1.0


@pytest.mark.parametrize("backend", ["process", pytest.param("bwrap", marks=pytest.mark.sandbox)])
def test_kept_work_dirs_survive_the_unmount(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    normal = load_manifest(make_harness(tmp_path / "h", "normal", URLLIB_HARNESS))
    res = run(tmp_path, upstream, echo, backend, [normal], keep_workdirs=True)
    work = Path(res[0].workdir)
    assert (work / "out" / "answer.txt").read_text() == "42"
    assert (work / "start.txt").is_file() and not os.path.ismount(work.parent)


@pytest.mark.sandbox
def test_a_kept_work_dir_takes_no_more_disk_than_its_quota(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    """Hard links and holes fill no quota, but a plain copy writes every name's bytes: 500 MB on the host's
    disk from 16 MB of quota."""
    tricky = load_manifest(make_harness(tmp_path / "h", "tricky", LINKS_AND_HOLES, resources={"disk_mb": 16}))
    free = disk_free(tmp_path)
    res = run(tmp_path, upstream, echo, "bwrap", [tricky], keep_workdirs=True)
    work = Path(res[0].workdir)
    assert res[0].status == "succeeded", res[0].stderr_tail
    assert (work / "one.bin").stat().st_size == 1 << 20 and (work / "start.txt").is_file()
    assert (work / "link7").stat().st_ino == (work / "one.bin").stat().st_ino  # links stay links
    files = {p.stat().st_ino: p.stat().st_size for p in work.rglob("*") if p.is_file()}
    assert sum(files.values()) <= 16 << 20, sorted(files.values())
    assert free - disk_free(tmp_path) < 32 << 20


@pytest.mark.docker
def test_docker_logs_past_the_quota_are_cut_not_an_infra_error(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    """Docker keeps a container's output itself and the runner copies it into the rollout's folder afterwards:
    200 MB of stdout under a 16 MB quota failed that copy (ENOSPC), which made the rollout an infra error."""
    shout = load_manifest(make_harness(tmp_path / "h", "shout", SHOUT, resources={"disk_mb": 16}))
    res = run(tmp_path, upstream, echo, "docker", [shout])
    assert (res[0].status, res[0].reward) in {("succeeded", 0.0), ("disk_quota", 0.0)}, res[0].error
    assert "the end of stderr" in res[0].stderr_tail


def test_without_a_mount_the_quota_is_a_file_size_limit_and_a_size_check(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no tmpfs can be mounted (no CAP_SYS_ADMIN): one file over the quota is stopped by the kernel
    (RLIMIT_FSIZE), many smaller files are caught by the size check after the run."""
    monkeypatch.setattr(runner_module, "mount_quota", lambda folder, disk_mb: False)
    quota = {"disk_mb": 16}
    big = load_manifest(make_harness(tmp_path / "h", "big", FILL_WORKDIR, resources=quota))
    many = load_manifest(make_harness(tmp_path / "h", "many", MANY_FILES, resources=quota))
    normal = load_manifest(make_harness(tmp_path / "h", "normal", URLLIB_HARNESS, resources=quota))
    res = run(tmp_path, upstream, echo, "process", [big, many, normal])
    assert [r.status for r in res] == ["disk_quota", "disk_quota", "succeeded"], [r.stderr_tail[-300:] for r in res]


def test_disk_mb_is_read_from_the_manifest_with_a_default(tmp_path: Path) -> None:
    assert load_manifest(make_harness(tmp_path, "dflt", "pass\n")).limits.disk_mb == Limits().disk_mb == 1024
    assert load_manifest(make_harness(tmp_path, "small", "pass\n", resources={"disk_mb": 64})).limits.disk_mb == 64
    with pytest.raises(ManifestError, match=r"`resources.disk_mb` must be an integer from 1 to 1048576"):
        load_manifest(make_harness(tmp_path, "bad", "pass\n", resources={"disk_mb": 0}))


def test_rollout_folders_left_mounted_by_a_killed_runner_are_swept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from clawpipe.sandbox.quota import stale_mounts, sweep_stale_mounts

    folder = tmp_path / "rollout folder"  # a space: mountinfo escapes it
    folder.mkdir()
    code = (
        "import sys, time; from pathlib import Path; from clawpipe.sandbox.quota import mount_quota; "
        "print(mount_quota(Path(sys.argv[1]), 4), flush=True); time.sleep(60)"
    )
    runner = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        mounted = runner.stdout.readline().strip() == "True"  # type: ignore[union-attr]
    finally:
        runner.kill()
        runner.wait()
    if not mounted:
        from tests.conftest import _missing

        _missing("mounting a tmpfs needs root (the runner falls back to a file size limit)")
    assert os.path.ismount(folder)  # the killed runner could not unmount it
    with open("/proc/self/mountinfo") as f:
        assert str(folder) in stale_mounts(f.read())
    assert sweep_stale_mounts() >= 1
    assert not os.path.ismount(folder)


def test_mounts_of_live_runners_and_other_tmpfs_are_not_stale() -> None:
    from clawpipe.sandbox.quota import stale_mounts

    me = os.getpid()
    info = (
        f"36 25 0:32 / /a rw - tmpfs clawpipe-rollout-{me} rw,size=4096k\n"
        "37 25 0:33 / /b rw - tmpfs tmpfs rw\n"
        "38 25 0:34 / /c rw - ext4 clawpipe-rollout-999999999 rw\n"
        "39 25 0:35 / /d\\040e rw - tmpfs clawpipe-rollout-999999999 rw\n"
    )
    assert stale_mounts(info) == ["/d e"]
