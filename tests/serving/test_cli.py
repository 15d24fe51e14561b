"""The serving room's CLI: `clawpipe model init`, `clawpipe serve --engine vllm --dry-run`, and a real
`clawpipe serve` subprocess answering the openai SDK."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.serving.policy import load_tokenizer
from clawpipe.serving.server import start_server_process


def test_model_init_writes_a_loadable_policy(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "init", str(tmp_path / "p"), "--size", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p" / "model.safetensors").exists()
    assert load_tokenizer(tmp_path / "p").eos_token == "<|im_end|>"


def test_serve_vllm_dry_run_prints_the_command() -> None:
    result = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--model", "/m/pol", "--port", "9001", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "VLLM_SERVER_DEV_MODE=1" in result.output and "vllm serve /m/pol" in result.output
    assert "--port 9001" in result.output and "--tool-call-parser hermes" in result.output


@pytest.mark.parametrize("given", ["{tmp}/nowhere/policy", "./no-such-policy", "{tmp}/a-file"])
def test_serve_a_model_path_that_is_no_folder_is_one_line_naming_it(tmp_path: Path, given: str) -> None:
    # before: the loader took the path for a Hugging Face id: "Repo id must be in the form 'repo_name' ..."
    import subprocess
    import sys

    (tmp_path / "a-file").write_text("not a model\n")
    model = given.format(tmp=tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "clawpipe", "serve", "--model", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CLAWPIPE_HOME": str(tmp_path / "home")},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: --model {model}: ") and "Repo id" not in out.stderr
    assert ("a file, not a folder" if model.endswith("a-file") else "no such folder") in line
    assert "clawpipe model init" in line


@pytest.mark.slow
def test_serve_subprocess_answers_and_stops(policy_dir: Path) -> None:
    handle = start_server_process(policy_dir, served_name="sub", max_model_len=2048, admin_token="t")
    try:
        client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list()] == ["sub"]
        r = client.chat.completions.create(model="sub", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.model_extra["policy_version"] == 0
    finally:
        handle.stop()
    assert handle._process is not None and handle._process.returncode is not None


def test_model_publish_reloads_a_running_server(policy_dir: Path, tmp_path: Path, home: Path) -> None:
    from clawpipe.config import get_settings
    from clawpipe.serving.client import server_health
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, max_model_len=1024, admin_token=get_settings().admin())
    try:
        new = init_policy(get_settings().models_dir / "v3", seed=3)  # reload loads from the models dir
        result = CliRunner().invoke(app, ["model", "publish", str(new), "--url", handle.url, "--policy-version", "3"])
        assert result.exit_code == 0, result.output
        assert "policy_version 3" in result.output and server_health(handle.url)["policy_version"] == 3
    finally:
        handle.stop()


@pytest.mark.slow
def test_clawpipe_serve_takes_several_served_names_and_reload_roots(policy_dir: Path, tmp_path: Path) -> None:
    """The command line the pipeline starts: `clawpipe serve` with repeated --served-name and --reload-root
    (and --no-splice: a rollout's turn sent back unchanged is re-encoded, not carried as its sampled ids), and
    the body limit --max-request-mb (a 413 past it)."""
    import subprocess
    import sys
    import time

    import httpx

    from clawpipe.net import free_port

    port = free_port()
    root = tmp_path / "ckpts"
    cmd = [sys.executable, "-m", "clawpipe", "serve", "--model", str(policy_dir), "--port", str(port)]
    cmd += ["--served-name", "clawpipe-policy", "--served-name", "alias", "--reload-root", str(root), "--no-splice"]
    cmd += ["--max-request-mb", "0.05", "--responses-kept-mb", "8"]
    proc = subprocess.Popen(cmd, env={**os.environ, "CLAWPIPE_ADMIN_TOKEN": "t"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["clawpipe-policy", "alias"]
        outside = httpx.post(
            f"{url}/admin/reload", json={"path": str(policy_dir)}, headers={"Authorization": "Bearer t"}
        )
        assert outside.status_code == 403 and str(root) in outside.json()["error"]["message"]
        rollout = {"x-clawpipe-rollout": "run/0/r0"}
        turn = [{"role": "user", "content": "hi"}]
        body = {"model": "alias", "messages": turn, "max_tokens": 6, "seed": 1}
        first = httpx.post(f"{url}/v1/chat/completions", json=body, headers=rollout).json()
        reply = first["choices"][0]["message"]["content"]
        body["messages"] = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        second = httpx.post(f"{url}/v1/chat/completions", json=body, headers=rollout).json()
        assert second["spliced_tokens"] == 0 and httpx.get(f"{url}/health").json()["splice"]["spliced_turns"] == 0
        big = {"model": "alias", "messages": [{"role": "user", "content": "x" * 60_000}], "max_tokens": 1}
        too_large = httpx.post(f"{url}/v1/chat/completions", json=big)
        assert too_large.status_code == 413 and "52428 bytes" in too_large.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
