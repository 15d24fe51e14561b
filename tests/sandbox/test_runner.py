"""The runner with the process backend: statuses, rewards, durable rows, infra retries, group masks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from clawpipe.capture import read_results
from clawpipe.errors import Halted, ManifestError, SandboxError
from clawpipe.keys import verify_key
from clawpipe.net import free_port
from clawpipe.sandbox import RolloutSpec, iter_rollouts, load_manifest, masked_groups, run_rollouts
from clawpipe.sandbox.backends.base import Outcome, SandboxJob
from clawpipe.sandbox.backends.process import ProcessBackend
from clawpipe.sandbox.bridge import _RequestCounter, listen_on_host
from clawpipe.sandbox.limits import CgroupLayout
from clawpipe.sandbox.rollout import classify
from clawpipe.sandbox.workdir import scrub_report
from tests.sandbox.support import CHAT_HARNESS, EchoTaskSet, Upstream, make_harness
from tests.support.net import accepted_nodelay

SECRET = b"test-secret"


def specs_for(manifest: Any, echo: EchoTaskSet, n: int, **kw: Any) -> list[RolloutSpec]:
    return [
        RolloutSpec(run_id="run1", iteration=3, harness=manifest, task=t, model="tiny", **kw) for t in echo.generate(n)
    ]


def run(specs: list[RolloutSpec], upstream: Upstream, tmp_path: Path, echo: EchoTaskSet, **kw: Any) -> list[Any]:
    opts: dict[str, Any] = {
        "backend": "process",
        "concurrency": 4,
        "results_path": tmp_path / "results.jsonl",
        "secret": SECRET,
        "scratch_dir": tmp_path / "scratch",
        "task_sets": {"echo": echo},
    }
    opts.update(kw)
    return run_rollouts(specs, proxy_url=upstream.url, **opts)


def test_chat_harness_rollouts_get_rewards_keys_and_rows(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path, "chat", CHAT_HARNESS))
    seen: list[int] = []
    before = len(upstream.calls)
    results = run(specs_for(m, echo, 3), upstream, tmp_path, echo, progress=lambda r, d, t: seen.append(d))
    assert [r.status for r in results] == ["succeeded"] * 3
    assert [r.reward for r in results] == [1.0] * 3 and all(r.n_calls == 1 for r in results)
    assert seen == [1, 2, 3]
    calls = upstream.calls[before:]
    keys = {c["path"].split("/")[2] for c in calls}
    assert len(keys) == 3  # one key per rollout, carried in the base URL and as the bearer token
    assert {c["auth"] for c in calls} == {f"Bearer {k}" for k in keys}
    assert {verify_key(SECRET, k).rollout_id for k in keys} == {r.rollout_id for r in results}
    rows = [row for _, row, _ in read_results(tmp_path / "results.jsonl")]
    assert sorted(r["rollout_id"] for r in rows) == sorted(r.rollout_id for r in results)
    assert rows[0]["run_id"] == "run1" and rows[0]["iteration"] == 3 and rows[0]["backend"] == "process"
    assert json.loads(rows[0]["reward_info"]) == {"got": "42"}


def test_statuses_failed_crashed_timeout_and_stderr_tail(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    fail = load_manifest(
        make_harness(tmp_path, "fail", "import sys\nsys.stderr.write('boom' * 2000 + 'END')\nsys.exit(3)\n")
    )
    crash = load_manifest(make_harness(tmp_path, "crash", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"))
    slow = load_manifest(make_harness(tmp_path, "slow", "import time\ntime.sleep(60)\n", timeout_s=1))
    t = echo.generate(3)
    specs = [
        RolloutSpec(run_id="r", iteration=0, harness=h, task=t[i], model="m") for i, h in enumerate((fail, crash, slow))
    ]
    res = run(specs, upstream, tmp_path, echo)
    assert [r.status for r in res] == ["failed", "crashed", "timeout"]
    assert res[0].exit_code == 3 and res[0].stderr_tail.endswith("END") and len(res[0].stderr_tail) == 4000
    assert res[1].exit_code is None
    assert all(r.reward == 0.0 for r in res)  # the verifier still scores what is there
    assert res[2].duration_s < 10


class FlakyBackend(ProcessBackend):
    """Fails to start the sandbox a given number of times per rollout, then works."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.calls: dict[str, int] = {}

    def run(self, job: SandboxJob, bridge: Any) -> Outcome:
        n = self.calls.get(job.rollout_id, 0) + 1
        self.calls[job.rollout_id] = n
        if n <= self.failures:
            raise SandboxError("sandbox refused to start")
        return super().run(job, bridge)


