"""``fixit``: a small Python program in the work dir fails its check; the model must fix it.

``prepare`` writes ``solution.py`` (one function with a planted bug) and ``check.py`` (runs the cases).
The harness (a real model or CLI agent editing files) may do anything in the work dir; the verifier then
copies only ``solution.py`` into a fresh temporary directory next to a check it renders itself from the
task (so editing check.py gains nothing) and runs it on the host with a timeout, resource limits and an
empty environment. Reward 1.0 when every case passes, else 0 (``reward_info`` has passed/total and the
output tail).

The verifier executes model-written code on the host (rlimits, new session, 10 s wall clock, killed as a
group): run untrusted models' fixit rollouts on a machine you can afford to lose, or wrap the verifier.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from clawpipe.tasks.base import sample_keys

log = logging.getLogger(__name__)

NAME = "fixit"
MAX_TURNS = 12
SAMPLING = {"temperature": 1.0, "max_tokens": 1024}
SOLUTION = "solution.py"
CHECK = "check.py"
CHECK_TIMEOUT_S = 10.0
MAX_SOLUTION_BYTES = 64 * 1024
N_VARIANTS = 50
_RESULT = re.compile(r"^RESULT (\S+) passed (\d+)/(\d+)$", re.MULTILINE)


def _ints(rng: random.Random, k: int, lo: int = -50, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


def _words(rng: random.Random, k: int) -> str:
    pool = ["blue", "sun", "queue", "audio", "rust", "tulip", "cup", "moon", "fog", "unit"]
    return " ".join(rng.choice(pool) for _ in range(k))


# name -> (function names, buggy body, case generator returning [args, expected] pairs)
_TEMPLATES: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "add": (
        ("add", "plus", "sum_two"),
        "def {f}(a, b):\n    return a - b\n",
        lambda rng: [[[a, b], a + b] for a, b in (_ints(rng, 2) for _ in range(5))],
    ),
    "clamp": (
        ("clamp", "bound", "limit"),
        "def {f}(x, lo, hi):\n    return max(hi, min(lo, x))\n",
        lambda rng: [[[x, -10, 10], max(-10, min(10, x))] for x in _ints(rng, 6, -30, 30)],
    ),
    "is_even": (
        ("is_even", "even", "has_no_remainder"),
        "def {f}(n):\n    return n % 2 == 1\n",
        lambda rng: [[[n], n % 2 == 0] for n in _ints(rng, 6, 0, 99)],
    ),
    "total": (
        ("total", "summed", "add_all"),
        "def {f}(xs):\n    s = 0\n    for x in xs[1:]:\n        s += x\n    return s\n",
        lambda rng: [[[xs], sum(xs)] for xs in ([*_ints(rng, rng.randint(2, 6), 1, 20)] for _ in range(5))],
    ),
    "count_vowels": (
        ("count_vowels", "vowels", "n_vowels"),
        "def {f}(s):\n    return sum(c in 'aeio' for c in s)\n",
        lambda rng: [[[s], sum(c in "aeiou" for c in s)] for s in (_words(rng, 3) for _ in range(5))],
    ),
    "factorial": (
        ("factorial", "fact", "product_upto"),
        "def {f}(n):\n    r = 1\n    for i in range(1, n):\n        r *= i\n    return r\n",
        lambda rng: [[[n], _factorial(n)] for n in sorted(rng.sample(range(2, 12), 5))],
    ),
    "maximum": (
        ("maximum", "largest", "top"),
        "def {f}(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best\n",
        lambda rng: [[[xs], max(xs)] for xs in (_ints(rng, rng.randint(1, 5), -40, -1) for _ in range(5))],
    ),
    "reverse_words": (
        ("reverse_words", "flip_words", "backwards"),
        "def {f}(s):\n    return s[::-1]\n",
        lambda rng: [[[s], " ".join(reversed(s.split()))] for s in (_words(rng, 3) for _ in range(4))],
    ),
}


def _factorial(n: int) -> int:
    r = 1
    for i in range(2, n + 1):
        r *= i
    return r


def render_check(function: str, cases: list[Any]) -> str:
    """The check script: loads solution.py from its own folder and runs the cases."""
    return f'''"""Runs the cases against solution.py. Exit 0 when all pass."""
import importlib.util, json, os, sys

CASES = json.loads({json.dumps(json.dumps(cases))})
here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("solution", os.path.join(here, "solution.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = getattr(module, {function!r})
passed = 0
for args, expected in CASES:
    try:
        got = fn(*args)
    except Exception as exc:
        got = f"raised {{exc!r}}"
    if got == expected:
        passed += 1
    else:
        print(f"FAIL {function}{{tuple(args)}} = {{got!r}}, expected {{expected!r}}")
nonce = sys.argv[1] if len(sys.argv) > 1 else "-"
print(f"RESULT {{nonce}} passed {{passed}}/{{len(CASES)}}")
sys.exit(0 if passed == len(CASES) else 1)
'''


# Sets rlimits inside the child, then runs the check as __main__ (no preexec_fn: unsafe in threaded hosts).
_LAUNCHER = (
    "import resource, runpy, sys\n"
    "for r, v in ((resource.RLIMIT_CPU, {cpu}), (resource.RLIMIT_AS, 1 << 30), (resource.RLIMIT_FSIZE, 16 << 20),"
    " (resource.RLIMIT_NOFILE, 64)):\n"
    "    resource.setrlimit(r, (v, v))\n"
    "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def run_check(solution: bytes, function: str, cases: list[Any]) -> dict[str, Any]:
    """Run the rendered check against ``solution`` in a temporary dir; passed/total/exit code/output tail."""
    nonce = secrets.token_hex(8)
    tmp = Path(tempfile.mkdtemp(prefix="clawpipe-fixit-"))
    try:
        (tmp / SOLUTION).write_bytes(solution)
        (tmp / CHECK).write_text(render_check(function, cases))
        log_path = tmp / "output.log"  # a file, not a pipe: RLIMIT_FSIZE caps what a chatty solution writes
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER.format(cpu=int(CHECK_TIMEOUT_S) + 1), CHECK, nonce],
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "LC_ALL": "C.UTF-8"},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=CHECK_TIMEOUT_S)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
        text = log_path.read_bytes()[-(1 << 20) :].decode("utf-8", errors="replace")
        passed = total = 0
        for m in _RESULT.finditer(text):
            if m.group(1) == nonce:
                passed, total = int(m.group(2)), int(m.group(3))
        return {
            "exit_code": proc.returncode,
            "timed_out": timed_out,
            "passed": passed,
            "total": total,
            "output_tail": text[-1000:],
        }
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, UnboundLocalError):
            pass
        shutil.rmtree(tmp, ignore_errors=True)


class FixitTaskSet:
    """Fix a planted bug in solution.py so that check.py passes (file-based; for real models and CLI agents)."""

    name = NAME

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` instances; an instance is (template, variant), assigned to train or eval by a stable hash."""
        names = sorted(_TEMPLATES)
        tasks = []
        for key in sample_keys(NAME, n, seed, split, lambda rng: f"{rng.choice(names)}-{rng.randrange(N_VARIANTS)}"):
            template = key.split("~")[0].rsplit("-", 1)[0]
            rng = random.Random(f"{NAME}:{key.split('~')[0]}")
            functions, body, cases_of = _TEMPLATES[template]
            function = rng.choice(functions)
            tasks.append(
                {
                    "task_set": NAME,
                    "task_id": f"{NAME}-{key}",
                    "prompt": f"The function {function} in {SOLUTION} has a bug and `python3 {CHECK}` fails. "
                    f"Fix {SOLUTION} so that `python3 {CHECK}` passes. Do not edit {CHECK}.",
                    "data": {
                        "template": template,
                        "function": function,
                        "files": {SOLUTION: body.format(f=function)},
                        "cases": cases_of(rng),
                    },
                    "max_turns": MAX_TURNS,
                    "sampling": dict(SAMPLING),
                }
            )
        return tasks

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        """Write the buggy solution.py and check.py into ``workdir``."""
        data = task["data"]
        workdir = Path(workdir)
        for name, text in data["files"].items():
            (workdir / name).write_text(text)
        (workdir / CHECK).write_text(render_check(data["function"], data["cases"]))

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        """Run a fresh copy of the check against the work dir's solution.py; 1.0 when every case passes."""
        try:
            function, cases = str(task["data"]["function"]), list(task["data"]["cases"])
        except (KeyError, TypeError) as exc:
            return 0.0, {"reason": f"task instance lacks data.function/data.cases: {exc}"}
        path = Path(workdir) / SOLUTION
        try:
            if path.is_symlink() or not path.is_file():
                return 0.0, {"reason": f"no regular file {SOLUTION} in the work dir"}
            if path.stat().st_size > MAX_SOLUTION_BYTES:
                return 0.0, {"reason": f"{SOLUTION} is larger than {MAX_SOLUTION_BYTES} bytes"}
            solution = path.read_bytes()
        except OSError as exc:
            return 0.0, {"reason": f"cannot read {SOLUTION}: {exc}"}
        try:
            result = run_check(solution, function, cases)
        except OSError as exc:
            log.warning("fixit check could not run task_id=%s error=%s", task.get("task_id"), exc)
            return 0.0, {"reason": f"the check could not run: {exc}"}
        ok = result["exit_code"] == 0 and result["total"] == len(cases) and result["passed"] == len(cases)
        info = {**result, "cases": len(cases)}
        if not ok:
            info["reason"] = "timeout" if result["timed_out"] else f"{result['passed']}/{len(cases)} cases passed"
        return (1.0 if ok else 0.0), info
