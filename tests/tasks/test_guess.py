"""guess: deterministic generation, disjoint splits, the reward formula and its ordering, robust verify."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawpipe.tasks import get_task_set, validate_task
from clawpipe.tasks.guess import BURIED_FACTOR, MISS_BASE, MISS_CLOSENESS, parse_guess, score_guesses

GUESS = get_task_set("guess")


def write_transcript(workdir: Path, payload: object) -> None:
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    text = payload if isinstance(payload, str) else json.dumps(payload)
    (workdir / "out" / "transcript.json").write_text(text)


def play(task: dict, policy) -> float:
    """Reward of one game where ``policy(lo, hi, turn)`` returns reply text, with true feedback."""
    d = task["data"]
    lo, hi, target = d["lo"], d["hi"], d["target"]
    replies = []
    for t in range(task["max_turns"]):
        reply = policy(lo, hi, t)
        replies.append(reply)
        g, _ = parse_guess(reply)
        if g is not None and d["lo"] <= g <= d["hi"]:
            if g == target:
                break
            lo, hi = (g + 1, hi) if g < target else (lo, g - 1)
    return score_guesses(replies, lo=d["lo"], hi=d["hi"], target=target, max_turns=task["max_turns"])[0]


def test_generate_is_deterministic_and_valid() -> None:
    a, b = GUESS.generate(30, seed=7), GUESS.generate(30, seed=7)
    assert a == b and a != GUESS.generate(30, seed=8)
    for task in a:
        validate_task(task)
        d = task["data"]
        assert d["lo"] <= d["target"] <= d["hi"] and str(d["hi"]) in task["prompt"]
        assert task["sampling"]["max_tokens"] == 16
    assert len({t["task_id"] for t in a}) == 30


def test_splits_are_disjoint_and_ids_stay_unique_past_the_pool() -> None:
    train = GUESS.generate(200, seed=0)
    evals = GUESS.generate(200, seed=0, split="eval")
    key = lambda t: (t["data"]["hi"], t["data"]["target"])  # noqa: E731
    assert {key(t) for t in train}.isdisjoint({key(t) for t in evals})
    assert len({key(t) for t in evals}) >= 5
    assert len({t["task_id"] for t in train}) == 200  # more tasks than instances: ids get a ~k suffix


def test_reward_formula() -> None:
    kw = {"lo": 1, "hi": 10, "target": 7, "max_turns": 4}
    miss = lambda g: MISS_BASE + MISS_CLOSENESS * (1 - abs(g - 7) / 9)  # noqa: E731
    assert score_guesses(["7"], **kw)[0] == 1.0
    assert score_guesses(["3", "8", "7"], **kw)[0] == pytest.approx((miss(3) + miss(8) + 1 + 1) / 4)
    assert score_guesses(["abc 7"], **kw)[0] == pytest.approx(BURIED_FACTOR)
    assert score_guesses(["4"], **kw)[0] == pytest.approx(miss(4) / 4)
    assert score_guesses(["4", "x 5"], **kw)[0] == pytest.approx((miss(4) + BURIED_FACTOR * miss(5)) / 4)
    assert score_guesses(["x", "7"], **kw)[0] == 0.0  # no number ends the game: later turns do not count
    assert score_guesses(["11", "7"], **kw)[0] == 0.0  # out of range ends it too
    assert score_guesses(["1", "1", "1", "1", "7"], **kw)[0] == pytest.approx(miss(1))  # past max_turns
    _, info = score_guesses(["7", "garbage"], **kw)
    assert info["solved_turn"] == 0 and info["n_turns"] == 1  # nothing after the hit counts


def test_perfect_beats_learnable_beats_random_beats_garbage() -> None:
    tasks = GUESS.generate(200, seed=3)
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.punctuation + " " * 10 + string.digits

    def mean(policy) -> float:
        return sum(play(t, policy) for t in tasks) / len(tasks)

    perfect = mean(lambda lo, hi, t: str((lo + hi) // 2))
    leading_digit = mean(lambda lo, hi, t: f"{rng.randint(1, 9)} ok")
    random_text = mean(lambda lo, hi, t: "".join(rng.choice(alphabet) for _ in range(8)))
    garbage = mean(lambda lo, hi, t: "no idea")
    assert perfect > 0.75
    assert leading_digit > 0.55
    assert 0.02 < random_text < leading_digit / 4  # the default run's "reward doubles" has room
    assert garbage == 0.0


def test_verify_reads_the_transcript(tmp_path: Path) -> None:
    task = GUESS.generate(1, seed=0)[0]
    target = task["data"]["target"]
    write_transcript(tmp_path, {"turns": [{"reply": "zz"}, {"reply": "x", "answer": str(target)}]})
    reward, info = GUESS.verify(task, tmp_path)
    assert reward == 0.0 and not info["solved"]  # the first reply held no number: game over
    write_transcript(tmp_path, {"turns": [{"reply": "zz", "answer": str(target)}]})
    reward, info = GUESS.verify(task, tmp_path)
    assert reward == 1.0 and info["solved"]  # "answer" (a tool call's argument) overrides the reply text


@pytest.mark.parametrize(
    "payload",
    ["", "{not json", "[]", "null", {"turns": "7"}, {"turns": [7, None, ["7"]]}, {"turns": [{"reply": 7}]}],
)
def test_verify_survives_garbage_output(tmp_path: Path, payload: object) -> None:
    write_transcript(tmp_path, payload)
    reward, info = GUESS.verify(GUESS.generate(1, seed=0)[0], tmp_path)
    assert reward == 0.0 and info["reason"]


def test_verify_without_output_symlink_or_huge_file(tmp_path: Path) -> None:
    task = GUESS.generate(1, seed=0)[0]
    assert GUESS.verify(task, tmp_path)[1]["reason"].startswith("no out/transcript.json")
    (tmp_path / "out").mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"turns": [{"reply": str(task["data"]["target"])}]}))
    (tmp_path / "out" / "transcript.json").symlink_to(secret)
    assert GUESS.verify(task, tmp_path)[0] == 0.0
    (tmp_path / "out" / "transcript.json").unlink()
    (tmp_path / "out" / "transcript.json").write_bytes(b" " * (5 * 1024 * 1024))
    reward, info = GUESS.verify(task, tmp_path)
    assert reward == 0.0 and "larger" in info["reason"]
    assert GUESS.verify({"data": {}}, tmp_path)[0] == 0.0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.sampled_from(["turns", "reply", "answer"]), inner),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=json_values)
def test_verify_never_raises_on_any_json(tmp_path: Path, payload: object) -> None:
    write_transcript(tmp_path, payload)
    reward, info = GUESS.verify(GUESS.generate(1, seed=0)[0], tmp_path)
    assert 0.0 <= reward <= 1.0
    json.dumps(info)


def test_transcript_contract_one_turn_per_call_answer_over_reply(tmp_path: Path) -> None:
    task = GUESS.generate(1, seed=0)[0]
    target = str(task["data"]["target"])
    miss = "1" if target != "1" else "2"
    cases = {
        "answer wins over reply": ([{"reply": miss, "answer": target}], 1.0),
        "a non-string answer falls back to the reply": ([{"reply": target, "answer": 7}], 1.0),
        "a non-string reply is no guess": ([{"reply": int(target)}], 0.0),
        "final and reward claims are ignored": ([{"reply": miss, "reward": 1.0, "feedback": "Correct!"}], None),
    }
    for name, (turns, expected) in cases.items():
        write_transcript(tmp_path, {"turns": turns, "final": target, "reward": 1.0, "solved": True})
        reward, _ = GUESS.verify(task, tmp_path)
        if expected is None:
            write_transcript(tmp_path, {"turns": [{"reply": miss}]})
            expected = GUESS.verify(task, tmp_path)[0]
        assert reward == expected, name
