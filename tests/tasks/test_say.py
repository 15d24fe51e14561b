"""The ``say`` task set: instances, the graded verifier over ``final``, and chat-loop playing it."""

from __future__ import annotations

import json
from pathlib import Path

from clawpipe.tasks import get_task_set, list_task_sets
from clawpipe.tasks.say import normalize, similarity
from tests.harnesses.conftest import run_harness
from tests.support.upstream import ScriptedUpstream, say


def _verify(tmp_path: Path, task: dict, transcript: object) -> tuple[float, dict]:
    workdir = tmp_path / "work"
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    (workdir / "out" / "transcript.json").write_text(json.dumps(transcript))
    return get_task_set("say").verify(task, workdir)


def test_instances_are_deterministic_unique_and_split_apart() -> None:
    ts = get_task_set("say")
    assert "say" in list_task_sets()
    train, again, held_out = ts.generate(30, seed=3), ts.generate(30, seed=3), ts.generate(30, seed=3, split="eval")
    assert train == again
    assert len({t["task_id"] for t in train}) == 30
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in held_out}
    for t in train:
        assert t["data"]["phrase"] in t["prompt"] and len(t["data"]["phrase"].split()) == 2


def test_the_exact_phrase_earns_one_and_a_near_miss_earns_partial_credit(tmp_path: Path) -> None:
    task = get_task_set("say").generate(1, seed=0)[0]
    phrase = task["data"]["phrase"]
    assert _verify(tmp_path, task, {"final": f'  "{phrase.upper()}."\n'}) == (
        1.0,
        {"similarity": 1.0, "exact": True, "reply_chars": len(phrase) + 6},
    )
    near, info = _verify(tmp_path, task, {"final": phrase[:-1]})
    far, _ = _verify(tmp_path, task, {"final": "zq#&x vb!~ 0192"})
    assert 0.9 < near < 1.0 and info["exact"] is False
    assert 0.0 <= far < near
    assert similarity("x" * 100_000, phrase) < 0.01  # a flood is cut, not rewarded


def test_garbage_replies_score_distinct_rewards(tmp_path: Path) -> None:
    """What GRPO needs from an untrained policy: rollouts of one group differ in reward."""
    task = get_task_set("say").generate(1, seed=0)[0]
    replies = ["r3 bl@ue", "mo0n ;;", "ttt", "amber slate river"]
    rewards = {_verify(tmp_path, task, {"final": r})[0] for r in replies}
    assert len(rewards) == len(replies)


def test_a_missing_or_unusable_final_scores_zero_with_the_reason(tmp_path: Path) -> None:
    task = get_task_set("say").generate(1, seed=0)[0]
    phrase = task["data"]["phrase"]
    reward, info = _verify(tmp_path, task, {"turns": [{"reply": phrase}], "reward": 1.0})
    assert reward == 0.0 and "final" in info["reason"]
    reward, info = _verify(tmp_path, task, {"final": [phrase]})
    assert reward == 0.0 and "final" in info["reason"]
    empty = tmp_path / "empty"
    empty.mkdir()
    reward, info = get_task_set("say").verify(task, empty)
    assert reward == 0.0 and "transcript" in info["reason"]
    assert normalize(" A\n\tb. ") == "a b"


def test_chat_loop_plays_say_with_one_call(tmp_path: Path) -> None:
    task = get_task_set("say").generate(1, seed=0)[0]
    with ScriptedUpstream([say(task["data"]["phrase"])]) as up:
        run = run_harness("chat-loop", task, up, tmp_path)
    assert run.proc.returncode == 0, run.proc.stderr
    assert len(run.bodies) == 1 and run.bodies[0]["messages"][-1]["content"] == task["prompt"]
    assert run.bodies[0]["max_tokens"] == task["sampling"]["max_tokens"]
    assert run.reward == 1.0 and run.info["exact"] is True
