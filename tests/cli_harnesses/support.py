"""Helpers for the real-CLI-harness tests: run a harness launcher like the runner would, find leftovers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawpipe.net import free_port

REPO = Path(__file__).resolve().parents[2]
HARNESSES = ("claude-code", "codex", "qwen-code", "openclaw")
# Each CLI as the tests run it: variant name -> (harness, the API it speaks, extra environment). OpenClaw
# speaks three APIs, picked by CLAWPIPE_OPENCLAW_API; the others one each.
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "claude-code": ("claude-code", "messages", {}),
    "codex": ("codex", "responses", {}),
    "qwen-code": ("qwen-code", "chat", {}),
    "openclaw-chat": ("openclaw", "chat", {"CLAWPIPE_OPENCLAW_API": "chat"}),
    "openclaw-responses": ("openclaw", "responses", {"CLAWPIPE_OPENCLAW_API": "responses"}),
    "openclaw-messages": ("openclaw", "messages", {"CLAWPIPE_OPENCLAW_API": "messages"}),
}
NODE_DIR = REPO / ".node"
INSTALL_SCRIPT = REPO / "scripts" / "install_cli_harnesses.sh"
PROMPT = "Create the file tool_ran.txt in the current directory with the shell, then say you are done."


def ensure_installed() -> None:
    """Run the (idempotent, quick when installed) install script; raise with its output on failure."""
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/install_cli_harnesses.sh failed ({proc.returncode}): {proc.stderr[-2000:]}")


@dataclass
class LaunchResult:
    returncode: int
    seconds: float
    stdout: str
    stderr: str
    workdir: Path


def write_task(path: Path, prompt: str = PROMPT) -> Path:
    task = {"task_set": "fixit", "task_id": "cli-test", "prompt": prompt, "data": {}, "max_turns": 4}
    path.write_text(json.dumps(task))
    return path


def harness_env(
    base_url: str,
    workdir: Path,
    task: Path,
    *,
    key: str = "cp1.testkey",
    model: str = "tiny",
    extra: dict[str, str] | None = None,
    rollout_prefix: bool = True,
) -> dict[str, str]:
    """The environment contract C (docs/ARCHITECTURE.md) gives a harness, pointed at ``base_url`` (no sandbox); the
    base URLs
    carry the proxy's ``/r/<key>`` prefix unless ``rollout_prefix`` is false (an upstream without it)."""
    root = f"{base_url.rstrip('/')}/r/{key}" if rollout_prefix else base_url.rstrip("/")
    env = {
        "OPENAI_BASE_URL": f"{root}/v1",
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": root,
        "ANTHROPIC_API_KEY": key,
        "CLAWPIPE_MODEL": model,
        "OPENAI_MODEL": model,
        "ANTHROPIC_MODEL": model,
        "CLAWPIPE_TASK": str(task),
        "CLAWPIPE_WORKDIR": str(workdir),
        "CLAWPIPE_OUTPUT": str(workdir / "out"),
        "HOME": str(workdir / "home"),
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
    }
    env.update(extra or {})
    return env


def run_launcher(harness: str, env: dict[str, str], workdir: Path, *, timeout: float = 90) -> LaunchResult:
    """Run harnesses/<harness>/launch.py with cwd = workdir as a plain subprocess."""
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "harnesses" / harness / "launch.py")],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return LaunchResult(proc.returncode, time.monotonic() - t0, proc.stdout, proc.stderr, workdir)


def pids_in(workdir: Path) -> list[int]:
    """Live (non-zombie) processes whose cwd lies inside ``workdir``."""
    root = str(workdir.resolve())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (cwd == root or cwd.startswith(root + "/")) and state != "Z":
            found.append(int(entry))
    return found


class Blackhole:
    """A TCP listener that accepts connections and never answers (an endpoint that hangs)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def strip_cache_control(obj: Any) -> Any:
    """Claude Code moves cache_control markers between calls; compare conversations without them."""
    if isinstance(obj, dict):
        return {k: strip_cache_control(v) for k, v in obj.items() if k != "cache_control"}
    if isinstance(obj, list):
        return [strip_cache_control(v) for v in obj]
    return obj


def text_blocks_as_string(message: Any) -> Any:
    """Claude Code sends a message's content as [{"type": "text", "text": X}] while a cache_control marker
    sits on it and as the string X once the marker moves on: the same content, so compare it as a string."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        blocks = message["content"]
        if blocks and all(isinstance(b, dict) and set(b) == {"type", "text"} and b["type"] == "text" for b in blocks):
            return {**message, "content": "".join(b["text"] for b in blocks)}
    return message


def conversation(api: str, body: dict[str, Any]) -> list[Any]:
    """The list a follow-up request must extend: messages (chat, messages) or input items (responses)."""
    if api == "responses":
        return list(body["input"])
    return [text_blocks_as_string(m) for m in strip_cache_control(list(body["messages"]))]
