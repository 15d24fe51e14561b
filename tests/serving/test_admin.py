"""The engine's admin endpoint: reload loads only from the allowed roots (after resolving links and '..'), the
token is checked, and policy versions outside the lake's 32-bit range are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from clawpipe.serving import policy
from tests.serving.conftest import ADMIN

AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.mark.slow
def test_reload_loads_only_from_the_models_and_run_checkpoint_directories(
    policy_dir: Path, home: Path, tmp_path: Path
) -> None:
    from clawpipe.config import get_settings
    from clawpipe.serving.server import start_server

    settings = get_settings()
    outside = policy.init_policy(tmp_path / "elsewhere" / "ckpt", size="tiny", seed=1)
    in_models = settings.models_dir / "v1"
    in_run = settings.runs_dir / "run-a" / "checkpoints" / "policy-v2"
    in_run_logs = settings.runs_dir / "run-a" / "logs" / "policy-v3"
    for d in (in_models, in_run, in_run_logs):
        shutil.copytree(outside, d)
    linked = settings.models_dir / "linked"
    linked.symlink_to(outside, target_is_directory=True)
    with_linked_file = settings.models_dir / "v4"
    shutil.copytree(outside, with_linked_file)
    (with_linked_file / "model.safetensors").unlink()
    (with_linked_file / "model.safetensors").symlink_to(outside / "model.safetensors")

    handle = start_server(policy_dir, device="cpu", admin_token=ADMIN, max_model_len=1024)
    try:

        def reload(path: Path | str, **extra: object) -> httpx.Response:
            return httpx.post(f"{handle.url}/admin/reload", json={"path": str(path), **extra}, headers=AUTH, timeout=60)

        refused = {
            "outside": reload(outside),
            "symlink": reload(linked),
            "dotdot": reload(f"{settings.models_dir}/../../elsewhere/ckpt"),
            "run logs": reload(in_run_logs),
            "linked file": reload(with_linked_file),
        }
        models = reload(in_models, policy_version=3)
        run = reload(in_run, policy_version=4)
    finally:
        handle.stop()
    for name, r in refused.items():
        assert r.status_code == 403, (name, r.text)
        message = r.json()["error"]["message"]
        assert str(settings.models_dir) in message and "checkpoints" in message, (name, message)
    assert models.status_code == 200 and models.json()["policy_version"] == 3
    assert run.status_code == 200 and run.json()["policy_version"] == 4


def test_reload_checks_the_token_and_the_policy_version_range(server: object, scripted_dir: Path) -> None:
    url = f"{server.url}/admin/reload"  # type: ignore[attr-defined]
    body = {"path": str(scripted_dir)}
    wrong = [httpx.post(url, json=body, headers={"Authorization": h}) for h in ("Bearer nope", "", f"Bearer {ADMIN}x")]
    assert all(r.status_code == 401 for r in wrong)
    non_ascii = httpx.post(url, json=body, headers={"Authorization": "Bearer \xe9t\xe9".encode("latin-1")})
    assert non_ascii.status_code == 401
    for version in (-1, 2**31, 10**30, True, 1.5, "3"):
        r = httpx.post(url, json={**body, "policy_version": version}, headers=AUTH)
        assert r.status_code == 400, (version, r.text)
        assert "[0, 2147483647]" in r.json()["error"]["message"]
