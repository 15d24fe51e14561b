"""fixit: prepare writes the buggy program and its check; verify runs a fresh check on the host."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clawpipe.tasks import fixit, get_task_set, validate_task

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


def test_generate_is_deterministic_with_disjoint_splits() -> None:
    assert FIXIT.generate(20, seed=3) == FIXIT.generate(20, seed=3)
    for task in FIXIT.generate(20, seed=3):
        validate_task(task)
    train = {t["task_id"].split("~")[0] for t in FIXIT.generate(300, seed=0)}
    evals = {t["task_id"].split("~")[0] for t in FIXIT.generate(60, seed=0, split="eval")}
    assert train.isdisjoint(evals)


def test_buggy_program_fails_and_fixed_program_passes(tmp_path: Path) -> None:
    for task in one_per_template():
        work = tmp_path / task["task_id"]
        work.mkdir()
        FIXIT.prepare(task, work)
        assert subprocess.run([sys.executable, "check.py"], cwd=work, capture_output=True).returncode != 0
        reward, info = FIXIT.verify(task, work)
        assert reward == 0.0 and "cases passed" in info["reason"], task["task_id"]
        (work / "solution.py").write_text(FIXES[task["data"]["template"]].format(f=task["data"]["function"]))
        assert subprocess.run([sys.executable, "check.py"], cwd=work, capture_output=True).returncode == 0
        reward, info = FIXIT.verify(task, work)
        assert reward == 1.0, (task["task_id"], info)


@pytest.mark.parametrize(
    "solution",
    [
        "import sys\nsys.exit(0)\n",  # exits 0 before the cases run
        "print('RESULT - passed 9/9')\nimport sys\nsys.exit(0)\n",  # forges a result line without the nonce
        "this is not python",
        "",
    ],
)
def test_reward_hacks_and_garbage_get_zero(tmp_path: Path, solution: str) -> None:
    task = FIXIT.generate(1, seed=0)[0]
    FIXIT.prepare(task, tmp_path)
    (tmp_path / "check.py").write_text("raise SystemExit(0)\n")  # editing the check gains nothing
    (tmp_path / "solution.py").write_text(solution)
    reward, info = FIXIT.verify(task, tmp_path)
    assert reward == 0.0 and info["reason"]


def test_a_hanging_solution_is_killed_at_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixit, "CHECK_TIMEOUT_S", 1.0)
    task = FIXIT.generate(1, seed=0)[0]
    (tmp_path / "solution.py").write_text("import time\nwhile True:\n    time.sleep(0.05)\n")
    reward, info = FIXIT.verify(task, tmp_path)
    assert reward == 0.0 and info["timed_out"] and info["reason"] == "timeout"


def test_missing_or_linked_solution(tmp_path: Path) -> None:
    task = FIXIT.generate(1, seed=0)[0]
    assert "no regular file" in FIXIT.verify(task, tmp_path)[1]["reason"]
    (tmp_path / "elsewhere.py").write_text("x = 1\n")
    (tmp_path / "solution.py").symlink_to(tmp_path / "elsewhere.py")
    assert FIXIT.verify(task, tmp_path)[0] == 0.0
    assert FIXIT.verify({"data": {}}, tmp_path)[0] == 0.0


def test_a_chatty_solution_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fixit, "CHECK_TIMEOUT_S", 2.0)
    task = FIXIT.generate(1, seed=0)[0]
    (tmp_path / "solution.py").write_text("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    reward, info = FIXIT.verify(task, tmp_path)
    assert reward == 0.0 and len(info["output_tail"]) <= 1000
