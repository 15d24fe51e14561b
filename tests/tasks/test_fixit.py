"""fixit: prepare writes the buggy program and its check; the verifier runs a fresh check in a real bwrap
sandbox (never on the host) and the host scores the plain values it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ConfigError
from clawpipe.sandbox.backends import Backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import CheckRun, fixit, get_task_set, needs_sandbox, validate_task

FIXIT = get_task_set("fixit")
FIXES = {
    "add": "def {f}(a, b):\n    return a + b\n",
    "clamp": "def {f}(x, lo, hi):\n    return max(lo, min(hi, x))\n",
    "is_even": "def {f}(n):\n    return n % 2 == 0\n",
    "total": "def {f}(xs):\n    return sum(xs)\n",
    "count_vowels": "def {f}(s):\n    return sum(c in 'aeiou' for c in s)\n",
    "factorial": "import math\ndef {f}(n):\n    return math.factorial(n)\n",
    "maximum": "def {f}(xs):\n    return max(xs)\n",
    "reverse_words": "def {f}(s):\n    return ' '.join(reversed(s.split()))\n",
}


def one_per_template() -> list[dict]:
    seen: dict[str, dict] = {}
    for task in FIXIT.generate(200, seed=0):
        seen.setdefault(task["data"]["template"], task)
    assert set(seen) == set(FIXES)
    return list(seen.values())


def add_task() -> dict[str, Any]:
    return next(t for t in FIXIT.generate(40, seed=0) if t["data"]["template"] == "add")


def fixed(task: dict[str, Any]) -> str:
    return FIXES[task["data"]["template"]].format(f=task["data"]["function"])


def test_generate_is_deterministic_with_disjoint_splits() -> None:
    assert FIXIT.generate(20, seed=3) == FIXIT.generate(20, seed=3)
    for task in FIXIT.generate(20, seed=3):
        validate_task(task)
    train = {t["task_id"].split("~")[0] for t in FIXIT.generate(300, seed=0)}
    evals = {t["task_id"].split("~")[0] for t in FIXIT.generate(60, seed=0, split="eval")}
    assert train.isdisjoint(evals)


def test_the_work_dir_check_tells_the_model_what_fails(tmp_path: Path) -> None:
    task = add_task()
    FIXIT.prepare(task, tmp_path)
    run = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1 and "FAIL" in run.stdout and "passed 0/5" in run.stdout
    (tmp_path / "solution.py").write_text(fixed(task))
    assert subprocess.run([sys.executable, "check.py"], cwd=tmp_path, capture_output=True).returncode == 0


def test_verify_never_runs_the_solution_on_the_host(tmp_path: Path) -> None:
    task = add_task()
    marker = tmp_path / "ran-on-host"
    (tmp_path / "solution.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n" + fixed(task))
    assert needs_sandbox(FIXIT)
    with pytest.raises(ConfigError, match="never does so on the host"):
        FIXIT.verify(task, tmp_path)
    assert not marker.exists()


def test_the_sandboxed_check_holds_arguments_never_expected_values() -> None:
    task = add_task()
    program = FIXIT.check_program(task)
    assert program.inputs == ("solution.py",)
    text = program.files["check.py"]
    cases = task["data"]["cases"] + task["data"]["hidden"]["cases"]
    arguments = [args for args, _ in cases]
    assert json.dumps(json.dumps(arguments)) in text
    assert json.dumps(json.dumps(cases)) not in text


def document(*values: Any) -> CheckRun:
    return CheckRun(output={"results": [{"value": v} for v in values]}, exit_code=0)


def test_score_compares_plain_values_it_holds_itself() -> None:
    task = add_task()
    expected = [e for _, e in task["data"]["cases"] + task["data"]["hidden"]["cases"]]
    assert FIXIT.score(task, document(*expected))[0] == 1.0
    assert FIXIT.score(task, document(*[float(e) for e in expected]))[0] == 1.0  # 3.0 is 3, as in Python
    forged: dict[str, CheckRun] = {
        "one wrong": document(*expected[:-1], expected[-1] + 1),
        "booleans for numbers": document(*[True] * len(expected)),
        "strings for numbers": document(*[str(e) for e in expected]),
        "too few results": document(*expected[:-1]),
        "extra keys claim a pass": CheckRun(
            output={"results": [{"value": e, "passed": True} for e in expected[:-1]] + [{"passed": True}]}
        ),
        "reward fields": CheckRun(output={"reward": 1.0, "passed": 5, "total": 5, "ok": True}),
        "a list instead of an object": CheckRun(output=[{"value": e} for e in expected]),
        "right values after a timeout": CheckRun(output=document(*expected).output, timed_out=True),
        "no document": CheckRun(output=None, reason="the check wrote nothing"),
    }
    for name, run in forged.items():
        reward, info = FIXIT.score(task, run)
        assert reward == 0.0 and info["reason"], name
        json.dumps(info)


@pytest.mark.sandbox
def test_buggy_programs_fail_and_fixed_ones_pass_in_bwrap(tmp_path: Path, bwrap: Backend) -> None:
    for task in one_per_template():
        work = tmp_path / task["task_id"]
        work.mkdir()
        FIXIT.prepare(task, work)
        reward, info = verify_rollout(FIXIT, task, work, bwrap)
        assert reward == 0.0 and "cases passed" in info["reason"], (task["task_id"], info)
        (work / "solution.py").write_text(fixed(task))
        (work / "check.py").write_text("raise SystemExit(0)\n")  # the work dir's check decides nothing
        reward, info = verify_rollout(FIXIT, task, work, bwrap)
        assert reward == 1.0, (task["task_id"], info)
        assert sorted(p.name for p in work.iterdir()) == ["check.py", "solution.py"]  # the check ran on a copy


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "solution",
    [
        "import sys\nsys.exit(0)\n",  # exits 0 before the cases run
        "print('RESULT - passed 9/9')\nimport sys\nsys.exit(0)\n",  # the old result line
        "this is not python",
        "",
    ],
)
def test_exits_and_garbage_get_zero(tmp_path: Path, bwrap: Backend, solution: str) -> None:
    task = add_task()
    (tmp_path / "solution.py").write_text(solution)
    reward, info = verify_rollout(FIXIT, task, tmp_path, bwrap)
    assert reward == 0.0 and info["reason"]


@pytest.mark.sandbox
def test_a_hanging_solution_is_killed_at_the_timeout(
    tmp_path: Path, bwrap: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fixit, "CHECK_TIMEOUT_S", 1.0)
    (tmp_path / "solution.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    reward, info = verify_rollout(FIXIT, add_task(), tmp_path, bwrap)
    assert reward == 0.0 and info["timed_out"] and info["reason"] == "timeout"


@pytest.mark.sandbox
def test_missing_linked_or_huge_solution(tmp_path: Path, bwrap: Backend) -> None:
    task = add_task()
    reward, info = verify_rollout(FIXIT, task, tmp_path, bwrap)
    assert reward == 0.0 and "no solution.py" in info["reason"]
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere.py"
    elsewhere.write_text(fixed(task))
    (tmp_path / "solution.py").symlink_to(elsewhere)
    reward, info = verify_rollout(FIXIT, task, tmp_path, bwrap)
    assert reward == 0.0 and "symbolic link" in info["reason"]
    (tmp_path / "solution.py").unlink()
    (tmp_path / "solution.py").write_text(fixed(task) + "#" * (fixit.MAX_SOLUTION_BYTES + 1))
    reward, info = verify_rollout(FIXIT, task, tmp_path, bwrap)
    assert reward == 0.0 and "larger" in info["reason"]
    assert verify_rollout(FIXIT, {"data": {}}, tmp_path, bwrap)[0] == 0.0


@pytest.mark.sandbox
def test_a_chatty_solution_is_capped(tmp_path: Path, bwrap: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixit, "CHECK_TIMEOUT_S", 2.0)
    (tmp_path / "solution.py").write_text("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    reward, info = verify_rollout(FIXIT, add_task(), tmp_path, bwrap)
    assert reward == 0.0 and len(info.get("output_tail", "")) <= 1000
