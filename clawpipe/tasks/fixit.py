"""``fixit``: a small Python program in the work dir fails its check; the model must fix it.

``prepare`` writes ``solution.py`` (one function with a planted bug) and ``check.py`` (runs the shown cases,
``data.cases``, and prints what failed; the harness may run it inside its own sandbox). The verifier also
calls the function on held-out cases (``data.hidden.cases``), which the runner leaves out of the task file
a harness reads: a solution that returns the shown answers from a table, without fixing the bug, fails
them.

Transcript contract: none. ``fixit`` is file-based: a turn is whatever the harness does with one model
call (read a file, edit ``solution.py``, run the check); the verifier reads no transcript, ``answer`` and
``reply`` mean nothing here, only the final ``solution.py`` in the work dir counts.

Verification runs the model's code, so it never happens on the host (``needs_sandbox = True``): the
rollout runner copies ``solution.py`` alone into a fresh sandbox of the run's backend (no network, a host
uid of its own, limits) next to a check rendered from the task (editing check.py gains nothing). That check calls
the function on each case's arguments and writes the results as a JSON document of plain values; the host
parses it (size and depth limits, no NaN) and compares each value with the expected one it holds itself
(:func:`~clawpipe.tasks.values.same_value`). The expected values never enter the sandbox, and an object
with a custom ``__eq__`` cannot pass (it is not JSON). Reward 1.0 when every case matches, else 0
(``reward_info``: passed/total, the first failures, the check's exit code and output tail).
Calling :meth:`FixitTaskSet.verify` directly raises: use ``clawpipe.sandbox.verify.verify_rollout``.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from clawpipe.errors import ConfigError, ManifestError
from clawpipe.tasks.base import data_view, sample_keys, write_workdir_file
from clawpipe.tasks.check import CheckProgram, CheckRun
from clawpipe.tasks.values import same_value

log = logging.getLogger(__name__)

NAME = "fixit"
MAX_TURNS = 12
HARNESS_DATA = ("template", "function", "files", "cases")  # never data.hidden: the held-out cases
SAMPLING = {"temperature": 1.0, "max_tokens": 1024}
SOLUTION = "solution.py"
CHECK = "check.py"
CHECK_TIMEOUT_S = 10.0
MAX_SOLUTION_BYTES = 64 * 1024
MAX_VALUE_CHARS = 64 * 1024  # one case's result, as JSON text
N_VARIANTS = 50
SHOWN_FAILURES = 3
HELD_OUT_DRAWS = 50


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


def _held_out(rng: random.Random, cases_of: Any, shown: list[Any]) -> list[Any]:
    """Cases for the verifier alone, at least one on arguments the shown cases lack: a solution that looks
    up the shown answers (check.py holds them) instead of fixing the bug fails them."""
    seen = {json.dumps(args) for args, _ in shown}
    for _ in range(HELD_OUT_DRAWS):
        cases: list[Any] = cases_of(rng)
        if any(json.dumps(args) not in seen for args, _ in cases):
            return cases
    raise ManifestError("fixit could not draw a held-out case unlike the shown ones")  # a template too narrow


def _factorial(n: int) -> int:
    r = 1
    for i in range(2, n + 1):
        r *= i
    return r


def render_check(function: str, cases: list[Any]) -> str:
    """The work dir's check.py, for the harness: runs the cases against solution.py, exit 0 when all pass.

    It decides no reward (the verifier renders its own check); it tells the model what fails.
    """
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
print(f"passed {{passed}}/{{len(CASES)}}")
sys.exit(0 if passed == len(CASES) else 1)
'''


def render_sandbox_check(function: str, arguments: list[Any]) -> str:
    """The verifier's check (run in a sandbox): calls ``function`` on each argument list and writes the
    results as plain JSON to $CLAWPIPE_OUTPUT/result.json (the check protocol of clawpipe.tasks.check).

    It holds the arguments only: the expected values stay on the host.
    """
    return f'''"""Calls {function} of solution.py on each case and writes the results as JSON for the host."""
import json, os, resource

# Hard limits before any solution code runs (the runner set the file size limit already): the sandbox
# user has no capability to raise them again.
for _r, _v in ((resource.RLIMIT_CPU, {int(CHECK_TIMEOUT_S)}), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(_r, (_v, _v))
_out = os.environ["CLAWPIPE_OUTPUT"]
_log = os.open(os.path.join(_out, "log.txt"), os.O_WRONLY | os.O_APPEND)
os.dup2(_log, 1)
os.dup2(_log, 2)
_result = os.open(os.path.join(_out, "result.json"), os.O_WRONLY)
_dumps = json.dumps


def _finish(doc):
    data = _dumps(doc, allow_nan=False).encode()
    while data:
        data = data[os.write(_result, data):]
    os._exit(0)


def _describe(exc):
    try:
        return f"{{type(exc).__name__}}: {{str(exc)[:200]}}"
    except BaseException:
        return "an exception that cannot be described"


ARGUMENTS = json.loads({json.dumps(json.dumps(arguments))})
try:
    import importlib.util
    _path = os.path.join(os.environ["CLAWPIPE_WORKDIR"], "solution.py")
    _spec = importlib.util.spec_from_file_location("solution", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    fn = getattr(_module, {function!r})
except BaseException as exc:
    _finish({{"error": "solution.py did not load: " + _describe(exc)}})
results = []
for args in ARGUMENTS:
    try:
        text = _dumps(fn(*args), allow_nan=False)
        if len(text) > {MAX_VALUE_CHARS}:
            raise ValueError("the result is larger than {MAX_VALUE_CHARS} characters as JSON")
        results.append({{"value": json.loads(text)}})
    except BaseException as exc:
        results.append({{"error": _describe(exc)}})
_finish({{"results": results}})
'''


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _cases_of(task: dict[str, Any]) -> tuple[str, list[tuple[list[Any], Any]]]:
    """(function, [(arguments, expected)]) of a task, the held-out cases (``data.hidden.cases``, absent in
    tasks made before them) after the shown ones; ManifestError when the task data is not usable."""
    try:
        data = task["data"]
        function = data["function"]
        hidden = data.get("hidden", {}).get("cases", [])
        cases = [(list(args), expected) for args, expected in [*data["cases"], *hidden]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(
            f"fixit task lacks data.function/data.cases ([[args], expected] pairs; data.hidden, when present, "
            f"an object whose cases are such pairs too): {exc}"
        ) from exc
    if not isinstance(function, str) or not function.isidentifier() or not cases:
        raise ManifestError(f"fixit task needs a function name and at least one case, got {function!r}")
    return function, cases


class FixitTaskSet:
    """Fix a planted bug in solution.py so that check.py passes (file-based; for real models and CLI agents)."""

    name = NAME
    needs_sandbox = True  # the verifier runs solution.py: only ever in a sandbox (clawpipe.sandbox.verify)

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` instances; an instance is (template, variant), assigned to train or eval by a stable hash."""
        names = sorted(_TEMPLATES)
        tasks = []
        for key in sample_keys(NAME, n, seed, split, lambda rng: f"{rng.choice(names)}-{rng.randrange(N_VARIANTS)}"):
            template = key.split("~")[0].rsplit("-", 1)[0]
            rng = random.Random(f"{NAME}:{key.split('~')[0]}")
            functions, body, cases_of = _TEMPLATES[template]
            function = rng.choice(functions)
            cases = cases_of(rng)
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
                        "cases": cases,
                        "hidden": {"cases": _held_out(rng, cases_of, cases)},
                    },
                    "max_turns": MAX_TURNS,
                    "sampling": dict(SAMPLING),
                }
            )
        return tasks

    def harness_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """The task without the held-out cases (``data.hidden``), which a solution could otherwise look up."""
        return data_view(task, HARNESS_DATA)

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        """Write the buggy solution.py and check.py into ``workdir``; ManifestError for unusable task data
        (a file name leaving the work dir among them: the runner prepares work dirs as root)."""
        function, _ = _cases_of(task)
        files = task["data"].get("files")
        if not isinstance(files, dict) or CHECK in files:
            raise ManifestError(f"fixit task needs data.files, an object of file name -> text (without {CHECK})")
        for name, text in files.items():
            write_workdir_file(Path(workdir), name, text)
        write_workdir_file(Path(workdir), CHECK, render_check(function, task["data"]["cases"]))

    def check_program(self, task: dict[str, Any]) -> CheckProgram:
        """The sandboxed check: solution.py copied in, the function called on each case's arguments."""
        function, cases = _cases_of(task)
        return CheckProgram(
            files={CHECK: render_sandbox_check(function, [args for args, _ in cases])},
            command=("python3", "-I", "-S", CHECK),
            inputs=(SOLUTION,),
            timeout_s=CHECK_TIMEOUT_S,
            max_input_bytes=MAX_SOLUTION_BYTES,
            max_result_bytes=len(cases) * (MAX_VALUE_CHARS + 1024),
        )

    def score(self, task: dict[str, Any], run: CheckRun) -> tuple[float, dict[str, Any]]:
        """1.0 when the check's document holds, for every case, a value equal to the expected one."""
        _, cases = _cases_of(task)
        info: dict[str, Any] = {"passed": 0, "total": len(cases), **run.summary()}
        doc = run.output
        if run.timed_out:
            return 0.0, {**info, "reason": "timeout"}
        if run.skipped_inputs:
            return 0.0, {**info, "reason": f"no usable {SOLUTION}: {run.skipped_inputs[0]}"}
        if doc is None:
            return 0.0, {**info, "reason": f"the check wrote no usable result: {run.reason}"}
        if isinstance(doc, dict) and isinstance(doc.get("error"), str) and "results" not in doc:
            return 0.0, {**info, "reason": doc["error"][:300]}
        results = doc.get("results") if isinstance(doc, dict) else None
        if not isinstance(results, list) or len(results) != len(cases):
            return 0.0, {**info, "reason": f"the check's result does not hold {len(cases)} case results"}
        failures: list[dict[str, str]] = []
        for (args, expected), got in zip(cases, results, strict=True):
            if isinstance(got, dict) and got.keys() == {"value"} and same_value(got["value"], expected):
                info["passed"] += 1
            elif len(failures) < SHOWN_FAILURES:
                failures.append({"args": _short(args), "expected": _short(expected), "got": _short(got)})
        if failures:
            info["failures"] = failures
        if info["passed"] < len(cases):
            return 0.0, {**info, "reason": f"{info['passed']}/{len(cases)} cases passed"}
        return 1.0, info

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        """Refuses: fixit's check runs the model's code, which only ever happens in a sandbox."""
        raise ConfigError(
            "fixit's verifier runs the model's solution.py and never does so on the host: verify with "
            "clawpipe.sandbox.verify.verify_rollout(task_set, task, workdir, backend) (the rollout runner does)"
        )
