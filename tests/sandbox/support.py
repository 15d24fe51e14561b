"""Test doubles for the sandbox tests: a loopback upstream standing in for the proxy, a tiny task set,
throwaway harness folders, a runner of rollouts against them, and a scan for processes left running."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from clawpipe.sandbox import HarnessManifest, RolloutResult, RolloutSpec, run_rollouts


class Upstream:
    """An OpenAI-style chat endpoint on 127.0.0.1 that records (path, authorization) of every request."""

    def __init__(self, reply: str = "42") -> None:
        self.calls: list[dict[str, Any]] = []
        self.reply = reply
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.calls.append(
                    {"path": self.path, "auth": self.headers.get("authorization"), "body": json.loads(body or b"{}")}
                )
                data = json.dumps(
                    {
                        "id": "c1",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": outer.reply},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class EchoTaskSet:
    """A task set whose verifier gives 1.0 when out/answer.txt holds the task's data.answer."""

    name = "echo"

    def generate(self, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
        return [
            {
                "task_set": "echo",
                "task_id": f"t{seed}-{i}",
                "prompt": "say 42",
                "data": {"answer": "42"},
                "max_turns": 1,
            }
            for i in range(n)
        ]

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        (workdir / "start.txt").write_text("starting file\n")

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        p = workdir / "out" / "answer.txt"
        got = p.read_text().strip() if p.is_file() else None
        return (1.0 if got == task["data"].get("answer") else 0.0), {"got": got}


def make_harness(root: Path, name: str, script: str, **manifest: Any) -> Path:
    """Write <root>/<name>/harness.toml + main.py running ``script``; return the harness folder."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "main.py").write_text(textwrap.dedent(script))
    fields = {"name": name, "command": ["python3", "main.py"], "task_sets": ["echo"], "timeout_s": 30, **manifest}
    lines = []
    tables = {k: fields.pop(k) for k in ("resources", "env") if k in fields}
    for k, v in fields.items():
        lines.append(f"{k} = {json.dumps(v)}")
    for t, kv in tables.items():
        lines.append(f"[{t}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in kv.items())
    (d / "harness.toml").write_text("\n".join(lines) + "\n")
    return d


CHAT_HARNESS = """
import json, os, pathlib
from openai import OpenAI
task = json.loads(pathlib.Path(os.environ["CLAWPIPE_TASK"]).read_text())
client = OpenAI(max_retries=0, timeout=10)
messages = [{"role": "user", "content": task["prompt"]}]
r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages)
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
(out / "answer.txt").write_text(r.choices[0].message.content)
print("done")
"""

# The same call with the standard library only (cheaper to start than the SDK).
URLLIB_HARNESS = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": []}).encode(),
    headers={"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
reply = json.loads(urllib.request.urlopen(req, timeout=10).read())
out = os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt")
open(out, "w").write(reply["choices"][0]["message"]["content"])
"""


class Sampler:
    """Calls :meth:`sample` every 20 ms in a background thread while the ``with`` block runs."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.02)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def procs_with(marker: str) -> list[int]:
    """Pids of the host's processes whose command line holds ``marker`` (what a sandbox left running)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(pid))
            except OSError:
                pass
    return found


def run_harnesses(
    harnesses: list[HarnessManifest], upstream: Upstream, tmp_path: Path, echo: EchoTaskSet, **kw: Any
) -> list[RolloutResult]:
    """One rollout of each loaded harness manifest on its own echo task, through ``run_rollouts`` against
    ``upstream`` (results and scratch under ``tmp_path``); ``kw`` goes to ``run_rollouts`` (backend, ...)."""
    tasks = echo.generate(len(harnesses))
    specs = [RolloutSpec(run_id="r", iteration=0, harness=m, task=tasks[i], model="m") for i, m in enumerate(harnesses)]
    return run_rollouts(
        specs,
        proxy_url=upstream.url,
        results_path=tmp_path / "results.jsonl",
        secret=b"k",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        **kw,
    )
