"""The runner's verifier call: read-only verifiers run as they are; fixit's check runs only in a fresh
sandbox of the run's backend (bwrap, docker), and the process backend refuses it unless the operator opts in."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ConfigError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.backends import get_backend
from clawpipe.sandbox.backends.process import ProcessBackend
from clawpipe.sandbox.uids import UidPool
from clawpipe.sandbox.verify import check_backend, run_check, verify_rollout
from clawpipe.tasks import CheckProgram, get_task_set
from tests.sandbox.support import Upstream, make_harness

FIXIT = get_task_set("fixit")
# A harness that plays fixit by writing a solution: the right one, or one that attacks the verifier.
WRITER = """
import json, os, pathlib
task = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())
f = task["data"]["function"]
body = {body!r}.replace("FN", f)
pathlib.Path(os.environ["CLAWPIPE_WORKDIR"], "solution.py").write_text(body)
"""
HONEST = "def FN(a, b):\n    return a + b\n"
ATTACK = (
    "import pathlib\n"
    "try:\n    pathlib.Path({marker!r}).write_text('ran')\nexcept OSError:\n    pass\n"
    "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
    "def FN(a, b):\n    return AlwaysEqual()\n"
)


def add_tasks(n: int) -> list[dict[str, Any]]:
    return [t for t in FIXIT.generate(80, seed=1) if t["data"]["template"] == "add"][:n]


def rollouts(tmp_path: Path, backend: str, bodies: dict[str, str], **kw: Any) -> dict[str, Any]:
    specs = []
    task = add_tasks(1)[0]
    for name, body in bodies.items():
        manifest = load_manifest(
            make_harness(tmp_path / "harnesses", name, WRITER.format(body=body), task_sets=["fixit"])
        )
        specs.append(RolloutSpec(run_id="r", iteration=0, harness=manifest, task=task, model="m", rollout_id=name))
    up = Upstream()
    try:
        results = run_rollouts(
            specs,
            proxy_url=up.url,
            backend=backend,
            concurrency=2,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            max_attempts=1,
            **kw,
        )
    finally:
        up.close()
    return {r.rollout_id: r for r in results}


@pytest.mark.sandbox
def test_the_runner_checks_fixit_in_a_fresh_bwrap_sandbox(tmp_path: Path) -> None:
    marker = tmp_path / "ran-on-host"
    results = rollouts(tmp_path, "bwrap", {"honest": HONEST, "attack": ATTACK.format(marker=str(marker))})
    honest, attack = results["honest"], results["attack"]
    assert honest.status == "succeeded" and honest.reward == 1.0, honest
    assert attack.status == "succeeded" and attack.reward == 0.0, attack
    assert not marker.exists()  # the solution ran, but not on the host
    for r in (honest, attack):
        assert str(tmp_path) not in (r.reward_info or "")  # no host path in what is stored
    assert json.loads(attack.reward_info)["reason"] == "0/10 cases passed"  # 5 shown, 5 held out


def test_the_process_backend_refuses_fixit_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not isolate it.*CLAWPIPE_UNSAFE_PROCESS_CHECKS"):
        rollouts(tmp_path, "process", {"honest": HONEST})
    assert not (tmp_path / "results.jsonl").exists()
    with pytest.raises(ConfigError, match="does not isolate"):
        check_backend("process", "fixit", allow_unsafe=False)
    check_backend("bwrap", "fixit", allow_unsafe=False)
    check_backend("docker", "fixit", allow_unsafe=False)


def test_the_process_backend_runs_fixit_checks_when_the_operator_opts_in(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from clawpipe import config

    monkeypatch.setenv("CLAWPIPE_UNSAFE_PROCESS_CHECKS", "1")
    config.get_settings.cache_clear()
    results = rollouts(tmp_path, "process", {"honest": HONEST, "wrong": HONEST.replace("+", "-")})
    assert results["honest"].reward == 1.0 and results["wrong"].reward == 0.0
    assert str(tmp_path) not in (results["wrong"].reward_info or "")


def test_read_only_verifiers_run_as_they_are_on_any_backend(tmp_path: Path) -> None:
    guess = get_task_set("guess")
    task = guess.generate(1, seed=0)[0]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "transcript.json").write_text(json.dumps({"turns": [{"reply": str(task["data"]["target"])}]}))
    backend = ProcessBackend()
    assert verify_rollout(guess, task, tmp_path, backend, allow_unsafe=False) == guess.verify(task, tmp_path)


@pytest.mark.docker
@pytest.mark.slow
def test_fixit_checks_in_docker(tmp_path: Path, docker_host: str) -> None:
    backend = get_backend("docker")
    try:
        task = add_tasks(1)[0]
        f = task["data"]["function"]
        outcomes = {}
        for name, body in {
            "honest": HONEST,
            "eq": ATTACK.format(marker=str(tmp_path / "m")),
            "net": "import socket\nsocket.create_connection(('127.0.0.1', 8000), timeout=1)\n" + HONEST,
        }.items():
            work = tmp_path / name / "work"
            work.mkdir(parents=True)
            (work / "solution.py").write_text(body.replace("FN", f))
            outcomes[name] = verify_rollout(FIXIT, task, work, backend)
    finally:
        backend.close()
    assert outcomes["honest"][0] == 1.0, outcomes["honest"]
    assert outcomes["eq"][0] == 0.0 and not (tmp_path / "m").exists()
    assert outcomes["net"][0] == 0.0 and "ConnectionRefusedError" in outcomes["net"][1]["reason"]


def test_a_check_cannot_write_more_than_the_host_reads(tmp_path: Path) -> None:
    flood = (
        "import errno, os\nout = os.environ['CLAWPIPE_OUTPUT']\ntry:\n"
        "    with open(out + '/result.json', 'w') as f:\n        f.write('1' * (8 << 20))\n"
        "except OSError as exc:\n    size = os.path.getsize(out + '/result.json')\n"
        "    open(out + '/log.txt', 'w').write(f'{errno.errorcode[exc.errno]} {size}')\n"
    )
    program = CheckProgram(files={"flood.py": flood}, command=("python3", "-I", "flood.py"), max_result_bytes=1024)
    run = run_check(ProcessBackend(), program, tmp_path, scratch=tmp_path / "scratch")
    assert run.log_tail == f"EFBIG {1 << 20}"  # stopped at the file-size limit (1 MiB), set before it started
    assert run.output is None and "larger than 1024 bytes" in (run.reason or "")
    assert not list((tmp_path / "scratch").iterdir())  # the check's folder is gone


@pytest.mark.sandbox
def test_a_check_runs_as_a_uid_of_its_own_that_is_free_again_afterwards(tmp_path: Path) -> None:
    ident = (
        "import json, os\nout = os.environ['CLAWPIPE_OUTPUT']\n"
        "st = os.stat(out + '/result.json')\n"
        "json.dump([os.getuid(), os.geteuid(), os.getgid(), st.st_uid, st.st_gid], open(out + '/result.json', 'w'))\n"
    )
    program = CheckProgram(files={"ident.py": ident}, command=("python3", "-I", "ident.py"))
    pool = UidPool(1_950_000, 2, tmp_path / "locks")
    held = pool.lease()  # a neighbour's sandbox holds the first uid of the range
    backend = get_backend("bwrap")
    try:
        run = run_check(backend, program, tmp_path, scratch=tmp_path / "scratch", uids=pool)
    finally:
        backend.close()
        held.release()
    assert run.exit_code == 0, run
    assert run.output == [1_950_001] * 5  # not the neighbour's uid; its result file was its own to write
    again = pool.lease(wait_s=0)
    assert again.user.uid == 1_950_000  # free again, and so is the check's own (else the lease above waits)
    again.release()


@pytest.mark.sandbox
def test_a_check_whose_folder_cannot_be_made_gives_its_uid_back(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(scratch)], check=True)  # a dead disk
    pool = UidPool(1_950_010, 1, tmp_path / "locks")
    backend = get_backend("bwrap")
    fds = len(os.listdir("/proc/self/fd"))
    try:
        program = CheckProgram(files={"c.py": "pass\n"}, command=("python3", "-I", "c.py"))
        with pytest.raises(OSError, match="Read-only file system"):
            run_check(backend, program, tmp_path, scratch=scratch, uids=pool)
        assert len(os.listdir("/proc/self/fd")) == fds  # no lock file left open
        pool.lease(wait_s=0).release()  # the range's only uid is free again
    finally:
        backend.close()
        subprocess.run(["umount", str(scratch)], check=False)
