"""Hostile outputs: results that are links to host files or FIFOs, file names with newlines and bytes that
are not UTF-8, a 20 MB stderr line of such bytes. The rollout is concluded and scored, its result row is
valid UTF-8 JSON whose reward info says what was scrubbed, and its stderr tail stays bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from clawpipe.sandbox.workdir import STDERR_TAIL_BYTES
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness

BACKENDS = [pytest.param("bwrap", marks=pytest.mark.sandbox), pytest.param("docker", marks=pytest.mark.docker)]

MESSY = r"""
import os, sys
work = os.environ["CLAWPIPE_WORKDIR"].encode()
out = os.path.join(work, b"out")
os.symlink(b"/etc/shadow", os.path.join(out, b"answer.txt"))          # the result: a link to a host secret
os.mkfifo(os.path.join(work, b"pipe\nwith newline"))                   # a FIFO with a newline in its name
os.symlink(b"/etc/passwd", os.path.join(work, b"link-\xff\xfe-\n-name"))  # a link named with bytes not UTF-8
with open(os.path.join(work, b"plain-\xc3\x28-\nfile"), "wb") as f:      # a regular file so named: kept
    f.write(b"data")
line = b"\xff\xfe\x80" * (20 * 1024 * 1024 // 3)                      # 20 MB of non-UTF-8, no newline
sys.stderr.buffer.write(line)
sys.stderr.buffer.flush()
"""


def _all_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_all_strings(k), *_all_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _all_strings(v)]
    return []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow
def test_linked_fifo_and_badly_named_outputs_give_a_clean_row(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    m = load_manifest(make_harness(tmp_path, "messy", MESSY, resources={"disk_mb": 128}))
    res = run_rollouts(
        [RolloutSpec(run_id="o", iteration=0, harness=m, task=echo.generate(1)[0], model="m")],
        proxy_url=upstream.url,
        backend=backend,
        results_path=tmp_path / "results.jsonl",
        secret=b"s",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        keep_workdirs=True,
    )[0]
    assert (res.status, res.reward) == ("succeeded", 0.0), (res.status, res.error, res.stderr_tail[-200:])
    raw = (tmp_path / "results.jsonl").read_bytes()
    row = json.loads(raw.decode("utf-8"))  # strict UTF-8
    info = json.loads(row["reward_info"])
    for s in _all_strings(row) + _all_strings(info):
        s.encode("utf-8")  # no lone surrogate standing in for a byte that is not UTF-8
    assert info["got"] is None  # the link to /etc/shadow was gone before the verifier looked
    scrubbed = info["scrubbed"]
    assert len(scrubbed) == 3, scrubbed
    assert "out/answer.txt" in scrubbed and "pipe\nwith newline" in scrubbed
    assert any(s.startswith("link-") and s.endswith("-\n-name") for s in scrubbed), scrubbed
    assert len(res.stderr_tail.encode()) <= 3 * STDERR_TAIL_BYTES and res.stderr_tail  # bounded, not empty
    kept = Path(res.workdir or "")
    assert (kept / os.fsdecode(b"plain-\xc3\x28-\nfile")).read_bytes() == b"data"
