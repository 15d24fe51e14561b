"""scripts/gpu_check.sh: its reduced mode runs here on CPU; the full check runs where CUDA is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def run_check(*args: str, timeout: int) -> dict:
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cpu_smoke_runs_every_part():
    r = run_check("--cpu-smoke", timeout=300)
    assert r["device"] == "cpu (smoke)"
    assert r["ideal"] > 1 and r["tree_tokens_per_s"] > 0 and r["flat_tokens_per_s"] > 0
    assert r["speedup_vs_ideal"] == pytest.approx(r["speedup"] / r["ideal"], abs=0.01)
    assert r["long_path_tokens"] == 512 and r["long_path_step_s"] > 0
    assert r["engine_c1"]["requests"] > 0 and r["engine_c64"]["requests"] > 0


@pytest.mark.gpu
@pytest.mark.slow
def test_full_check_on_cuda():
    r = run_check(timeout=660)
    assert 480 < r["params_m"] < 510  # Qwen2-0.5B's shape
    assert r["long_path_tokens"] == 32768 and r["long_path_peak_mb"] > 0
    assert r["speedup"] > 1 and r["engine_c64"]["tok_s"] > r["engine_c1"]["tok_s"]
