"""The five reference harnesses as plain subprocesses against a scripted upstream: call shapes, clean exits
on garbage, and the verifier's reward for scripted perfect and garbage models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clawpipe.tasks import get_task_set, list_task_sets
from clawpipe.tasks.guess import score_guesses
from tests.harnesses.conftest import HARNESSES, manifest, run_harness
from tests.support.upstream import Answer, ScriptedUpstream, say, tool_call

NAMES = ["chat-loop", "tool-agent", "compacting-agent", "subagent", "anthropic-agent"]
GARBAGE = "zq#&x vb!~"


def search(lo: int, hi: int, target: int) -> list[int]:
    """The guesses binary search makes."""
    out = []
    while True:
        g = (lo + hi) // 2
        out.append(g)
        if g == target:
            return out
        lo, hi = (g + 1, hi) if g < target else (lo, g - 1)


@pytest.fixture(scope="module")
def guess_task() -> dict[str, Any]:
    """A guess game that binary search needs 3 turns for."""
    for task in get_task_set("guess").generate(40, seed=1):
        d = task["data"]
        if len(search(d["lo"], d["hi"], d["target"])) == 3:
            return task
    raise AssertionError("no 3-step game in 40 tasks")


@pytest.fixture(scope="module")
def calc_task() -> dict[str, Any]:
    return get_task_set("calc").generate(1, seed=2)[0]


def expected(task: dict[str, Any], replies: list[str]) -> float:
    d = task["data"]
    return score_guesses(replies, lo=d["lo"], hi=d["hi"], target=d["target"], max_turns=task["max_turns"])[0]


def chat_texts(body: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in body["messages"]]


def extends(longer: list[Any], shorter: list[Any]) -> bool:
    return longer[: len(shorter)] == shorter


# --- manifests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_manifest_is_complete(name: str) -> None:
    spec = manifest(name)
    assert spec["name"] == name
    assert spec["api"] in ("openai", "anthropic")
    assert (HARNESSES / name / spec["command"][1]).is_file()
    assert set(spec["task_sets"]) <= set(list_task_sets())
    assert 0 < spec["timeout_s"] <= 600
    assert {"memory_mb", "cpus", "pids"} <= set(spec["resources"])
    source = (HARNESSES / name / spec["command"][1]).read_text()
    assert "clawpipe" not in source.split('"""', 2)[2].replace("CLAWPIPE_", ""), "a harness never imports clawpipe"
    assert 'os.environ.get("CLAWPIPE_HARNESS_KIT")' in source and "kit.run(" in source
    assert '"max_retries": 0,' in (HARNESSES / "_kit" / "harness_kit.py").read_text(), "a retry is a second call"


# --- guess ---------------------------------------------------------------------------------------------


