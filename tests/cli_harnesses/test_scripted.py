"""Each real CLI, unchanged, headless, as a plain subprocess against the scripted upstream.

The upstream answers the first call with a shell tool call and the follow-up with text. Each test checks
that the CLI ran the tool in the work dir, that its follow-up extends the first call (the tool's output as
context; the scripted token ids extend too), that it exited 0 leaving no process, what it sent (path,
auth, API-specific fields) and that the request shape still matches the recorded fixtures. OpenClaw runs
over each of its three APIs; in full mode on Chat Completions and Messages its follow-up rewrites the
history (the internal-context block moves after the tool result), which is checked exactly. Its minimal
mode has no such block (no background-exec or subagent tools to report on) and appends on every API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli_harnesses.support import VARIANTS, conversation, harness_env, pids_in, run_launcher, write_task
from tests.support.upstream import ScriptedUpstream, prompt_ids, say, shell_then_reply, tool_call

KEY = "cp1.testkey"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
COMMAND = "echo scripted > tool_ran.txt; echo marker-$((6*7))"

EXPECT: dict[str, dict[str, Any]] = {
    "claude-code": {
        "path": f"/r/{KEY}/v1/messages",
        "auth": ("x-api-key", KEY),
        "stdout_file": "claude.json",
        "home_files": [".claude/settings.json"],
    },
    "codex": {
        "path": f"/r/{KEY}/v1/responses",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "codex.jsonl",
        "home_files": [".codex/config.toml"],
    },
    "qwen-code": {
        "path": f"/r/{KEY}/v1/chat/completions",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "qwen.json",
        "home_files": [".qwen/settings.json"],
    },
    "openclaw-chat": {
        "path": f"/r/{KEY}/v1/chat/completions",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "openclaw.json",
        "home_files": [".openclaw/clawpipe.json"],
    },
    "openclaw-responses": {
        "path": f"/r/{KEY}/v1/responses",
        "auth": ("authorization", f"Bearer {KEY}"),
        "stdout_file": "openclaw.json",
        "home_files": [".openclaw/clawpipe.json"],
    },
    "openclaw-messages": {
        "path": f"/r/{KEY}/v1/messages",
        "auth": ("x-api-key", KEY),
        "stdout_file": "openclaw.json",
        "home_files": [".openclaw/clawpipe.json"],
    },
}
# OpenClaw's history rewrite: in full mode on these APIs the follow-up moves the first call's last message
# (its internal-context block) after the tool call and its result; on Responses it appends.
MOVES_LAST_MESSAGE = {("openclaw-chat", "full"), ("openclaw-messages", "full")}

CASES = [
    pytest.param("claude-code", "full"),
    pytest.param("claude-code", "minimal"),
    pytest.param("codex", "full"),
    pytest.param("codex", "minimal"),
    pytest.param("qwen-code", "full", marks=pytest.mark.slow),
    pytest.param("qwen-code", "minimal", marks=pytest.mark.slow),
    *(
        pytest.param(f"openclaw-{api}", mode, marks=pytest.mark.slow)
        for api in ("chat", "responses", "messages")
        for mode in ("full", "minimal")
    ),
]


def check_api_specifics(variant: str, mode: str, body: dict[str, Any], headers: dict[str, str], query: dict) -> None:
    """What each CLI was recorded to send; the proxy and engine must accept exactly this."""
    if variant.startswith("openclaw"):
        check_openclaw(variant, mode, body, headers)
    elif variant == "claude-code":
        assert query == {"beta": "true"}
        assert "claude-code-20250219" in headers["anthropic-beta"]
        assert headers["anthropic-version"] == "2023-06-01"
        for key in ("thinking", "context_management", "output_config", "system", "metadata", "max_tokens"):
            assert key in body, key
        if mode == "full":
            assert any(m["role"] == "system" for m in body["messages"]), "a system role inside messages"
        assert "cache_control" in json.dumps(body)
    elif variant == "codex":
        assert body["store"] is False
        assert body["include"] == ["reasoning.encrypted_content"]
        assert body["prompt_cache_key"] and "client_metadata" in body
        assert body["input"][0]["role"] == "developer"
        assert all(t["type"] in ("function", "namespace", "web_search", "custom") for t in body["tools"])
    else:
        assert body["stream_options"] == {"include_usage": True}
        assert body["messages"][0]["role"] == "system"
        assert all(t["type"] == "function" for t in body["tools"])


def check_openclaw(variant: str, mode: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    """OpenClaw: its system prompt as a system message (chat, responses) or ``system`` (messages), the model
    id without the provider prefix, minimal mode's five tools, and no hidden attribution headers."""
    names = tool_names(body)
    assert "exec" in names
    if mode == "minimal":
        assert sorted(names) == ["apply_patch", "edit", "exec", "read", "write"]
    else:
        assert {"tool_search", "tool_call", "process"} <= set(names), "full mode: Tool Search over the catalog"
    if variant == "openclaw-messages":
        assert headers["anthropic-version"] == "2023-06-01" and "You are a personal assistant" in json.dumps(
            body["system"]
        )
        assert body["max_tokens"] == 8192
    elif variant == "openclaw-responses":
        assert body["input"][0]["role"] == "system" and body["max_output_tokens"] == 8192
    else:
        assert body["messages"][0]["role"] == "system" and body["max_completion_tokens"] == 8192
        assert body["stream_options"] == {"include_usage": True}


