"""calc: the safe evaluator, generation, reward ordering, robust verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawpipe.tasks import get_task_set, validate_task
from clawpipe.tasks.calc import evaluate

CALC = get_task_set("calc")


def write_transcript(workdir: Path, payload: object) -> None:
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    (workdir / "out" / "transcript.json").write_text(payload if isinstance(payload, str) else json.dumps(payload))


def test_evaluate_does_arithmetic_only() -> None:
    assert evaluate("(3 + 4) * 5 - 2") == 33
    assert evaluate("-2 ** 3") == -8
    assert evaluate("7 / 2") == 3.5
    for bad in ["__import__('os')", "x + 1", "9 ** 99999", "1 / 0", "'a' * 3", "[1][0]", "1" * 300, ""]:
        with pytest.raises(ValueError):
            evaluate(bad)


def test_generate_is_deterministic_with_correct_answers_and_disjoint_splits() -> None:
    tasks = CALC.generate(50, seed=1)
    assert tasks == CALC.generate(50, seed=1)
    for task in tasks:
        validate_task(task)
        assert evaluate(task["data"]["expression"]) == task["data"]["answer"]
        assert task["data"]["expression"] in task["prompt"]
    train = {t["data"]["expression"] for t in CALC.generate(300, seed=0)}
    evals = {t["data"]["expression"] for t in CALC.generate(100, seed=0, split="eval")}
    assert train.isdisjoint(evals) and len(evals) == 100


def test_reward_ordering(tmp_path: Path) -> None:
    task = CALC.generate(1, seed=4)[0]
    d = task["data"]
    call = {"name": "calculator", "arguments": {"expression": d["expression"]}, "result": str(d["answer"])}
    cases = {
        "perfect": ({"turns": [{"reply": "", "tool_calls": [call]}], "final": f"It is {d['answer']}."}, 1.0),
        "tool only": ({"turns": [{"reply": "", "tool_calls": [call]}], "final": "no idea"}, 0.5),
        "wrong tool": (
            {"turns": [{"reply": "", "tool_calls": [{"name": "calculator", "arguments": '{"expression": "1+1"}'}]}]},
            0.2,
        ),
        "garbage": ({"turns": [{"reply": "zq#x", "tool_calls": [{"name": "calculator", "arguments": "{"}]}]}, 0.0),
    }
    for name, (transcript, expected) in cases.items():
        write_transcript(tmp_path / name, transcript)
        assert CALC.verify(task, tmp_path / name)[0] == expected, name


@pytest.mark.parametrize("payload", ["", "[]", {"final": 5}, {"turns": [{"tool_calls": "x"}, None]}])
def test_verify_survives_garbage_output(tmp_path: Path, payload: object) -> None:
    write_transcript(tmp_path, payload)
    reward, info = CALC.verify(CALC.generate(1, seed=0)[0], tmp_path)
    assert reward == 0.0 and info["reason"]
    assert CALC.verify(CALC.generate(1, seed=0)[0], tmp_path / "missing")[0] == 0.0


def test_transcript_contract_final_and_re_evaluated_calls(tmp_path: Path) -> None:
    task = CALC.generate(1, seed=0)[0]
    d = task["data"]
    wrong = d["answer"] + 1
    cases = {
        "the last number of final": ({"turns": [], "final": f"{wrong}? no: {d['answer']}"}, 1.0),
        "a non-string final: the last reply": ({"turns": [{"reply": f"= {d['answer']}"}], "final": None}, 1.0),
        "answer keys are ignored": ({"turns": [{"reply": str(wrong), "answer": str(d["answer"])}]}, 0.0),
        "a call's result is ignored": (
            {
                "turns": [
                    {
                        "reply": "",
                        "tool_calls": [
                            {"name": "calculator", "arguments": {"expression": "1+1"}, "result": str(d["answer"])}
                        ],
                    }
                ],
                "final": str(wrong),
            },
            0.2,
        ),
        "arguments as an object": (
            {
                "turns": [
                    {"reply": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": d["expression"]}}]}
                ]
            },
            0.5,
        ),
    }
    for name, (transcript, expected) in cases.items():
        write_transcript(tmp_path, transcript)
        assert CALC.verify(task, tmp_path)[0] == expected, name
