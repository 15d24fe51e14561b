"""Every registered task set against the reward forgery suite (tests/tasks/forgery.py): no crafted output
earns more than the honest attempt it is built on, none earns 1.0 for a wrong answer, none leaks the host's
secret or paths into the reward info, none hangs the verifier."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.tasks.forgery_kits  # noqa: F401  (registers the built-in kits)
from clawpipe.sandbox.backends import Backend
from clawpipe.tasks import get_task_set, list_task_sets, needs_sandbox
from tests.tasks.forgery import GENERIC, KITS, ForgeryKit, check_task_set, kit_for, run_attempt


def cases() -> list[object]:
    out: list[object] = []
    for name in list_task_sets():
        marks = [pytest.mark.sandbox] if needs_sandbox(get_task_set(name)) else []
        for attempt in kit_for(name).all_attempts():
            out.append(pytest.param(name, attempt.name, marks=marks, id=f"{name}-{attempt.name}"))
    return out


def backend_for(name: str, request: pytest.FixtureRequest) -> Backend | None:
    return request.getfixturevalue("bwrap") if needs_sandbox(get_task_set(name)) else None


def test_every_built_in_task_set_has_a_kit_with_an_honest_right_answer() -> None:
    for name in ("guess", "calc", "fixit"):
        assert name in KITS and KITS[name].honest_right is not None and KITS[name].attempts


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.sandbox] if n == "fixit" else []) for n in ("guess", "calc", "fixit")]
)
def test_the_kits_honest_answers_score_as_honest_answers(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from tests.tasks.forgery import _fresh, _verify

    task_set, kit = get_task_set(name), KITS[name]
    kit.prepare = task_set.prepare
    task = kit.pick_task(task_set)
    backend = backend_for(name, request)
    assert kit.honest_right is not None
    right, _ = _verify(task_set, task, _fresh(task_set, task, tmp_path, "right", kit.honest_right), backend)
    wrong, _ = _verify(task_set, task, _fresh(task_set, task, tmp_path, "wrong", kit.honest_wrong), backend)
    assert right == 1.0 and wrong < 1.0


@pytest.mark.parametrize(("name", "attempt"), cases())
def test_a_crafted_output_earns_no_more_than_an_honest_one(
    name: str, attempt: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    task_set, kit = get_task_set(name), kit_for(name)
    chosen = next(a for a in kit.all_attempts() if a.name == attempt)
    verdict = run_attempt(task_set, kit, chosen, tmp_path, backend_for(name, request))
    assert not verdict.problems([str(tmp_path)]), (verdict.problems([str(tmp_path)]), verdict.info)


class Lenient:
    """A task set with a verifier that trusts what it reads: the suite must catch it."""

    name = "lenient"

    def generate(self, n: int, seed: int, split: str = "train") -> list[dict]:
        return [{"task_set": "lenient", "task_id": "l-0", "prompt": "p", "data": {}, "max_turns": 1}][:n]

    def prepare(self, task: dict, workdir: Path) -> None:
        pass

    def verify(self, task: dict, workdir: Path) -> tuple[float, dict]:
        path = workdir / "out" / "transcript.json"
        text = path.read_text() if path.exists() else ""
        return (1.0 if "reward" in text else 0.0), {"seen": text[:100]}


def test_the_suite_catches_a_verifier_that_trusts_claims_or_follows_links(tmp_path: Path) -> None:
    keep = {"reward-fields", "secret-links"}  # (the others would hang this verifier on a FIFO or /dev/zero)
    kit = ForgeryKit(honest_wrong=lambda task, workdir: None, skip=frozenset(a.name for a in GENERIC) - keep)
    with pytest.raises(AssertionError) as caught:
        check_task_set(Lenient(), kit, tmp_path)
    assert "reward-fields: reward 1.0 above the honest attempt's 0.0" in str(caught.value)
    assert "secret-links: the reward info carries the host secret" in str(caught.value)