def tool_names(body: dict[str, Any]) -> list[str]:
    return [t.get("name") or t.get("function", {}).get("name") or t.get("type") for t in body.get("tools", [])]


@pytest.mark.parametrize(("variant", "mode"), CASES)
def test_cli_runs_the_tool_and_its_follow_up_extends_the_first_call(
    variant: str, mode: str, tmp_path: Path, cli_installed: None
) -> None:
    harness, api, extra = VARIANTS[variant]
    want = EXPECT[variant]
    workdir = tmp_path / "work"
    workdir.mkdir()
    task = write_task(tmp_path / "task.json")
    with ScriptedUpstream(default=shell_then_reply(COMMAND), model="tiny") as up:
        env = harness_env(up.url, workdir, task, key=KEY, extra={"CLAWPIPE_CLI_MODE": mode, **extra})
        result = run_launcher(harness, env, workdir)
        reqs = up.model_requests()
        answers = list(up.answers)

    assert result.returncode == 0, result.stderr[-2000:]
    assert (workdir / "tool_ran.txt").read_text() == "scripted\n", "the CLI ran the tool in the work dir"
    assert [a["kind"] for a in answers] == ["tool", "text"], "one tool call, one follow-up, no side calls"
    assert len(reqs) == 2
    first, second = (r.json() for r in reqs)
    for r in reqs:
        assert r.path == want["path"]
        assert r.headers[want["auth"][0]] == want["auth"][1]
        assert r.json()["model"] == "tiny" and r.json()["stream"] is True
        check_api_specifics(variant, mode, r.json(), r.headers, r.params)

    conv1, conv2 = conversation(api, first), conversation(api, second)
    rewrites = (variant, mode) in MOVES_LAST_MESSAGE
    if rewrites:
        # A history rewrite: the last message of the first call moves after the tool call and its result.
        assert "OPENCLAW_INTERNAL_CONTEXT" in json.dumps(conv1[-1])
        assert len(conv2) == len(conv1) + 2 and conv2[: len(conv1) - 1] == conv1[:-1] and conv2[-1] == conv1[-1]
        conv1, conv2 = conv1[:-1], conv2[:-1]
    # The follow-up extends the first call: same history, then the tool call and its output.
    assert len(conv2) > len(conv1) and conv2[: len(conv1)] == conv1
    appended = json.dumps(conv2[len(conv1) :])
    assert "echo marker-" in appended, "the tool call and its result are in the follow-up"
    if (harness, mode) != ("qwen-code", "minimal"):  # qwen --bare may drop a fast command's output (cli.toml)
        assert "marker-42" in appended, "the tool's output is in the follow-up"
    # ...and so do the (scripted) token ids: prompt 2 = prompt 1 + completion 1 + the tool result; after a
    # rewrite they part where the moved block stood.
    ids2 = prompt_ids(api, second)
    ids1 = answers[0]["prompt_token_ids"] + answers[0]["token_ids"]
    assert (ids2[: len(ids1)] == ids1) is not rewrites and len(ids2) > len(ids1)

    # Fresh HOME inside the work dir with the settings written; the CLI's result saved; nothing left running.
    for rel in want["home_files"]:
        assert (workdir / "home" / rel).is_file(), rel
    assert (workdir / "out" / want["stdout_file"]).stat().st_size > 0
    # ...and its final reply, taken from that result, as the transcript's ``final`` (what ``say`` scores).
    assert json.loads((workdir / "out" / "transcript.json").read_text()) == {"final": "All done."}
    assert pids_in(workdir) == []

    # Same request shape as the recorded fixture (a new CLI version that changes it fails here).
    fixture = json.loads((FIXTURES / f"{variant}-{mode}-1.json").read_text())
    assert sorted(first) == sorted(fixture["body"])
    assert tool_names(first) == tool_names(fixture["body"])
    assert fixture["path"] == want["path"].replace(KEY, "<key>")


