"""Each real CLI, unchanged, headless, as a plain subprocess against the scripted upstream.

The upstream answers the first call with a shell tool call and the follow-up with text. Each test checks
that the CLI ran the tool in the work dir, that its follow-up extends the first call (the tool's output as
context; the scripted token ids extend too), that it exited 0 leaving no process, what it sent (path,
auth, API-specific fields) and that the request shape still matches the recorded fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli_harnesses.scripted_upstream import ScriptedUpstream, render_conversation, render_tokens
from tests.cli_harnesses.support import conversation, harness_env, pids_in, run_launcher, write_task

KEY = "cp1.testkey"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
COMMAND = "echo scripted > tool_ran.txt; echo marker-$((6*7))"

EXPECT: dict[str, dict[str, Any]] = {
    "claude-code": {
        "api": "messages",
        "path": f"/r/{KEY}/v1/messages",
        "auth": ("x-api-key", KEY),
        "stdout_file": "claude.json",
        "home_files": [".claude/settings.json"],
    },
    "codex": {
        "api": "responses",
        "path": f"/r/{KEY}/v1/responses",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "codex.jsonl",
        "home_files": [".codex/config.toml"],
    },
    "qwen-code": {
        "api": "chat",
        "path": f"/r/{KEY}/v1/chat/completions",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "qwen.json",
        "home_files": [".qwen/settings.json"],
    },
}

CASES = [
    pytest.param("claude-code", "full"),
    pytest.param("claude-code", "minimal"),
    pytest.param("codex", "full"),
    pytest.param("codex", "minimal"),
    pytest.param("qwen-code", "full", marks=pytest.mark.slow),
    pytest.param("qwen-code", "minimal", marks=pytest.mark.slow),
]


def check_api_specifics(harness: str, mode: str, body: dict[str, Any], headers: dict[str, str], query: dict) -> None:
    """What NOTES records each CLI sends; the proxy and engine must accept exactly this."""
    if harness == "claude-code":
        assert query == {"beta": "true"}
        assert "claude-code-20250219" in headers["anthropic-beta"]
        assert headers["anthropic-version"] == "2023-06-01"
        for key in ("thinking", "context_management", "output_config", "system", "metadata", "max_tokens"):
            assert key in body, key
        if mode == "full":
            assert any(m["role"] == "system" for m in body["messages"]), "a system role inside messages"
        assert "cache_control" in json.dumps(body)
    elif harness == "codex":
        assert body["store"] is False
        assert body["include"] == ["reasoning.encrypted_content"]
        assert body["prompt_cache_key"] and "client_metadata" in body
        assert body["input"][0]["role"] == "developer"
        assert all(t["type"] in ("function", "namespace", "web_search", "custom") for t in body["tools"])
    else:
        assert body["stream_options"] == {"include_usage": True}
        assert body["messages"][0]["role"] == "system"
        assert all(t["type"] == "function" for t in body["tools"])


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("name") or t.get("function", {}).get("name") or t.get("type") for t in body.get("tools", [])]


@pytest.mark.parametrize(("harness", "mode"), CASES)
def test_cli_runs_the_tool_and_its_follow_up_extends_the_first_call(
    harness: str, mode: str, tmp_path: Path, cli_installed: None
) -> None:
    want = EXPECT[harness]
    workdir = tmp_path / "work"
    workdir.mkdir()
    task = write_task(tmp_path / "task.json")
    with ScriptedUpstream(model="tiny", command=COMMAND) as up:
        env = harness_env(up.url, workdir, task, key=KEY, extra={"CLAWPIPE_CLI_MODE": mode})
        result = run_launcher(harness, env, workdir)
        reqs = up.model_requests()
        answers = list(up.answers)

    assert result.returncode == 0, result.stderr[-2000:]
    assert (workdir / "tool_ran.txt").read_text() == "scripted\n", "the CLI ran the tool in the work dir"
    assert [a["kind"] for a in answers] == ["tool", "text"], "one tool call, one follow-up, no side calls"
    assert len(reqs) == 2
    first, second = (r.body for r in reqs)
    for r in reqs:
        assert r.path == want["path"]
        assert r.headers[want["auth"][0]] == want["auth"][1]
        assert r.body["model"] == "tiny" and r.body["stream"] is True
        check_api_specifics(harness, mode, r.body, r.headers, r.query)

    # The follow-up extends the first call: same history, then the tool call and its output.
    conv1, conv2 = conversation(want["api"], first), conversation(want["api"], second)
    assert len(conv2) > len(conv1) and conv2[: len(conv1)] == conv1
    appended = json.dumps(conv2[len(conv1) :])
    assert "echo marker-" in appended, "the tool call and its result are in the follow-up"
    if (harness, mode) != ("qwen-code", "minimal"):  # qwen --bare may drop a fast command's output (cli.toml)
        assert "marker-42" in appended, "the tool's output is in the follow-up"
    # ...and so do the (scripted) token ids: prompt 2 = prompt 1 + completion 1 + the tool result.
    ids2 = render_tokens(render_conversation(want["api"], second))
    ids1 = answers[0]["prompt_token_ids"] + answers[0]["token_ids"]
    assert ids2[: len(ids1)] == ids1 and len(ids2) > len(ids1)

    # Fresh HOME inside the work dir with the settings written; the CLI's result saved; nothing left running.
    for rel in want["home_files"]:
        assert (workdir / "home" / rel).is_file(), rel
    assert (workdir / "out" / want["stdout_file"]).stat().st_size > 0
    assert pids_in(workdir) == []

    # Same request shape as the recorded fixture (a new CLI version that changes it fails here).
    fixture = json.loads((FIXTURES / f"{harness}-{mode}-1.json").read_text())
    assert sorted(first) == sorted(fixture["body"])
    assert tool_names(first) == tool_names(fixture["body"])
    assert fixture["path"] == want["path"].replace(KEY, "<key>")


def test_claude_result_json_reports_the_scripted_reply(tmp_path: Path, cli_installed: None) -> None:
    workdir = tmp_path / "work"
    task = write_task(tmp_path / "task.json")
    with ScriptedUpstream(model="tiny", reply="Finished: the file exists.") as up:
        result = run_launcher(
            "claude-code", harness_env(up.url, workdir, task, extra={"CLAWPIPE_CLI_MODE": "minimal"}), workdir
        )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads((workdir / "out" / "claude.json").read_text())
    assert out["result"] == "Finished: the file exists." and out["num_turns"] == 2 and out["is_error"] is False
    assert json.loads(result.stdout) == out, "the launcher passes the CLI's stdout through"


SHARED_TOOL_CALLS = {
    "claude-code": ("Bash", {"command": COMMAND, "description": "run it"}),
    "codex": ("exec_command", {"cmd": COMMAND}),
    "qwen-code": ("run_shell_command", {"command": COMMAND}),
}


@pytest.mark.parametrize("harness", ["claude-code", "codex", pytest.param("qwen-code", marks=pytest.mark.slow)])
def test_cli_against_the_shared_scripted_upstream(harness: str, tmp_path: Path, cli_installed: None) -> None:
    """The proxy's test upstream (tests/support/upstream.py: 4-character SSE chunks, ids only on request)."""
    from tests.support.upstream import ScriptedUpstream as SharedUpstream
    from tests.support.upstream import say, tool_call

    workdir = tmp_path / "work"
    task = write_task(tmp_path / "task.json")
    with SharedUpstream([tool_call(*SHARED_TOOL_CALLS[harness]), say("All done.")], model="tiny") as up:
        env = harness_env(up.url, workdir, task, rollout_prefix=False, extra={"CLAWPIPE_CLI_MODE": "full"})
        result = run_launcher(harness, env, workdir)
        seen = [r for r in up.requests if r.method == "POST"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert (workdir / "tool_ran.txt").read_text() == "scripted\n"
    assert len(seen) == 2
    api = EXPECT[harness]["api"]
    conv1, conv2 = conversation(api, seen[0].json()), conversation(api, seen[1].json())
    assert conv2[: len(conv1)] == conv1 and "marker-42" in json.dumps(conv2[len(conv1) :])
    assert pids_in(workdir) == []
