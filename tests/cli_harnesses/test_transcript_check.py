"""`clawpipe harness check --transcript`: a sample transcript against each task set's transcript contract."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.cli.sandbox import transcript_contract
from clawpipe.tasks import get_task_set


def check(tmp_path: Path, transcript: object | str, *tasks: str) -> tuple[int, str]:
    path = tmp_path / "transcript.json"
    path.write_text(transcript if isinstance(transcript, str) else json.dumps(transcript))
    args = ["harness", "check", "tool-agent", "--transcript", str(path)]
    for name in tasks:
        args += ["--tasks", name]
    out = CliRunner().invoke(app, args)
    return out.exit_code, out.output


def test_a_transcript_that_follows_the_contract_passes_and_is_scored(tmp_path: Path) -> None:
    sample = {"turns": [{"reply": "50", "answer": "50"}, {"reply": "I guess 25"}], "final": "25"}
    code, output = check(tmp_path, sample, "guess", "calc")
    assert code == 0, output
    assert "transcript vs guess: Transcript contract (``out/transcript.json``" in output
    assert "transcript vs calc: Transcript contract" in output
    assert output.count(": reward ") == 2, "scored by each verifier on one generated instance"


def test_broken_turns_are_named(tmp_path: Path) -> None:
    sample = {"turns": [{"reply": "50"}, "not an object", {"reply": None, "answer": 50}], "final": 7}
    code, output = check(tmp_path, sample, "guess")
    assert code == 1
    for problem in (
        "turns[1] must be an object",
        "turns[2].reply must be the call's text, a string",
        "turns[2].answer must be a string when present",
        "`final` must be a string when present",
        "does not follow the transcript contract of ['guess']",
    ):
        assert problem in output, (problem, output)
    code, output = check(tmp_path, {"final": "3"}, "calc")
    assert code == 1 and "`turns` must be a list with one entry per model call" in output


def test_unusable_transcript_gets_the_verifiers_reason(tmp_path: Path) -> None:
    code, output = check(tmp_path, '{"turns": [], "turns": []}', "guess")
    assert code == 1 and "transcript.json is unusable" in output and "duplicate" in output.lower()
    code, output = check(tmp_path, "[1, 2]", "guess")
    assert code == 1 and "is not a JSON object" in output


def test_fixit_reads_no_transcript(tmp_path: Path) -> None:
    code, output = check(tmp_path, {"anything": True}, "fixit")
    assert code == 0 and "fixit reads no transcript: nothing to check" in output


def test_contract_text_comes_from_the_task_set_docs() -> None:
    calc = transcript_contract(get_task_set("calc"))
    assert calc.startswith("Transcript contract") and "- ``turns``" in calc and "Reward:" not in calc
    assert transcript_contract(get_task_set("fixit")).startswith("Transcript contract: none")


def test_a_task_set_that_reads_only_final_requires_final_and_ignores_turns(tmp_path: Path) -> None:
    code, output = check(tmp_path, {"final": "the reply"}, "say")
    assert code == 0, output
    assert "transcript vs say: Transcript contract: ``final`` only" in output and ": reward " in output
    code, output = check(tmp_path, {"turns": [{"reply": "x"}]}, "say")
    assert code == 1 and "`final` must be a string: the harness's last reply" in output


def test_a_verifier_that_never_returns_is_cut_at_the_verify_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check scores a sample with the task set's verifier under CLAWPIPE_VERIFY_TIMEOUT_S, as rollouts are
    scored: a verifier that hangs makes the check fail naming the limit, instead of hanging the command."""
    from clawpipe.config import get_settings

    release = threading.Event()

    def hang(self: object, task: object, workdir: Path) -> tuple[float, dict[str, object]]:
        release.wait(60)
        return 1.0, {}

    monkeypatch.setattr(type(get_task_set("guess")), "verify", hang)
    monkeypatch.setenv("CLAWPIPE_VERIFY_TIMEOUT_S", "0.5")
    get_settings.cache_clear()
    try:
        sample = {"turns": [{"reply": "50", "answer": "50"}], "final": "50"}
        code, output = check(tmp_path, sample, "guess")
    finally:
        release.set()
        get_settings.cache_clear()
    assert code == 1, output
    assert "guess's verifier did not return within 0.5 s (CLAWPIPE_VERIFY_TIMEOUT_S" in output, output