def test_only_infra_errors_are_retried_and_groups_masked(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path, "fail", "raise SystemExit(1)\n"))
    res = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend=FlakyBackend(1), max_attempts=3)
    assert (res[0].status, res[0].attempt) == ("failed", 2)  # retried once for the infra error, not for exit 1
    task = echo.generate(1)[0]
    specs = [RolloutSpec(run_id="r", iteration=1, harness=m, task=task, model="m", sample_idx=i) for i in range(2)]
    res = run(
        specs, upstream, tmp_path, echo, backend=FlakyBackend(5), max_attempts=2, results_path=tmp_path / "b.jsonl"
    )
    assert [(r.status, r.attempt) for r in res] == [("infra_error", 2), ("infra_error", 2)]
    assert res[0].error == "sandbox refused to start"
    rows = [row for _, row, _ in read_results(tmp_path / "b.jsonl")]
    assert masked_groups(rows) == masked_groups(res) == {("r", 1, task["task_id"])}


def test_rows_are_on_disk_as_each_rollout_finishes(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path, "quick", "pass\n"))
    it = iter_rollouts(
        specs_for(m, echo, 4),
        proxy_url=upstream.url,
        backend="process",
        concurrency=1,
        results_path=tmp_path / "r.jsonl",
        secret=SECRET,
        scratch_dir=tmp_path / "s",
        task_sets={"echo": echo},
    )
    first = next(it)
    rows = [row for _, row, _ in read_results(tmp_path / "r.jsonl")]
    assert [r["rollout_id"] for r in rows] == [first.rollout_id]
    it.close()  # the batch "dies": what finished is kept


def test_a_halted_batch_starts_no_more_rollouts_and_lets_those_under_way_finish(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    # how a stopping run reaches a batch in a worker thread (async mode): before, the batch ran to its end
    m = load_manifest(make_harness(tmp_path, "slow", "import time\ntime.sleep(1.5)\n"))
    halt = threading.Event()
    seen: list[str] = []

    def progress(result: Any, done: int, total: int) -> None:
        seen.append(result.rollout_id)
        halt.set()  # the run stops while the second rollout runs

    t0 = time.monotonic()
    with pytest.raises(Halted, match=r"the run is stopping; the rollouts under way finish") as stopped:
        run(specs_for(m, echo, 8), upstream, tmp_path, echo, concurrency=1, halt=halt, progress=progress)
    rows = [row for _, row, _ in read_results(tmp_path / "results.jsonl")]
    # the first one had ended; the next was under way (unless the halt came before a worker took it) and
    # finished, its row written; none started after
    assert len(rows) in (1, 2) and {r["status"] for r in rows} == {"succeeded"}
    assert f", {8 - len(rows)} not started" in str(stopped.value)
    assert seen[0] == rows[0]["rollout_id"]
    assert time.monotonic() - t0 < 8 * 1.5 / 2  # not the whole batch's time
    # unhalted, the same call runs every rollout (the event is only looked at)
    assert len(run(specs_for(m, echo, 3), upstream, tmp_path / "again", echo, halt=threading.Event())) == 3


def test_bad_spec_fails_before_anything_runs(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path, "chat", CHAT_HARNESS))
    good = specs_for(m, echo, 1)
    bad_task = RolloutSpec(run_id="r", iteration=0, harness=m, task={"task_set": "echo"}, model="m")
    before = len(upstream.calls)
    with pytest.raises(ManifestError, match="rollout 1 task: missing `task_id`"):
        run([*good, bad_task], upstream, tmp_path, echo)
    wrong_set = RolloutSpec(run_id="r", iteration=0, harness=m, task={**good[0].task, "task_set": "calc"}, model="m")
    with pytest.raises(ManifestError, match="supports task sets \\['echo'\\], not 'calc'"):
        run([*good, wrong_set], upstream, tmp_path, echo)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "harness.toml").write_text('name = "broken"\n')
    with pytest.raises(ManifestError, match="missing required key `command`"):
        run(
            [*good, RolloutSpec(run_id="r", iteration=0, harness="broken", task=good[0].task, model="m")],
            upstream,
            tmp_path,
            echo,
            harness_dirs=[tmp_path],
        )
    assert len(upstream.calls) == before and not (tmp_path / "results.jsonl").exists()


