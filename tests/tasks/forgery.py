"""The reward forgery suite: crafted harness output never earns more than an honest attempt would.

Every attempt starts from a prepared work dir holding the kit's *honest wrong* answer and then crafts
something around it: fields that claim a reward, links to a winning output outside the work dir, huge or
deeply nested files, NaN/Infinity, duplicate keys, wrong types, FIFOs, links to secrets or /proc, and (for
task sets that run work-dir code) code that attacks the check. The rule, for every attempt:

- its reward is at most the reward of its baseline (the honest wrong attempt, unless it names another),
  and below 1.0 (the answer is wrong);
- verification ends in bounded time, and its reward info is plain JSON without the host's secret or paths.

Some attempts wrap a right answer in something that is not a plain answer (a link to a file outside the
work dir, a 5 MiB file, a transcript that is not plain JSON: NaN, duplicate keys, 100,000 levels deep):
verifiers reject such output whole, so they too stay at or below the honest wrong attempt.

Verification goes through :func:`clawpipe.sandbox.verify.verify_rollout` (what the runner calls), with a
real bwrap backend for task sets that declare ``needs_sandbox``, and without the runner's work-dir scrub,
so the verifiers hold on their own.

Adding a task set: give it a :class:`ForgeryKit` (how an honest harness writes a right and a wrong answer,
plus crafted attempts of its own) and register it with :func:`register_forgery_kit` next to the built-in
kits in tests/tasks/forgery_kits.py (test_forgery.py runs every task set in ``list_task_sets()``; one
without a kit runs the generic attempts that need no honest answer). A task set that lives elsewhere can
run the suite from its own tests with :func:`check_task_set`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawpipe.sandbox.backends.base import Backend
from clawpipe.sandbox.verify import verify_rollout
from clawpipe.tasks import TRANSCRIPT, needs_sandbox

SECRET = "forgery-suite-host-secret-31c7"
HUGE_BYTES = 5 * 1024 * 1024
DEEP = 100_000
MAX_VERIFY_S = 30.0

Writer = Callable[[dict[str, Any], Path], None]


@dataclass
class Scene:
    """One attempt's world: the task, its work dir, a folder outside it, and a host file holding a secret."""

    task: dict[str, Any]
    workdir: Path
    outside: Path
    secret: Path
    kit: ForgeryKit

    def right_files(self) -> dict[str, bytes]:
        """The files (relative path -> bytes) an honest harness with the right answer leaves in a work dir."""
        if self.kit.honest_right is None:
            return {}
        return _written_by(self.kit.prepare, self.kit.honest_right, self.task, self.outside.parent / "right-probe")

    def transcript(self, writer: Writer | None) -> dict[str, Any] | None:
        """The transcript ``writer`` leaves (None when it writes none)."""
        if writer is None:
            return None
        files = _written_by(self.kit.prepare, writer, self.task, self.outside.parent / "transcript-probe")
        raw = files.get(str(TRANSCRIPT))
        return json.loads(raw) if raw is not None else None

    def write(self, rel: str, data: bytes | str) -> None:
        path = self.workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    def replace_with_link(self, rel: str, target: Path) -> None:
        path = self.workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.symlink_to(target)


@dataclass(frozen=True)
class Attempt:
    """A crafted output: ``craft`` changes the work dir (which holds the honest wrong answer)."""

    name: str
    craft: Callable[[Scene], None]
    needs_right: bool = False  # uses the kit's honest right answer (skipped for a kit without one)
    baseline: Writer | None = None  # the honest attempt to compare with (default: the kit's honest wrong)


@dataclass
class ForgeryKit:
    """How an honest harness answers a task set, and that task set's own crafted attempts."""

    honest_wrong: Writer  # writes a wrong answer into a prepared work dir, as an honest harness would
    honest_right: Writer | None = None  # writes the right answer (reward 1.0)
    attempts: list[Attempt] = field(default_factory=list)
    pick_task: Callable[[Any], dict[str, Any]] = lambda task_set: task_set.generate(1, seed=0)[0]
    skip: frozenset[str] = frozenset()  # generic attempts that do not apply, by name
    prepare: Writer = lambda task, workdir: None  # set by the suite to the task set's own prepare

    def all_attempts(self) -> list[Attempt]:
        out = [a for a in GENERIC if a.name not in self.skip and (self.honest_right or not a.needs_right)]
        return out + list(self.attempts)


def _nothing(task: dict[str, Any], workdir: Path) -> None:
    pass


KITS: dict[str, ForgeryKit] = {}


def register_forgery_kit(name: str, kit: ForgeryKit) -> None:
    """Use ``kit`` for the task set called ``name`` in test_forgery.py."""
    KITS[name] = kit


def kit_for(name: str) -> ForgeryKit:
    """The registered kit, or one whose honest attempt writes nothing (generic attempts only)."""
    return KITS.get(name) or ForgeryKit(honest_wrong=_nothing)