def test_claude_result_json_reports_the_scripted_reply(tmp_path: Path, cli_installed: None) -> None:
    workdir = tmp_path / "work"
    task = write_task(tmp_path / "task.json")
    with ScriptedUpstream(default=shell_then_reply(reply="Finished: the file exists."), model="tiny") as up:
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
    "openclaw-responses": ("exec", {"command": COMMAND}),
}


@pytest.mark.parametrize(
    "variant",
    [
        "claude-code",
        "codex",
        pytest.param("qwen-code", marks=pytest.mark.slow),
        pytest.param("openclaw-responses", marks=pytest.mark.slow),
    ],
)
def test_cli_follows_scripted_tool_calls_sent_in_small_chunks(
    variant: str, tmp_path: Path, cli_installed: None
) -> None:
    """Scripted tool calls by name instead of the shell rule, with 4-character SSE chunks and no rollout prefix."""
    harness, api, extra = VARIANTS[variant]
    workdir = tmp_path / "work"
    task = write_task(tmp_path / "task.json")
    with ScriptedUpstream([tool_call(*SHARED_TOOL_CALLS[variant]), say("All done.")], model="tiny") as up:
        env = harness_env(up.url, workdir, task, rollout_prefix=False, extra={"CLAWPIPE_CLI_MODE": "full", **extra})
        result = run_launcher(harness, env, workdir)
        seen = [r for r in up.requests if r.method == "POST"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert (workdir / "tool_ran.txt").read_text() == "scripted\n"
    assert len(seen) == 2
    conv1, conv2 = conversation(api, seen[0].json()), conversation(api, seen[1].json())
    assert conv2[: len(conv1)] == conv1 and "marker-42" in json.dumps(conv2[len(conv1) :])
    assert pids_in(workdir) == []


def test_claude_notes_an_unknown_model_name_on_stderr_but_sends_no_other_call(
    tmp_path: Path, cli_installed: None
) -> None:
    """Claude Code's `[claude-code:unrecognized_model]` line comes from its own model catalog: with a served
    name it does not know, it makes the same single call as with a Claude name, under the served name."""
    task = write_task(tmp_path / "task.json", "Reply with exactly these two words and nothing else: blue moon")
    seen = {}
    for model in ("clawpipe-policy", "claude-sonnet-4-5"):
        workdir = tmp_path / model
        with ScriptedUpstream(default=say("blue moon"), model=model) as up:
            result = run_launcher("claude-code", harness_env(up.url, workdir, task, model=model), workdir)
            seen[model] = [(r.method, r.path.rsplit("/v1/", 1)[-1], r.json()["model"]) for r in up.requests]
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads((workdir / "out" / "transcript.json").read_text()) == {"final": "blue moon"}
        noted = f'[claude-code:unrecognized_model] {{"model":"{model}","query_source":"sdk"}}' in result.stderr
        assert noted is (model == "clawpipe-policy"), result.stderr[-2000:]
    assert seen == {m: [("POST", "messages", m)] for m in seen}
