"""vLLM: the command clawpipe starts, the reload helper's file handling, and vLLM-shaped responses parsed the same
way as the local engine's (so the proxy treats both alike). A gpu test runs vllm for real where it exists."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawpipe.errors import ServingError
from clawpipe.serving.vllm import (
    VllmOptions,
    build_vllm_command,
    install_weights,
    parse_chat_response,
    parse_chat_stream,
)

FIXTURES = Path(__file__).parent / "fixtures"


def test_vllm_command_has_the_flags_clawpipe_relies_on() -> None:
    cmd, env = build_vllm_command(VllmOptions(model="/models/policy", served_name="pol", port=9000, max_model_len=8192))
    assert cmd[:3] == ["vllm", "serve", "/models/policy"]
    joined = " ".join(cmd)
    for flag in [
        "--served-model-name pol",
        "--port 9000",
        "--enable-auto-tool-choice",
        "--tool-call-parser hermes",
        "--return-tokens-as-token-ids",
        "--logprobs-mode processed_logprobs",
        "--max-model-len 8192",
        "--generation-config vllm",
    ]:
        assert flag in joined
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # exposes /collective_rpc for reload_weights
    default_name, _ = build_vllm_command(VllmOptions(model="/models/policy"))
    assert default_name[default_name.index("--served-model-name") + 1] == "policy"


def test_install_weights_replaces_safetensors_in_the_served_dir(tmp_path: Path) -> None:
    ckpt, served = tmp_path / "ckpt", tmp_path / "served"
    ckpt.mkdir()
    served.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"new")
    (served / "model.safetensors").write_bytes(b"old")
    (served / "config.json").write_text("{}")
    install_weights(ckpt, served)
    assert (served / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in served.iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ServingError, match="no safetensors"):
        install_weights(tmp_path / "served" / "missing", served)


def test_parse_recorded_vllm_responses() -> None:
    body = parse_chat_response(json.loads((FIXTURES / "vllm_chat_tools.json").read_text()))
    (c,) = body["choices"]
    assert body["prompt_token_ids"] == [151644, 872, 198, 4086, 151645, 198]
    assert c["token_ids"] == [151657, 198, 4913, 151658, 151645] and len(c["logprobs"]) == 5
    assert c["tool_calls"][0]["function"]["name"] == "shell" and c["finish_reason"] == "tool_calls"
    stream = parse_chat_stream((FIXTURES / "vllm_chat_stream.txt").read_text().splitlines())
    (s,) = stream["choices"]
    assert s["text"] == "Hello there" and s["token_ids"] == [9707, 1052, 151645]
    assert s["logprobs"] == [-0.31, -1.02, -0.05] and stream["prompt_token_ids"][-1] == 198
    tools = parse_chat_stream((FIXTURES / "vllm_chat_stream_tools.txt").read_text().splitlines())
    (t,) = tools["choices"]
    assert t["token_ids"] == [151657, 4913, 2338, 151658, 151645] and len(t["logprobs"]) == 5
    assert t["tool_calls"] == [
        {
            "id": "chatcmpl-tool-77aa",
            "type": "function",
            "function": {"name": "shell", "arguments": '{"command": "ls"}'},
        }
    ]


def test_token_ids_recovered_from_token_id_strings_when_the_field_is_absent() -> None:
    raw = json.loads((FIXTURES / "vllm_chat_tools.json").read_text())
    del raw["choices"][0]["token_ids"]
    assert parse_chat_response(raw)["choices"][0]["token_ids"] == [151657, 198, 4913, 151658, 151645]


def test_local_engine_responses_parse_like_vllm_responses(server: Any) -> None:
    """The same reader gives the same ids from the local engine, streamed and not."""
    req = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "seed": 3,
        "logprobs": True,
        "return_token_ids": True,
    }
    with httpx.Client(timeout=30) as c:
        plain = parse_chat_response(c.post(f"{server.url}/v1/chat/completions", json=req).json())
        streamed_text = c.post(f"{server.url}/v1/chat/completions", json={**req, "stream": True}).text
    streamed = parse_chat_stream(streamed_text.splitlines())
    assert plain["prompt_token_ids"] == streamed["prompt_token_ids"]
    assert plain["choices"][0]["token_ids"] == streamed["choices"][0]["token_ids"]
    assert plain["choices"][0]["logprobs"] == pytest.approx(streamed["choices"][0]["logprobs"])


@pytest.mark.gpu
def test_vllm_serves_the_default_policy_with_ids_and_logprobs(tmp_path: Path) -> None:
    if shutil.which("vllm") is None:
        pytest.skip("vllm is not installed on this GPU machine: pip install vllm")
    from clawpipe.serving.policy import init_policy
    from clawpipe.serving.vllm import start_vllm

    model = init_policy(tmp_path / "medium", size="medium", seed=0)
    proc = start_vllm(VllmOptions(model=str(model), served_name="pol", port=18765, max_model_len=4096))
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get("http://127.0.0.1:18765/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(2)
        client = openai.OpenAI(base_url="http://127.0.0.1:18765/v1", api_key="k")
        r = client.chat.completions.create(
            model="pol",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        parsed = parse_chat_response(r.model_dump())
        assert parsed["prompt_token_ids"] and len(parsed["choices"][0]["token_ids"]) == len(
            parsed["choices"][0]["logprobs"]
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
