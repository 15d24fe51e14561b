"""The launcher's final reply (cli.toml [reply] -> out/transcript.json ``final``) for each CLI's own output.

The outputs below have the shapes the pinned CLIs print (recorded against the scripted upstream, trimmed):
Claude Code's and Qwen Code's result object (a list of events for Qwen), Codex's JSON lines, OpenClaw's
envelope. An error result gives no reply, so an error message is never scored as the model's answer. The
scripted-upstream tests (test_scripted.py) check the same end to end with the real CLIs.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.cli_harnesses.support import HARNESSES, REPO


def launcher() -> ModuleType:
    sys.path.insert(0, str(REPO / "harnesses" / "_kit"))
    try:
        import cli_launcher
    finally:
        sys.path.pop(0)
    return cli_launcher


def reply_table(harness: str) -> dict[str, Any]:
    return dict(tomllib.loads((REPO / "harnesses" / harness / "cli.toml").read_text())["reply"])


def claude(result: str, error: bool = False) -> str:
    return json.dumps({"type": "result", "subtype": "success", "is_error": error, "num_turns": 2, "result": result})


def codex(*texts: str) -> str:
    events = [{"type": "thread.started", "thread_id": "t"}, {"type": "turn.started"}]
    events += [{"type": "item.completed", "item": {"id": "item_0", "type": "error", "message": "metadata"}}]
    events += [
        {"type": "item.completed", "item": {"id": f"m{i}", "type": "agent_message", "text": t}}
        for i, t in enumerate(texts)
    ]
    events += [{"type": "turn.completed", "usage": {"input_tokens": 1}}]
    return "Reading additional input from stdin...\n" + "\n".join(json.dumps(e) for e in events) + "\n"


def qwen(result: str, error: bool = False) -> str:
    init = {"type": "system", "subtype": "init", "tools": ["run_shell_command"]}
    turn = {"type": "assistant", "message": {"content": [{"type": "text", "text": "thinking out loud"}]}}
    return json.dumps([init, turn, {"type": "result", "is_error": error, "num_turns": 1, "result": result}])


def openclaw(final: str, ok: bool = True) -> str:
    return json.dumps({"ok": ok, "status": "ok" if ok else "error", "final": final, "payloads": [{"text": final}]})


OUTPUTS = {"claude-code": claude, "codex": codex, "qwen-code": qwen, "openclaw": openclaw}


@pytest.mark.parametrize("harness", HARNESSES)
def test_each_cli_final_reply_is_found_in_its_output(harness: str, tmp_path: Path) -> None:
    kit = launcher()
    out = tmp_path / "out"
    out.mkdir()
    stdout = out / "cli.out"
    stdout.write_text(OUTPUTS[harness]("blue moon"))
    kit.write_transcript(reply_table(harness), stdout, out)
    assert json.loads((out / "transcript.json").read_text()) == {"final": "blue moon"}


def test_codex_final_reply_is_its_last_agent_message() -> None:
    assert launcher().final_reply(codex("first", "second"), reply_table("codex")) == "second"


@pytest.mark.parametrize("harness", ["claude-code", "qwen-code", "openclaw"])
def test_an_error_result_gives_no_reply(harness: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kit = launcher()
    out = tmp_path / "out"
    out.mkdir()
    stdout = out / "cli.out"
    failed = {"claude-code": lambda: claude("API Error: 500", error=True), "openclaw": lambda: openclaw("x", ok=False)}
    stdout.write_text(failed.get(harness, lambda: qwen("Error: model failed", error=True))())
    kit.write_transcript(reply_table(harness), stdout, out)
    assert not (out / "transcript.json").exists()
    assert "no final reply in cli.out" in capsys.readouterr().err


def test_garbage_missing_and_oversized_output_give_no_reply(tmp_path: Path) -> None:
    kit = launcher()
    table = reply_table("claude-code")
    assert kit.final_reply("not json at all\n{broken", table) is None
    assert kit.final_reply(json.dumps({"type": "result", "is_error": False, "result": 42}), table) is None
    out = tmp_path / "out"
    out.mkdir()
    kit.write_transcript(table, out / "missing.json", out)  # the CLI printed nothing: no file, no crash
    big = out / "big.json"
    big.write_bytes(b" " * (kit.MAX_STDOUT_BYTES + 1))
    kit.write_transcript(table, big, out)
    assert not (out / "transcript.json").exists()
    long = kit.final_reply(claude("y" * (kit.MAX_REPLY_CHARS + 10)), table)
    assert long == "y" * kit.MAX_REPLY_CHARS
    kit.write_transcript({}, big, out)  # a CLI without [reply] writes no transcript
    assert not (out / "transcript.json").exists()


@pytest.mark.parametrize("harness", ["claude-code", "qwen-code", "openclaw"])
def test_a_transcript_the_agent_wrote_is_not_scored_in_place_of_an_error_result(harness: str, tmp_path: Path) -> None:
    kit = launcher()
    out = tmp_path / "out"
    out.mkdir()
    (out / "transcript.json").write_text(json.dumps({"final": "blue moon"}))  # written by the agent's shell tool
    stdout = out / "cli.out"
    failed = {"claude-code": lambda: claude("blue moon", error=True), "openclaw": lambda: openclaw("x", ok=False)}
    stdout.write_text(failed.get(harness, lambda: qwen("Error: model failed", error=True))())
    kit.write_transcript(reply_table(harness), stdout, out)
    assert not (out / "transcript.json").exists()
