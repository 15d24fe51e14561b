"""The shared harness library (harnesses/_kit): every backend exposes a harness's sibling `_kit` folder
read-only and names it in $CLAWPIPE_HARNESS_KIT; without one nothing is mounted or set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clawpipe.errors import ManifestError
from clawpipe.sandbox import RolloutSpec, find_harness, list_harnesses, load_manifest, run_rollouts
from tests.sandbox.support import EchoTaskSet, Upstream, make_harness

BACKENDS = [
    "process",
    pytest.param("bwrap", marks=pytest.mark.sandbox),
    pytest.param("docker", marks=pytest.mark.docker),
]
REPO = Path(__file__).resolve().parents[2]

KITTED = """
import json, os, pathlib, sys
out = pathlib.Path(os.environ["CLAWPIPE_OUTPUT"])
kit = os.environ.get("CLAWPIPE_HARNESS_KIT")
res = {"kit": kit}
if kit:
    sys.path.insert(0, kit)
    import shared_answer
    (out / "answer.txt").write_text(shared_answer.ANSWER)
    try:
        open(os.path.join(kit, "planted.py"), "w").write("x")
        res["write"] = "ok"
    except OSError as exc:
        res["write"] = type(exc).__name__
(out / "kit.json").write_text(json.dumps(res))
"""


def run_one(manifest: Any, echo: EchoTaskSet, upstream: Upstream, tmp_path: Path, backend: str) -> Any:
    spec = RolloutSpec(run_id="r", iteration=0, harness=manifest, task=echo.generate(1)[0], model="tiny")
    (res,) = run_rollouts(
        [spec],
        proxy_url=upstream.url,
        backend=backend,
        results_path=tmp_path / f"results-{manifest.name}.jsonl",
        secret=b"kit-secret",
        scratch_dir=tmp_path / "scratch",
        task_sets={"echo": echo},
        keep_workdirs=True,
    )
    return res


@pytest.mark.parametrize("backend", BACKENDS)
def test_kit_is_mounted_read_only_and_named(
    backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet
) -> None:
    root = tmp_path / "harnesses"
    kit = root / "_kit"
    kit.mkdir(parents=True)
    (kit / "shared_answer.py").write_text('ANSWER = "42"\n')
    kit.chmod(0o755)
    (kit / "shared_answer.py").chmod(0o644)
    m = load_manifest(make_harness(root, "kitted", KITTED))
    assert m.kit_dir == kit.resolve()
    res = run_one(m, echo, upstream, tmp_path, backend)
    assert (res.status, res.reward) == ("succeeded", 1.0), res.stderr_tail
    seen = json.loads((Path(res.workdir) / "out" / "kit.json").read_text())
    if backend == "process":
        assert seen["kit"] == str(kit.resolve())
    else:
        assert seen["kit"] == "/harness-kit"
        assert seen["write"] in ("OSError", "PermissionError") and not (kit / "planted.py").exists()


@pytest.mark.parametrize("backend", ["process", pytest.param("bwrap", marks=pytest.mark.sandbox)])
def test_no_kit_no_variable(backend: str, tmp_path: Path, upstream: Upstream, echo: EchoTaskSet) -> None:
    m = load_manifest(make_harness(tmp_path / "bare", "plain", KITTED))
    assert m.kit_dir is None
    res = run_one(m, echo, upstream, tmp_path, backend)
    assert res.status == "succeeded", res.stderr_tail
    assert json.loads((Path(res.workdir) / "out" / "kit.json").read_text()) == {"kit": None}


def test_kit_is_no_harness_and_its_variable_is_reserved(tmp_path: Path) -> None:
    assert "_kit" not in [p.parent.name for p in list_harnesses([REPO / "harnesses"])]
    with pytest.raises(ManifestError, match="no harness named '_kit'"):
        find_harness("_kit", [REPO / "harnesses"])
    with pytest.raises(ManifestError, match="may not set CLAWPIPE_HARNESS_KIT"):
        load_manifest(make_harness(tmp_path, "greedy", "", env={"CLAWPIPE_HARNESS_KIT": "/x"}))
    for name in ("chat-loop", "tool-agent", "codex"):
        assert find_harness(name, [REPO / "harnesses"]).kit_dir == REPO / "harnesses" / "_kit"
