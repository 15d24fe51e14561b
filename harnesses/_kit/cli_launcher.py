"""The launcher of the real-CLI harnesses, driven by a harness folder's cli.toml (and harness.toml).

Each real-CLI harness folder (harnesses/claude-code, codex, qwen-code, openclaw) has a two-line ``launch.py`` that
calls :func:`main` with its own folder; run with cwd = the rollout work dir (``python3 launch.py``,
resolved against the harness dir). It:

1. builds a fresh private HOME inside the work dir (``$HOME`` if it lies there, else ``<workdir>/home``)
   with TMPDIR under it, and writes the files of cli.toml's ``[files]`` there (settings: telemetry, update
   checks and auto-memory off, the model provider pointing at the given base URL);
2. reads the task prompt from ``$CLAWPIPE_TASK`` (the task instance JSON's ``prompt``);
3. starts the CLI headless (cli.toml's ``entry`` under the Node folder; ``.js`` entries run with node) with
   its ``args`` and the args of the selected mode (``[modes.<m>]``; m = ``$CLAWPIPE_CLI_MODE``, default
   harness.toml's ``[env] CLAWPIPE_CLI_MODE``), stdin closed, stdout copied to
   ``$CLAWPIPE_OUTPUT/<stdout_file>``; once it exits, its final reply (cli.toml's ``[reply]``: ``field`` of
   the last JSON object matching ``select``) is written as ``final`` of ``$CLAWPIPE_OUTPUT/transcript.json``;
4. honours the outer timeout (``$CLAWPIPE_TIMEOUT_S`` or the manifest's ``timeout_s``): at the deadline,
   on SIGTERM/SIGINT/SIGHUP, and after the CLI exits, every process of the CLI's session is killed
   (SIGTERM, then SIGKILL after 2 s; the CLI also gets SIGKILL if the launcher dies). Exit status: the
   CLI's, 124 on timeout, 128+N on signal N. Started as a session leader (as the runner does), the CLI
   shares the launcher's session and process group, so the runner's group kill reaches it too.

Strings in args, env and files (and the keys of files' tables) may use ``${prompt}``, ``${model}``,
``${home}``, ``${workdir}``, ``${output}``, ``${node_dir}``, ``${harness_dir}`` and any environment variable
(``${OPENAI_BASE_URL}``); ``$$`` is a literal ``$``. An args element ``${mode_args}`` marks where the selected
mode's args go (else they are appended). A mode's ``[files]`` table for a file the base ``[files]`` also
writes is deep-merged into it. ``[env_values]`` lists the values an environment variable may take (checked
before the CLI starts, exit 2 naming them).
The Node folder is ``$CLAWPIPE_NODE_DIR``, else ``.node`` in the checkout that holds this file or the
Python environment (scripts/install_cli_harnesses.sh installs it there). A CLI whose cli.toml names a
``node`` version lives in ``<Node folder>/node-<version>`` with that Node (the npm package
``node-linux-<arch>``) and runs on it; the others run on the system ``node`` (>= 20).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

TIMEOUT_EXIT = 124
KILL_GRACE_S = 2.0
LABEL = ["launch.py"]  # how errors name the launcher: "launch.py (<harness>)" once main() knows the harness


def fail(message: str) -> None:
    """Print a launcher error to stderr and exit 2 (a setup error, not the model's fault)."""
    print(f"{LABEL[0]}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def find_node_dir(harness_dir: Path) -> Path:
    """The folder holding node_modules/ with the pinned CLIs."""
    candidates = []
    if os.environ.get("CLAWPIPE_NODE_DIR"):
        candidates.append(Path(os.environ["CLAWPIPE_NODE_DIR"]))
    candidates += [p / ".node" for p in harness_dir.parents]
    candidates += [p / ".node" for p in Path(sys.prefix).parents]
    for c in candidates:
        if (c / "node_modules").is_dir():
            return c
    fail(
        "no .node/node_modules found: run `bash scripts/install_cli_harnesses.sh` (make setup does) "
        "or set CLAWPIPE_NODE_DIR; in a sandbox, mount it read-only (see [sandbox] ro_paths)"
    )
    raise AssertionError


def cli_node(node_dir: Path, version: str | None) -> tuple[Path, Path | None]:
    """The folder holding this CLI's node_modules and the node binary to run it with (None: the system node).

    A CLI pinned to a Node version lives beside that Node in ``<node_dir>/node-<version>``
    (scripts/install_cli_harnesses.sh installs both there)."""
    if version is None:
        return node_dir, None
    prefix = node_dir / f"node-{version}"
    for node in sorted(prefix.glob("node_modules/node-linux-*/bin/node")):
        return prefix, node
    fail(
        f"Node {version} is not installed under {prefix}: run `bash scripts/install_cli_harnesses.sh` "
        "(it installs the npm package node-linux-<arch> there)"
    )
    raise AssertionError


def check_env_values(allowed: dict[str, Any], env: dict[str, str]) -> None:
    """cli.toml's [env_values]: each listed variable must hold one of its values."""
    for name, values in allowed.items():
        if env.get(name) not in values:
            fail(f"{name}={env.get(name)!r} is not one of {list(values)} (set it in [env] or per run)")


def read_prompt() -> str:
    task_path = os.environ.get("CLAWPIPE_TASK")
    if not task_path:
        fail("CLAWPIPE_TASK is not set (the path of the task instance JSON)")
    try:
        task = json.loads(Path(task_path).read_text())
    except (OSError, ValueError) as exc:
        fail(f"cannot read the task JSON {task_path}: {exc}")
    prompt = task.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        fail(f"task JSON {task_path} has no 'prompt' string")
    return prompt


def build_home(workdir: Path) -> Path:
    """A private HOME inside the work dir (the runner's HOME when it already lies there)."""
    given = os.environ.get("HOME")
    home = Path(given) if given else workdir / "home"
    if not home.resolve().is_relative_to(workdir.resolve()):
        home = workdir / "home"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return home


def expand(value: Any, values: dict[str, str]) -> Any:
    """Substitute ${name} placeholders in strings, recursively in lists and tables (keys too: a config file
    may key a table by the model name)."""
    if isinstance(value, str):
        return string.Template(value).safe_substitute(values)
    if isinstance(value, list):
        return [expand(v, values) for v in value]
    if isinstance(value, dict):
        return {expand(k, values): expand(v, values) for k, v in value.items()}
    return value


def merge(base: Any, over: Any) -> Any:
    """``over`` deep-merged into ``base``: tables merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def write_files(home: Path, files: dict[str, Any], values: dict[str, str]) -> None:
    """Write cli.toml's [files] under HOME: tables become JSON, strings are written as text."""
    for rel, content in files.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        content = expand(content, values)
        path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2) + "\n")


