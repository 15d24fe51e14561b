"""Links a harness leaves for the host's scrub of its work dir: each link whose target steps through a
link thousands of times (``x/x/x/.../x/..`` with ``x -> .``) cost the host a component-by-component
resolution of milliseconds; with the inode quota's 262,144 entries that held the runner for minutes after
the harness had ended. The host now lets the kernel resolve each link (at most 40 links deep), as its own
open() would."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from clawpipe.sandbox import load_manifest
from clawpipe.sandbox.workdir import scrub_workdir
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness, run_harnesses

LINKS = 5000
DEPTH = 1500  # components of each link's target: 'x/' 1,500 times, then '..' out of the work dir

PLANTER = rf"""
import os
os.makedirs("trap")
os.symlink(".", "trap/x")
target = "x/" * {DEPTH} + "../../../etc/passwd"
for i in range({LINKS}):
    os.symlink(target, f"trap/l{{i}}")
with open(os.path.join(os.environ["CLAWPIPE_OUTPUT"], "answer.txt"), "w") as f:
    f.write("42")
"""


@pytest.mark.sandbox
def test_links_through_a_link_thousands_of_times_are_scrubbed_in_moments(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    m = load_manifest(make_harness(tmp_path, "planter", PLANTER))
    t0 = time.monotonic()
    res = run_harnesses([m], upstream, tmp_path, echo, backend="bwrap")
    took = time.monotonic() - t0
    assert res[0].status == "succeeded" and res[0].reward == 1.0, (res[0].status, res[0].error)
    info = json.loads(res[0].reward_info or "{}")
    assert info["scrubbed_count"] == LINKS, info  # every link leaves the work dir; x itself stays inside
    assert took < 8, took  # resolved component by component, the scrub alone took 15 s here


def test_the_scrub_resolves_links_as_the_kernel_does(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "file").write_text("x")
    os.symlink(".", work / "sub" / "x")
    links = {
        "inside": "sub/../file",
        "inside_through_x": "sub/" + "x/" * 30 + "../file",  # 31 links on the way: the kernel follows them
        "dangling_inside": "sub/missing",
        "to_root": "/",
        "up": "../" + work.name + "/file",  # back into the work dir through its parent: still inside
        "out": "../../",
        "dangling_out": "/no/such/place",
        "loop_out": "sub/" + "x/" * 50 + "../..",  # too deep for the kernel: judged by its text
        "self_loop": "self_loop",
    }
    for name, target in links.items():
        os.symlink(target, work / name)
    removed = set(scrub_workdir(work))
    assert removed == {"to_root", "out", "dangling_out", "loop_out"}, removed
