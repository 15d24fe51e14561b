"""What a sandbox may know of its task: every built-in task set's verifier-only values (calc's answer,
fixit's held-out cases, a custom set's ``data.hidden``) are found nowhere a harness can look (its files,
its environment, /proc), guess's task id no longer names the target, and honest harnesses score as before
because the verifier still gets the whole task on the host."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.tasks import get_task_set, harness_view
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness
from tests.support.upstream import ScriptedUpstream, say, tool_call

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]
CALC, FIXIT, GUESS, SAY = (get_task_set(n) for n in ("calc", "fixit", "guess", "say"))

# Verifier-only values no harness may ever see: distinctive, so a byte search has no false hits.
CANARY_ANSWER = 7319046285
CANARY_ARG, CANARY_EXPECTED = "zq-held-out-arg-5517", "zq-held-out-expected-9043"
CANARY_HIDDEN = "zq-custom-hidden-2290"
CANARIES = [str(CANARY_ANSWER), CANARY_ARG, CANARY_EXPECTED, CANARY_HIDDEN]

# Looks everywhere a harness (or a policy with a shell) could: every file it can read outside the host's
# read-only system trees (the same for every rollout, written by no one), its environment, and /proc.
SEEKER = r"""
import json, os, sys
canaries = [c[::-1].encode() for c in REVERSED]  # reversed here: this file is in the sandbox too
skip = {"/proc", "/sys", "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", sys.prefix, sys.base_prefix}
found, files = [], 0

def look(where, blob):
    for c in canaries:
        if c in blob:
            found.append([where, c.decode()])

for root, dirs, names in os.walk("/", onerror=lambda e: None):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for name in names:
        path = os.path.join(root, name)
        look("name " + path, path.encode())
        try:
            if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) < (4 << 20):
                with open(path, "rb") as f:
                    look(path, f.read())
                files += 1
        except OSError:
            pass