def session_pids(sid: int) -> list[int]:
    """Live processes of the session ``sid`` plus every descendant of this launcher (a pty gives a tool its
    own session), this process excluded."""
    procs: dict[int, tuple[int, int]] = {}  # pid -> (ppid, session)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # [0] state, [1] ppid, [2] pgrp, [3] session
        if fields[0] not in ("Z", "X"):
            procs[int(entry)] = (int(fields[1]), int(fields[3]))
    me = os.getpid()
    found = {pid for pid, (_, s) in procs.items() if s == sid} | {me}
    frontier = list(found)
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                frontier.append(pid)
    found.discard(me)
    return sorted(found)


def kill_session(sid: int) -> None:
    """SIGTERM every process of the session and our descendants, then SIGKILL what is left after the grace."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 0.0)):
        pids = session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and session_pids(sid):
            time.sleep(0.05)


def die_with_parent() -> None:
    """In the child: get SIGKILL when the launcher dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def copy_stdout(src: Any, dst_path: Path) -> None:
    with dst_path.open("wb") as dst:
        for line in iter(src.readline, b""):
            dst.write(line)
            dst.flush()
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()


MAX_STDOUT_BYTES = 16 * 1024 * 1024  # a result larger than this is not searched for the reply
MAX_REPLY_CHARS = 64 * 1024


def json_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a CLI's stdout: one document (an object, or a list of them) or JSON lines."""
    try:
        doc = json.loads(text)
    except ValueError:
        objects = []
        for line in text.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue  # a CLI may print a banner or a progress line between its JSON lines
            objects.append(value)
    else:
        objects = doc if isinstance(doc, list) else [doc]
    return [o for o in objects if isinstance(o, dict)]


def dig(obj: Any, path: str) -> Any:
    """The value at a dotted key path (``item.text``), or None."""
    for key in path.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def final_reply(stdout: str, reply: dict[str, Any]) -> str | None:
    """cli.toml's [reply]: the ``field`` of the last JSON object whose ``select`` key paths hold the given
    values (any object without ``select``); None when there is none or it is not a string."""
    select = reply.get("select", {})
    for obj in reversed(json_objects(stdout)):
        if all(dig(obj, key) == value for key, value in select.items()):
            text = dig(obj, reply["field"])
            return text[:MAX_REPLY_CHARS] if isinstance(text, str) else None
    return None


def write_transcript(reply: dict[str, Any] | None, stdout_path: Path, output: Path) -> None:
    """Write the CLI's final reply as ``final`` of ``out/transcript.json`` (what task sets scoring a reply
    read); nothing when cli.toml has no [reply] or the reply cannot be found (the verifier then says so)."""
    if not reply:
        return
    # The agent's tools can write files where the launcher writes: a transcript found there is not the
    # CLI's reply (an error result would be scored as whatever the agent put there), so it goes first.
    (output / "transcript.json").unlink(missing_ok=True)
    try:
        if stdout_path.stat().st_size > MAX_STDOUT_BYTES:
            raise ValueError(f"larger than {MAX_STDOUT_BYTES} bytes")
        text = final_reply(stdout_path.read_text(errors="replace"), reply)
    except (OSError, ValueError) as exc:
        print(f"{LABEL[0]}: no final reply taken from {stdout_path.name}: {exc}", file=sys.stderr)
        return
    if text is None:
        print(f"{LABEL[0]}: no final reply in {stdout_path.name} ([reply] {reply})", file=sys.stderr)
        return
    (output / "transcript.json").write_text(json.dumps({"final": text}))


