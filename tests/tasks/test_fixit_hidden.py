"""fixit against a policy that answers the check instead of fixing the bug: a solution.py that looks up the
cases it could read (check.py in its work dir, the task file in its sandbox) earns what the planted bug
earns, because the verifier also calls the function on cases that never enter the harness's sandbox."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.backends import Backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import get_task_set, harness_view, validate_task
from tests.sandbox.support import Upstream, make_harness
from tests.tasks.test_fixit import fixed, one_per_template

pytestmark = pytest.mark.sandbox

FIXIT = get_task_set("fixit")

# What a policy writes once it has read the cases: the planted bug, except on the arguments it has seen.
LOOKUP = """
import json
SEEN = {{json.dumps(args): expected for args, expected in json.loads({cases!r})}}

def {f}(*args):
    return SEEN[json.dumps(list(args))]
"""

# A harness whose "model" reads every case it can find in the task file and writes the lookup table.
READS_THE_TASK = """
import json, os
task = json.loads(open(os.environ["CLAWPIPE_TASK"]).read())
cases = list(task["data"]["cases"])
hidden = task["data"].get("hidden")
if isinstance(hidden, dict):
    cases += hidden.get("cases", [])
lookup = __LOOKUP__
text = lookup.format(cases=json.dumps(cases), f=task["data"]["function"])
open(os.path.join(os.environ["CLAWPIPE_WORKDIR"], "solution.py"), "w").write(text)
open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "seen.json"), "w").write(json.dumps(sorted(task["data"])))
"""


def lookup_of(task: dict[str, Any], cases: list[Any]) -> str:
    return LOOKUP.format(cases=json.dumps(cases), f=task["data"]["function"])


def test_every_task_holds_hidden_cases_the_harness_never_sees() -> None:
    for task in FIXIT.generate(60, seed=1):
        shown = {json.dumps(args) for args, _ in task["data"]["cases"]}
        hidden = task["data"]["hidden"]["cases"]
        assert hidden and any(json.dumps(args) not in shown for args, _ in hidden), task["task_id"]
        view = validate_task(harness_view(task))
        assert "hidden" not in view["data"] and view["data"]["cases"] == task["data"]["cases"]
        assert "hidden" in task["data"]  # the caller's task is left whole


def test_a_lookup_of_the_shown_cases_earns_what_the_bug_earns(tmp_path: Path, bwrap: Backend) -> None:
    for task in one_per_template():
        work = tmp_path / task["task_id"]
        work.mkdir()
        FIXIT.prepare(task, work)
        (work / "solution.py").write_text(lookup_of(task, task["data"]["cases"]))
        reward, info = verify_rollout(FIXIT, task, work, bwrap)
        assert reward == 0.0 and "cases passed" in info["reason"], (task["task_id"], info)
        (work / "solution.py").write_text(fixed(task))
        reward, info = verify_rollout(FIXIT, task, work, bwrap)
        assert reward == 1.0 and info["passed"] == info["total"] > len(task["data"]["cases"]), info


def test_the_task_file_in_the_sandbox_holds_no_hidden_case(tmp_path: Path) -> None:
    task = one_per_template()[0]
    script = READS_THE_TASK.replace("__LOOKUP__", repr(LOOKUP))
    harness = load_manifest(make_harness(tmp_path / "h", "reader", script, task_sets=["fixit"]))
    upstream = Upstream()
    try:
        res = run_rollouts(
            [RolloutSpec(run_id="hidden", iteration=0, harness=harness, task=task, model="m")],
            proxy_url=upstream.url,
            backend="bwrap",
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            keep_workdirs=True,
        )
    finally:
        upstream.close()
    assert res[0].status == "succeeded", res[0].stderr_tail
    assert json.loads((Path(res[0].workdir) / "out" / "seen.json").read_text()) == sorted(
        k for k in task["data"] if k != "hidden"
    )
    assert res[0].reward == 0.0 and "cases passed" in json.loads(res[0].reward_info)["reason"]


def test_a_malformed_hidden_field_is_a_clear_error_not_a_crash() -> None:
    task = one_per_template()[0]
    for bad in ([1, 2], {"cases": "x"}, "cases"):
        broken = {**task, "data": {**task["data"], "hidden": bad}}
        with pytest.raises(ManifestError, match=r"data\.hidden, when present"):
            FIXIT.check_program(broken)