look("environ", "\n".join(f"{k}={v}" for k, v in os.environ.items()).encode())
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for part in ("environ", "cmdline", "mountinfo"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                look(f"/proc/{pid}/{part}", f.read())
        except OSError:
            pass
out = os.environ["CLAWPIPE_OUTPUT"]
json.dump({"found": found, "files": files, "task": json.load(open(os.environ["CLAWPIPE_TASK"]))},
          open(os.path.join(out, "seek.json"), "w"))
""".replace("REVERSED", repr([c[::-1] for c in CANARIES]))

# Plays calc and say honestly from its view alone: computes the expression, repeats the phrase.
HONEST = r"""
import json, os
task = json.load(open(os.environ["CLAWPIPE_TASK"]))
if task["task_set"] == "calc":
    value = eval(task["data"]["expression"], {"__builtins__": {}})
    final = str(int(value))
    turns = [{"reply": "", "tool_calls": [{"name": "calculator",
              "arguments": {"expression": task["data"]["expression"]}}]}, {"reply": final}]
else:
    final = task["prompt"].rsplit(": ", 1)[1]
    turns = [{"reply": final}]
json.dump({"turns": turns, "final": final}, open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "transcript.json"), "w"))
"""


class HiddenEcho(EchoTaskSet):
    """A custom task set without harness_task: it keeps what only its verifier may know in data.hidden."""

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        return (1.0 if task["data"]["hidden"]["secret"] == CANARY_HIDDEN else 0.0), {}


def planted_tasks() -> list[dict[str, Any]]:
    """One task of each built-in set (and a custom one) carrying a canary where only its verifier looks."""
    calc = CALC.generate(1, seed=3)[0]
    calc = {**calc, "data": {**calc["data"], "answer": CANARY_ANSWER}}
    fixit = FIXIT.generate(1, seed=3)[0]
    fixit = {**fixit, "data": {**fixit["data"], "hidden": {"cases": [[[CANARY_ARG], CANARY_EXPECTED]]}}}
    custom = {**HiddenEcho().generate(1)[0], "data": {"answer": "42", "hidden": {"secret": CANARY_HIDDEN}}}
    return [calc, fixit, GUESS.generate(1, seed=3)[0], SAY.generate(1, seed=3)[0], custom]


def test_built_in_views_keep_only_what_harnesses_use() -> None:
    calc = CALC.generate(1, seed=0)[0]
    assert harness_view(calc, CALC)["data"] == {"expression": calc["data"]["expression"], "tool": "calculator"}
    fixit = FIXIT.generate(1, seed=0)[0]
    view = harness_view(fixit, FIXIT)
    assert "hidden" not in view["data"] and view["data"]["cases"] == fixit["data"]["cases"]
    assert harness_view(SAY.generate(1, seed=0)[0], SAY)["data"] == {}
    assert "answer" in calc["data"] and "hidden" in fixit["data"]  # the verifier's task is left whole


def test_guess_task_ids_do_not_name_the_target() -> None:
    tasks = GUESS.generate(200, seed=0) + GUESS.generate(100, seed=1, split="eval")
    assert len({t["task_id"] for t in tasks}) == len(tasks)  # still unique, repeats included
    for t in tasks:
        d = t["data"]
        assert f"{d['hi']}-{d['target']}" not in t["task_id"], t["task_id"]
    assert GUESS.generate(5, seed=7) == GUESS.generate(5, seed=7)  # still deterministic per seed


def test_a_custom_view_is_checked() -> None:
    class Renaming(EchoTaskSet):
        def harness_task(self, task: dict[str, Any]) -> dict[str, Any]:
            return {**task, "task_id": "other"}

    class NotATask(EchoTaskSet):
        def harness_task(self, task: dict[str, Any]) -> Any:
            return ["not", "a", "task"]

    task = EchoTaskSet().generate(1)[0]
    with pytest.raises(ManifestError, match="changed task_id"):
        harness_view(task, Renaming())
    with pytest.raises(ManifestError, match="harness view"):
        harness_view(task, NotATask())
    hidden = {**task, "data": {"answer": "42", "hidden": {"secret": 1}}}
    assert harness_view(hidden, EchoTaskSet())["data"] == {"answer": "42"}  # the default keeps the rest


def _run(backend: str, harness: Path, tasks: list[dict[str, Any]], upstream: Upstream, tmp_path: Path) -> list[Any]:
    manifest = load_manifest(harness)
    return run_rollouts(
        [RolloutSpec(run_id="r", iteration=0, harness=manifest, task=t, model="tiny") for t in tasks],
        proxy_url=upstream.url,
        backend=backend,
        concurrency=2,
        results_path=tmp_path / "results.jsonl",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": HiddenEcho()},
        keep_workdirs=True,
        max_attempts=1,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_verifier_only_value_is_visible_in_the_sandbox(backend: str, upstream: Upstream, tmp_path: Path) -> None:
    tasks = planted_tasks()
    sets = sorted({t["task_set"] for t in tasks})
    harness = make_harness(tmp_path, "seeker", SEEKER, task_sets=sets, timeout_s=120)
    results = _run(backend, harness, tasks, upstream, tmp_path)
    assert [r.status for r in results] == ["succeeded"] * len(tasks), [r.stderr_tail for r in results]
    for task, r in zip(tasks, results, strict=True):
        seek = json.loads((Path(r.workdir) / "out" / "seek.json").read_text())
        assert seek["files"] > 0, seek  # it did read the sandbox's files
        assert seek["found"] == [], (task["task_set"], seek["found"])
        assert seek["task"]["task_id"] == task["task_id"] and seek["task"]["prompt"] == task["prompt"]
    custom = next(r for r in results if r.task_set == "echo")
    assert custom.reward == 1.0  # the verifier, on the host, still read data.hidden


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_honest_harnesses_score_as_before(backend: str, upstream: Upstream, tmp_path: Path) -> None:
    tasks = CALC.generate(2, seed=5) + SAY.generate(2, seed=5)
    harness = make_harness(tmp_path, "honest", HONEST, task_sets=["calc", "say"])
    results = _run(backend, harness, tasks, upstream, tmp_path)
    assert [(r.status, r.reward) for r in results] == [("succeeded", 1.0)] * len(tasks), [
        (r.error, r.reward_info, r.stderr_tail) for r in results
    ]


@pytest.mark.sandbox
@pytest.mark.slow
def test_reference_harnesses_score_as_before_through_the_runner(tmp_path: Path) -> None:
    calc, guess, phrase = CALC.generate(1, seed=2)[0], GUESS.generate(1, seed=2)[0], SAY.generate(1, seed=2)[0]
    expression, answer = calc["data"]["expression"], calc["data"]["answer"]
    plays = [
        ("tool-agent", calc, [tool_call("calculator", {"expression": expression}), say(f"The answer is {answer}.")]),
        ("chat-loop", guess, [say(str(guess["data"]["target"]))]),  # the feedback needs the view's target
        ("chat-loop", phrase, [say(phrase["data"]["phrase"])]),
    ]
    for i, (harness, task, script) in enumerate(plays):
        with ScriptedUpstream(script) as up:
            [r] = run_rollouts(
                [RolloutSpec(run_id="r", iteration=0, harness=harness, task=task, model="tiny")],
                proxy_url=up.url,
                backend="bwrap",
                results_path=tmp_path / "results.jsonl",
                scratch_dir=tmp_path / f"scratch-{i}",
                max_attempts=1,
            )
        assert (r.status, r.reward) == ("succeeded", 1.0), (harness, task["task_set"], r.error, r.reward_info)