def test_chat_loop_appends_history_and_scores_a_search(guess_task: dict[str, Any], tmp_path: Path) -> None:
    d = guess_task["data"]
    guesses = search(d["lo"], d["hi"], d["target"])
    with ScriptedUpstream([say(str(g)) for g in guesses]) as up:
        run = run_harness("chat-loop", guess_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert len(run.bodies) == 3
    prompts = [chat_texts(b) for b in run.bodies]
    assert extends(prompts[1], prompts[0]) and extends(prompts[2], prompts[1])
    assert prompts[1][len(prompts[0])] == ("assistant", str(guesses[0]))
    assert prompts[1][-1][1] in ("Higher.", "Lower.")
    assert run.reward == pytest.approx(expected(guess_task, [str(g) for g in guesses]))
    assert run.info["solved_turn"] == 2 and run.reward > 0.7
    assert run.transcript["status"] == "won"
    assert all(b["max_tokens"] == 16 and b["temperature"] == 1.0 for b in run.bodies)


@pytest.mark.parametrize("name", ["chat-loop", "compacting-agent", "subagent", "anthropic-agent", "tool-agent"])
@pytest.mark.slow
def test_garbage_model_ends_cleanly_with_zero_reward(name: str, guess_task: dict[str, Any], tmp_path: Path) -> None:
    with ScriptedUpstream(default=say(GARBAGE)) as up:
        run = run_harness(name, guess_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert len(run.bodies) == 1, "a reply without a number ends the game"
    assert run.reward == 0.0 and "reason" in run.info
    assert run.transcript["status"] == "lost"
    assert "Game over" in run.transcript["turns"][0]["feedback"]


def test_compacting_agent_third_prompt_does_not_extend_the_second(guess_task: dict[str, Any], tmp_path: Path) -> None:
    with ScriptedUpstream(default=say("1")) as up:
        run = run_harness("compacting-agent", {**guess_task, "data": {**guess_task["data"], "target": 9}}, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    prompts = [chat_texts(b) for b in run.bodies]
    assert len(prompts) == 4
    assert extends(prompts[1], prompts[0])  # the window still holds everything
    assert not extends(prompts[2], prompts[1])  # the oldest exchange was folded into notes
    assert not extends(prompts[3], prompts[2])
    assert "Notes: 1 -> Higher." in prompts[2][1][1]
    assert len(prompts[3]) == len(prompts[2]) == 4  # a rolling window: the prompt stops growing
    assert run.reward == pytest.approx(expected(guess_task | {"data": guess_task["data"] | {"target": 9}}, ["1"] * 4))
    assert run.transcript["status"] == "max_turns"


def test_subagent_interleaves_two_system_prompts(guess_task: dict[str, Any], tmp_path: Path) -> None:
    d = guess_task["data"]
    guesses = search(d["lo"], d["hi"], d["target"])
    script: list[Answer] = []
    for g in guesses:
        script += [say(str(g)), say(f"try {g}")]
    with ScriptedUpstream(script[:-1]) as up:
        run = run_harness("subagent", guess_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    systems = [b["messages"][0]["content"] for b in run.bodies]
    assert len(systems) == 5 and systems[0] == systems[2] == systems[4] and systems[1] == systems[3] != systems[0]
    mains = [chat_texts(b) for b in run.bodies[::2]]
    assert extends(mains[1], mains[0]) and extends(mains[2], mains[1])
    assert "Helper suggests: try" in mains[1][-1][1]
    assert run.reward == pytest.approx(expected(guess_task, [str(g) for g in guesses]))
    assert run.transcript["n_calls"] == 5


def test_tool_agent_guesses_through_the_guess_tool(guess_task: dict[str, Any], tmp_path: Path) -> None:
    target = guess_task["data"]["target"]
    wrong = 1 if target != 1 else 2
    with ScriptedUpstream([tool_call("guess", {"number": wrong}), tool_call("guess", {"number": target})]) as up:
        run = run_harness("tool-agent", guess_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert run.bodies[0]["tools"][0]["function"]["name"] == "guess"
    tool_msgs = [m for m in run.bodies[1]["messages"] if m["role"] == "tool"]
    assert tool_msgs and tool_msgs[0]["content"] in ("Higher.", "Lower.")
    assert tool_msgs[0]["tool_call_id"] == run.bodies[1]["messages"][-2]["tool_calls"][0]["id"]
    assert run.transcript["turns"][0]["answer"] == str(wrong)
    assert run.reward == pytest.approx(expected(guess_task, [str(wrong), str(target)]))


@pytest.mark.slow
def test_anthropic_agent_plays_guess_over_messages(guess_task: dict[str, Any], tmp_path: Path) -> None:
    target = guess_task["data"]["target"]
    wrong = 1 if target != 1 else 2
    with ScriptedUpstream([say(f"{wrong} maybe"), say(f"I think {target}")]) as up:
        run = run_harness("anthropic-agent", guess_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert all(p == "/v1/messages" for p in run.paths)
    assert run.bodies[0]["system"] and run.bodies[0]["max_tokens"] == 16
    assert [m["role"] for m in run.bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert run.reward == pytest.approx(expected(guess_task, [f"{wrong} maybe", f"I think {target}"]))
    assert run.info["n_leading"] == 1  # the hit was buried: BURIED_FACTOR


@pytest.mark.slow
def test_sampling_from_the_task_reaches_the_model(guess_task: dict[str, Any], tmp_path: Path) -> None:
    task = {**guess_task, "sampling": {"temperature": 0, "max_tokens": 5}}
    for name in ("chat-loop", "anthropic-agent"):
        with ScriptedUpstream(default=say(str(task["data"]["target"]))) as up:
            run = run_harness(name, task, up, tmp_path)
        assert run.bodies[0]["temperature"] == 0 and run.bodies[0]["max_tokens"] == 5
        assert run.reward == 1.0


# --- calc ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tool-agent", "anthropic-agent"])
@pytest.mark.slow
def test_calc_perfect_model_sends_a_tool_result(name: str, calc_task: dict[str, Any], tmp_path: Path) -> None:
    d = calc_task["data"]
    script = [tool_call("calculator", {"expression": d["expression"]}), say(f"The answer is {d['answer']}.")]
    with ScriptedUpstream(script) as up:
        run = run_harness(name, calc_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert len(run.bodies) == 2
    last = run.bodies[1]["messages"][-1]
    if name == "tool-agent":
        assert last["role"] == "tool" and last["content"] == str(d["answer"])
        assert last["tool_call_id"] == run.bodies[1]["messages"][-2]["tool_calls"][0]["id"]
    else:
        block = last["content"][0]
        assert block["type"] == "tool_result" and block["content"] == str(d["answer"])
        assert block["tool_use_id"] == run.bodies[1]["messages"][-2]["content"][-1]["id"]
    assert run.reward == 1.0 and run.info["correct_tool_calls"] == 1


@pytest.mark.parametrize("name", ["tool-agent", "anthropic-agent"])
@pytest.mark.slow
def test_calc_garbage_tool_calls_end_cleanly(name: str, calc_task: dict[str, Any], tmp_path: Path) -> None:
    with ScriptedUpstream(default=tool_call("calculator", {"expression": "__import__('os')"})) as up:
        run = run_harness(name, calc_task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert len(run.bodies) == calc_task["max_turns"]
    assert run.transcript["turns"][0]["tool_calls"][0]["result"].startswith("error")
    assert run.reward == 0.0


# --- fixit -----------------------------------------------------------------------------------------------


@pytest.mark.sandbox
def test_tool_agent_fixes_a_file_and_the_check_passes(tmp_path: Path) -> None:
    task = next(t for t in get_task_set("fixit").generate(20, seed=0) if t["data"]["template"] == "add")
    fixed = f"def {task['data']['function']}(a, b):\n    return a + b\n"
    script = [
        tool_call("read_file", {"path": "solution.py"}),
        tool_call("write_file", {"path": "solution.py", "content": fixed}),
        tool_call("run_check", {}),
        say("Fixed."),
    ]
    with ScriptedUpstream(script) as up:
        run = run_harness("tool-agent", task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    results = [c["result"] for t in run.transcript["turns"] for c in t["tool_calls"]]
    assert "return a - b" in results[0] and results[1] == "ok" and results[2].startswith("exit code 0")
    assert run.reward == 1.0


@pytest.mark.sandbox
@pytest.mark.slow
def test_tool_agent_cannot_write_outside_the_work_dir(tmp_path: Path) -> None:
    task = get_task_set("fixit").generate(1, seed=0)[0]
    with ScriptedUpstream([tool_call("write_file", {"path": "../escape.py", "content": "x"}), say("done")]) as up:
        run = run_harness("tool-agent", task, up, tmp_path)
    assert run.proc.returncode == 0
    assert "outside the work directory" in run.transcript["turns"][0]["tool_calls"][0]["result"]
    assert not (tmp_path / "escape.py").exists()
    assert run.reward == 0.0


# --- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_api_error_exits_1_with_the_error_recorded(name: str, guess_task: dict[str, Any], tmp_path: Path) -> None:
    with ScriptedUpstream(error_status=500) as up:
        run = run_harness(name, guess_task, up, tmp_path)
    assert run.proc.returncode == 1
    assert len(run.bodies) == 1, "max_retries=0: one attempt"
    assert run.transcript["status"] == "error" and "500" in run.transcript["error"]
    assert run.reward == 0.0


def test_bad_task_file_and_unsupported_task_set_exit_2(guess_task: dict[str, Any], tmp_path: Path) -> None:
    with ScriptedUpstream() as up:
        run = run_harness("chat-loop", get_task_set("calc").generate(1, seed=0)[0], up, tmp_path)
        assert run.proc.returncode == 2 and "not supported" in run.proc.stderr
        assert not run.bodies