def main(harness_dir: str | Path) -> int:
    """Launch the CLI that the harness folder ``harness_dir`` describes; returns the exit status."""
    harness_dir = Path(harness_dir).resolve()
    LABEL[0] = f"launch.py ({harness_dir.name})"
    manifest = tomllib.loads((harness_dir / "harness.toml").read_text())
    cli = tomllib.loads((harness_dir / "cli.toml").read_text())
    workdir = Path(os.environ.get("CLAWPIPE_WORKDIR") or os.getcwd()).resolve()
    output = Path(os.environ.get("CLAWPIPE_OUTPUT") or workdir / "out")
    output.mkdir(parents=True, exist_ok=True)
    home = build_home(workdir)
    node_dir = find_node_dir(harness_dir)
    cli_dir, pinned_node = cli_node(node_dir, cli.get("node"))
    model = os.environ.get("CLAWPIPE_MODEL") or os.environ.get("OPENAI_MODEL") or os.environ.get("ANTHROPIC_MODEL")
    if not model:
        fail("CLAWPIPE_MODEL is not set (the served model name)")
    mode = os.environ.get("CLAWPIPE_CLI_MODE") or manifest.get("env", {}).get("CLAWPIPE_CLI_MODE", "minimal")
    modes = cli.get("modes", {})
    if mode not in modes:
        fail(f"unknown CLAWPIPE_CLI_MODE {mode!r}; this harness has modes {sorted(modes)}")

    values = {
        **os.environ,
        "prompt": read_prompt(),
        "model": model,
        "home": str(home),
        "workdir": str(workdir),
        "output": str(output),
        "node_dir": str(cli_dir),
        "harness_dir": str(harness_dir),
    }
    env = dict(os.environ)
    env.update(HOME=str(home), TMPDIR=str(home / "tmp"))
    if pinned_node:  # the CLI's own child processes that run `node` get its Node too
        env["PATH"] = f"{pinned_node.parent}:{env.get('PATH', '')}"
    for key, value in manifest.get("env", {}).items():  # declared defaults; the runner's values win
        env.setdefault(key, str(expand(value, values)))
    for table in (cli.get("env", {}), modes[mode].get("env", {})):  # derived settings, always set
        env.update({key: str(expand(value, values)) for key, value in table.items()})
    values.update(env)
    check_env_values(cli.get("env_values", {}), env)
    files = dict(cli.get("files", {}))
    for rel, content in modes[mode].get("files", {}).items():
        files[rel] = merge(files[rel], content) if rel in files else content
    write_files(home, files, values)

    entry = cli_dir / "node_modules" / cli["entry"]
    if not entry.exists():
        fail(f"{entry} is missing: run `bash scripts/install_cli_harnesses.sh`")
    argv = [str(entry)]
    if entry.suffix in (".js", ".mjs", ".cjs"):
        node = str(pinned_node) if pinned_node else shutil.which("node", path=env.get("PATH")) or "/usr/bin/node"
        argv = [node, str(entry)]
    mode_args = expand(list(modes[mode].get("args", [])), values)
    args = expand(list(cli.get("args", [])), values)
    if "${mode_args}" in cli.get("args", []):  # the mode's args go where the manifest puts them
        at = cli["args"].index("${mode_args}")
        args[at : at + 1] = mode_args
    else:
        args += mode_args
    argv += args

    timeout_s = float(os.environ.get("CLAWPIPE_TIMEOUT_S") or manifest.get("timeout_s", 600))
    # The runner starts us as a session leader: the CLI then stays in our session and process group (a
    # kill of the group takes it too). Started otherwise, the CLI gets a session of its own. Either way
    # that session is what we kill at the end.
    own_session = os.getsid(0) == os.getpid()
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=not own_session,
        preexec_fn=die_with_parent,
    )
    sid = os.getpid() if own_session else proc.pid
    stdout_path = output / cli.get("stdout_file", "cli.out")
    copier = threading.Thread(target=copy_stdout, args=(proc.stdout, stdout_path), daemon=True)
    copier.start()

    def on_signal(signum: int, _frame: Any) -> None:
        kill_session(sid)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"{LABEL[0]}: timeout after {timeout_s:.0f}s; killing the CLI", file=sys.stderr)
        code = TIMEOUT_EXIT
    kill_session(sid)
    proc.wait()
    copier.join(timeout=5)
    write_transcript(cli.get("reply"), stdout_path, output)
    return code if code >= 0 else 128 - code