def _snapshot(root: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _written_by(prepare: Writer, writer: Writer, task: dict[str, Any], scratch: Path) -> dict[str, bytes]:
    """Files that ``writer`` adds or changes in a freshly prepared work dir."""
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "out").mkdir(parents=True)
    prepare(task, scratch)
    before = _snapshot(scratch)
    writer(task, scratch)
    after = _snapshot(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return {k: v for k, v in after.items() if before.get(k) != v}


# --- generic attempts ------------------------------------------------------------------------------------


def _claim_reward(scene: Scene) -> None:
    claims = {"reward": 1.0, "score": 1.0, "passed": True, "solved": True, "correct": True, "status": "succeeded"}
    transcript = scene.transcript(scene.kit.honest_wrong) or {"turns": [{"reply": "done"}]}
    transcript.update(claims, reward_info={"reason": None, "passed": 5, "total": 5})
    for turn in transcript.get("turns", []):
        if isinstance(turn, dict):
            turn.update(claims)
    scene.write(str(TRANSCRIPT), json.dumps(transcript))
    for name in ("reward.json", "result.json", "reward_info.json"):
        scene.write(f"out/{name}", json.dumps({"reward": 1.0, "passed": True}))


def _link_right_output(scene: Scene) -> None:
    for rel, data in scene.right_files().items():
        target = scene.outside / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        scene.replace_with_link(rel, target)


def _link_out_folder(scene: Scene) -> None:
    right = scene.right_files()
    for rel, data in right.items():
        target = scene.outside / "out-elsewhere" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for top in {Path(rel).parts[0] for rel in right if len(Path(rel).parts) > 1}:
        scene.replace_with_link(top, scene.outside / "out-elsewhere" / top)


def _huge_right_output(scene: Scene) -> None:
    for rel, data in scene.right_files().items():
        scene.write(rel, data + b"\n" * HUGE_BYTES)  # still valid JSON / Python, just too big to read


def _right_transcript(scene: Scene) -> dict[str, Any]:
    return scene.transcript(scene.kit.honest_right) or {}


def _deep_json(scene: Scene) -> None:
    body = json.dumps(_right_transcript(scene))[1:-1]
    pad = "[" * DEEP + "]" * DEEP
    scene.write(str(TRANSCRIPT), "{" + (body + ", " if body else "") + f'"pad": {pad}' + "}")


def _nan_infinity(scene: Scene) -> None:
    body = json.dumps(_right_transcript(scene))[1:-1]
    scene.write(str(TRANSCRIPT), "{" + (body + ", " if body else "") + '"x": NaN, "y": -Infinity, "z": 1e999}')


def _duplicate_keys(scene: Scene) -> None:
    wrong = json.dumps(scene.transcript(scene.kit.honest_wrong) or {"turns": []})[1:-1]
    right = json.dumps(_right_transcript(scene))[1:-1]
    scene.write(str(TRANSCRIPT), "{" + wrong + (", " + right if right else "") + "}")  # the right keys come last


def _wrap_strings(value: Any, how: Callable[[str], Any]) -> Any:
    if isinstance(value, str):
        return how(value)
    if isinstance(value, list):
        return [_wrap_strings(v, how) for v in value]
    if isinstance(value, dict):
        return {k: _wrap_strings(v, how) for k, v in value.items()}
    return value


def _as_number(text: str) -> float | None:
    """The last number in ``text`` as a JSON number (None without one): the answer, but not as text."""
    numbers = re.findall(r"-?[0-9]+(?:\.[0-9]+)?", text)
    return float(numbers[-1]) if numbers else None


def _wrong_types_all(which: int) -> Callable[[Scene], None]:
    def craft(scene: Scene) -> None:
        right = _right_transcript(scene)
        variants: list[Any] = [
            _wrap_strings(right, lambda s: [s]),
            _wrap_strings(right, lambda s: {"text": s}),
            _wrap_strings(right, _as_number),
            {"turns": {str(i): t for i, t in enumerate(right.get("turns", []))}, "final": [right.get("final")]},
            [right],
        ]
        scene.write(str(TRANSCRIPT), json.dumps(variants[which]))

    return craft


def _fifos(scene: Scene) -> None:
    for rel in scene.right_files() or {str(TRANSCRIPT): b""}:
        path = scene.workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.mkfifo(path)  # a reader that opens it without O_NONBLOCK hangs forever


def _device_links(scene: Scene) -> None:
    rels = list(scene.right_files() or {str(TRANSCRIPT): b""})
    for rel, device in zip(rels, ["/dev/zero", "/dev/urandom", "/dev/stdin"] * len(rels), strict=False):
        scene.replace_with_link(rel, Path(device))


def _secret_links(scene: Scene) -> None:
    rels = list(scene.right_files() or {str(TRANSCRIPT): b""})
    for rel in rels:
        scene.replace_with_link(rel, scene.secret)
    scene.write("out/notes.txt", f"see {scene.secret} and /proc/self/environ")


def _proc_links(scene: Scene) -> None:
    rels = list(scene.right_files() or {str(TRANSCRIPT): b""})
    targets = ["/proc/self/environ", "/proc/1/environ", "/proc/self/cmdline"] * len(rels)
    for rel, target in zip(rels, targets, strict=False):
        scene.replace_with_link(rel, Path(target))


def _paths_as_answers(scene: Scene) -> None:
    # no digits in any path: a number in one (a pytest folder, /proc/1) would be a guess that may be right
    secret = str(scene.secret)
    if any(c.isdigit() for c in secret):
        secret = os.path.relpath(scene.secret, scene.workdir)
    paths = [secret, "/proc/self/environ", "/proc/thread-self/cmdline", "../../task.json", "file:///etc/shadow"]
    assert not any(c.isdigit() for p in paths for c in p), paths
    scene.write(str(TRANSCRIPT), json.dumps({"turns": [{"reply": p, "answer": p} for p in paths], "final": paths[0]}))


GENERIC = [
    Attempt("reward-fields", _claim_reward),
    Attempt("links-to-a-right-output-outside", _link_right_output, needs_right=True),
    Attempt("linked-output-folder", _link_out_folder, needs_right=True),
    Attempt("huge-right-output", _huge_right_output, needs_right=True),
    Attempt("deep-json", _deep_json),
    Attempt("nan-infinity", _nan_infinity),
    Attempt("duplicate-keys", _duplicate_keys),
    *[Attempt(f"wrong-types-{i}", _wrong_types_all(i), needs_right=True) for i in range(5)],
    Attempt("fifos", _fifos),
    Attempt("device-links", _device_links),
    Attempt("secret-links", _secret_links),
    Attempt("proc-links", _proc_links),
    Attempt("paths-as-answers", _paths_as_answers),
]


# --- running ---------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    attempt: str
    reward: float
    baseline: float
    info: dict[str, Any]
    seconds: float

    def problems(self, host_paths: list[str]) -> list[str]:
        out = []
        if self.reward > self.baseline + 1e-9:
            out.append(f"reward {self.reward} above the honest attempt's {self.baseline}")
        if self.reward >= 1.0:
            out.append("reward 1.0 for a wrong answer")
        text = json.dumps(self.info, allow_nan=False)
        if SECRET in text:
            out.append("the reward info carries the host secret")
        out += [f"the reward info names the host path {p}" for p in host_paths if p in text]
        if self.seconds > MAX_VERIFY_S:
            out.append(f"verification took {self.seconds:.1f} s")
        return out


def _verify(task_set: Any, task: dict[str, Any], workdir: Path, backend: Backend | None) -> tuple[float, dict]:
    if needs_sandbox(task_set):
        assert backend is not None, f"task set {task_set.name!r} needs a sandbox backend for its check"
        return verify_rollout(task_set, task, workdir, backend)
    return task_set.verify(task, workdir)


def _fresh(task_set: Any, task: dict[str, Any], root: Path, name: str, writer: Writer) -> Path:
    work = root / name / "work"
    (work / "out").mkdir(parents=True)
    task_set.prepare(task, work)
    writer(task, work)
    return work


def run_attempt(task_set: Any, kit: ForgeryKit, attempt: Attempt, root: Path, backend: Backend | None) -> Verdict:
    """Verify the attempt and its baseline in fresh work dirs under ``root``."""
    kit.prepare = task_set.prepare
    task = kit.pick_task(task_set)
    baseline_work = _fresh(task_set, task, root, f"{attempt.name}-baseline", attempt.baseline or kit.honest_wrong)
    baseline, _ = _verify(task_set, task, baseline_work, backend)
    work = _fresh(task_set, task, root, attempt.name, kit.honest_wrong)
    outside = root / f"{attempt.name}-outside"
    outside.mkdir()
    secret = root / "secret"
    if not secret.exists():
        secret.write_text(SECRET)
    attempt.craft(Scene(task=task, workdir=work, outside=outside, secret=secret, kit=kit))
    t0 = time.monotonic()
    reward, info = _verify(task_set, task, work, backend)
    return Verdict(attempt.name, float(reward), float(baseline), info, time.monotonic() - t0)


def check_task_set(task_set: Any, kit: ForgeryKit, root: Path, backend: Backend | None = None) -> list[Verdict]:
    """Run every attempt of ``kit`` against ``task_set``; raise AssertionError listing each problem found."""
    verdicts = [run_attempt(task_set, kit, a, root, backend) for a in kit.all_attempts()]
    problems = [f"{v.attempt}: {p}" for v in verdicts for p in v.problems([str(root)])]
    assert not problems, f"task set {task_set.name!r}: " + "; ".join(problems)
    return verdicts