def test_planted_symlink_is_scrubbed_before_the_verifier(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    secret_file = tmp_path / "host-secret.txt"
    secret_file.write_text("42")
    script = f"import os\nos.symlink({str(secret_file)!r}, os.environ['CLAWPIPE_OUTPUT'] + '/answer.txt')\n"
    m = load_manifest(make_harness(tmp_path, "plant", script))
    res = run(specs_for(m, echo, 1), upstream, tmp_path, echo)
    assert res[0].reward == 0.0
    assert json.loads(res[0].reward_info) == {"got": None, "scrubbed": ["out/answer.txt"]}


MANY_LINKS = """
import os
out = os.environ["CLAWPIPE_OUTPUT"]
for i in range(3000):
    os.symlink("/etc/passwd", os.path.join(out, f"{'x' * 200}{i}"))
"""


def test_a_harness_cannot_bloat_its_row_with_scrubbed_names(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    m = load_manifest(make_harness(tmp_path, "links", MANY_LINKS))
    res = run(specs_for(m, echo, 1), upstream, tmp_path, echo)
    info = json.loads(res[0].reward_info)
    assert (res[0].reward, info["scrubbed_count"], len(info["scrubbed"])) == (0.0, 3000, 20)
    assert len(res[0].reward_info) < 8000  # 3000 names of 200 characters took 650 kB
    assert scrub_report(["a" * 5000])["scrubbed"] == [f"{'a' * 500}...{'a' * 500}"] and scrub_report(["a/b"]) == {
        "scrubbed": ["a/b"]
    }


def test_classify_and_request_counter() -> None:
    assert classify(Outcome(exit_code=0)) == "succeeded"
    assert classify(Outcome(exit_code=1)) == "failed"
    assert classify(Outcome(signal=9)) == "crashed"
    assert classify(Outcome(signal=9, oom=True)) == "oom"
    assert classify(Outcome(timed_out=True, oom=True)) == "timeout"
    c = _RequestCounter()
    body = b'{"a": 1}'
    req = b"POST /r/k/v1/chat/completions HTTP/1.1\r\nContent-Length: 8\r\n\r\n" + body
    stream = req * 3 + b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n" + body + b"\r\n0\r\n\r\n" + req
    for i in range(0, len(stream), 7):  # arbitrary split points
        c.feed(stream[i : i + 7])
    assert c.count == 5
    for step in (1, 2, 3, 5, 64, len(stream)):  # every cut, a byte at a time included
        c = _RequestCounter()
        for i in range(0, len(stream), step):
            c.feed(stream[i : i + step])
        assert c.count == 5, step


def test_request_counter_is_linear_in_the_bytes_a_byte_at_a_time() -> None:
    """A harness writing its requests a byte at a time: the counter (run on the bridge's one thread for every
    sandbox) searched and copied its whole buffer again for each byte, ~1.8 s of CPU per 64 KB of head; it
    now looks at each byte a bounded number of times. A request cut into single bytes is counted, then 256 KB
    of a head that never ends stops the counting (not HTTP it reads), well within a bound the old counter
    took several times over."""
    c = _RequestCounter()
    req = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 4\r\n\r\n{}{}"
    junk = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * (256 << 10) + b"\r\n\r\n"
    t0 = time.process_time()
    for stream in (req, junk, req):
        for i in range(len(stream)):
            c.feed(stream[i : i + 1])
    cpu = time.process_time() - t0
    assert c.count == 1
    assert cpu < 3.0, f"{cpu:.2f} CPU s for {len(junk) >> 10} KB fed a byte at a time"


def test_bridge_listeners_accept_connections_with_tcp_nodelay() -> None:
    """The bridge relays streamed replies in many small writes; Nagle would hold each one for the sandboxed
    client's delayed ACK (~40 ms). asyncio sets TCP_NODELAY on accepted sockets only for IPPROTO_TCP listeners."""
    assert accepted_nodelay(listen_on_host()) != 0


def test_missing_ro_path_fails_before_anything_runs(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    d = make_harness(tmp_path / "harnesses", "needs-node", "pass\n")
    (d / "harness.toml").write_text((d / "harness.toml").read_text() + '[sandbox]\nro_paths = [".node"]\n')
    m = load_manifest(d)
    with pytest.raises(ManifestError, match=r"needs .*\.node \(sandbox.ro_paths\) but it does not exist"):
        run(specs_for(m, echo, 1), upstream, tmp_path, echo)
    assert not (tmp_path / "results.jsonl").exists()


class ProxyDownBackend(ProcessBackend):
    """Runs the harness, then reports that the bridge could not reach the proxy (as when it dies mid-batch)."""

    def run(self, job: SandboxJob, bridge: Any) -> Outcome:
        out = super().run(job, bridge)
        out.proxy_unreachable, out.notes = 1, ["proxy 127.0.0.1:1 unreachable: refused"]
        return out


def test_proxy_down_is_an_infra_error(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path, "fail", "raise SystemExit(1)\n"))
    res = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend=ProxyDownBackend(), max_attempts=2)
    assert (res[0].status, res[0].attempt) == ("infra_error", 2)
    assert "could not reach the proxy" in res[0].error
    port = free_port()  # nothing listens there now
    with pytest.raises(SandboxError, match="nothing answers at the proxy"):
        run_rollouts(
            specs_for(m, echo, 1),
            proxy_url=f"http://127.0.0.1:{port}",
            backend="process",
            secret=SECRET,
            results_path=tmp_path / "never.jsonl",
            scratch_dir=tmp_path / "s",
            task_sets={"echo": echo},
        )
    assert not (tmp_path / "never.jsonl").exists()


def test_rlimit_fallback_without_cgroups(tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    hog = "chunks = []\nfor _ in range(100):\n    chunks.append(b'x' * (16 << 20))\n"
    m = load_manifest(make_harness(tmp_path, "hog", hog, resources={"memory_mb": 128}))
    backend = ProcessBackend(cgroups=CgroupLayout(version=0))  # as where no cgroup is writable
    res = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend=backend)
    assert res[0].status == "oom" and res[0].stderr_tail.strip().endswith("MemoryError")


class BrokenPrepare(EchoTaskSet):
    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        raise RuntimeError("this task cannot be prepared")


def test_a_rollout_whose_setup_raises_leaves_no_folder_mounted(tmp_path: Path, upstream: Upstream) -> None:
    harness = make_harness(tmp_path, "h", "pass\n")
    specs = [
        RolloutSpec(run_id="r", iteration=0, harness=str(harness), task=t, model="m") for t in EchoTaskSet().generate(2)
    ]
    res = run_rollouts(
        specs,
        proxy_url=upstream.url,
        backend=ProcessBackend(),
        results_path=tmp_path / "results.jsonl",
        secret=b"s",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": BrokenPrepare()},
        max_attempts=1,
    )
    assert [r.status for r in res] == ["infra_error"] * 2 and "cannot be prepared" in (res[0].error or "")
    mounts = Path("/proc/self/mounts").read_text()
    assert str(tmp_path / "scratch") not in mounts  # each rollout's quota tmpfs went with its failed setup
    assert not list((tmp_path / "scratch" / "r" / "iter-0").iterdir())
