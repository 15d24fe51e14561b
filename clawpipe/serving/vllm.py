"""vLLM as the policy server on GPU machines: the `vllm serve` command clawpipe relies on, a weight-reload
helper, and readers of vLLM's responses (the same fields the local engine returns).

Flags and why:
- `--served-model-name NAME`: harnesses send CLAWPIPE_MODEL; vLLM must answer to it.
- `--enable-auto-tool-choice --tool-call-parser hermes`: the `<tool_call>{json}</tool_call>` format of the
  default policy and of Qwen2.5/Qwen3 chat templates becomes OpenAI `tool_calls`.
- `--return-tokens-as-token-ids`: logprob entries name their token as `token_id:N`, so ids survive even where
  `return_token_ids` (a per-request field the proxy adds) is unavailable.
- `--logprobs-mode processed_logprobs`: logprobs after temperature (the trainer scores log_softmax(logits / T));
  keep top_p = 1 in training runs, since vLLM's processed logprobs also reflect top-p/top-k filtering.
- `--max-logprobs 1`, `--generation-config vllm`: no top-k lists; vLLM's own sampling defaults, not the model's.
- `VLLM_SERVER_DEV_MODE=1`: exposes `/collective_rpc`, used by `reload_vllm_weights` to call the workers'
  `reload_weights` after the trainer overwrote the served directory's weights.
vLLM reports no policy_version: the proxy stamps calls with the version it was told on publish.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawpipe.apis import json_events, reassemble
from clawpipe.errors import ServingError

log = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")


@dataclass
class VllmOptions:
    """What `clawpipe serve --engine vllm` passes on to `vllm serve`."""

    model: str
    served_name: str | list[str] | None = None  # one name or several
    host: str = "127.0.0.1"
    port: int = 8000
    tool_parser: str = "hermes"
    max_model_len: int | None = None
    dtype: str = "bfloat16"
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    logprobs_mode: str | None = "processed_logprobs"
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)


def build_vllm_command(opts: VllmOptions) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` argv and the extra environment it needs."""
    cmd = ["vllm", "serve", opts.model]
    names = [opts.served_name] if isinstance(opts.served_name, str) else list(opts.served_name or [])
    cmd += ["--served-model-name", *(names or [Path(opts.model).name])]
    cmd += ["--host", opts.host, "--port", str(opts.port)]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", opts.tool_parser]
    cmd += ["--return-tokens-as-token-ids", "--max-logprobs", "1", "--generation-config", "vllm"]
    if opts.logprobs_mode:
        cmd += ["--logprobs-mode", opts.logprobs_mode]
    cmd += ["--dtype", opts.dtype, "--seed", str(opts.seed)]
    if opts.max_model_len:
        cmd += ["--max-model-len", str(opts.max_model_len)]
    if opts.gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.max_num_seqs:
        cmd += ["--max-num-seqs", str(opts.max_num_seqs)]
    cmd += list(opts.extra_args)
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return cmd, env


def start_vllm(opts: VllmOptions) -> subprocess.Popen[bytes]:
    """Start `vllm serve` (the caller waits for /health and stops it)."""
    if shutil.which("vllm") is None:
        raise ServingError("vllm is not installed: `pip install vllm` on a CUDA machine, or use --engine local")
    cmd, env = build_vllm_command(opts)
    log.info("starting %s", " ".join(cmd))
    return subprocess.Popen(cmd, env={**os.environ, **env})


def install_weights(checkpoint: str | Path, served_dir: str | Path) -> list[Path]:
    """Copy a checkpoint's weight files into the directory vLLM serves (temp name + rename per file)."""
    src, dst = Path(checkpoint), Path(served_dir)
    files = [p for pattern in WEIGHT_FILES for p in sorted(src.glob(pattern))]
    if not files:
        raise ServingError(f"no safetensors weights in {src}: save the checkpoint with save_pretrained")
    out = []
    for f in files:
        tmp = dst / f".{f.name}.tmp"
        shutil.copyfile(f, tmp)
        os.replace(tmp, dst / f.name)
        out.append(dst / f.name)
    return out


def reload_vllm_weights(
    base_url: str, checkpoint: str | Path, served_dir: str | Path, timeout_s: float = 600
) -> dict[str, Any]:
    """Publish a checkpoint to a running vLLM: install its weights in the served dir, reload them, reset the
    prefix cache (cached KV came from the old weights). The proxy drains in-flight calls before this."""
    import httpx

    install_weights(checkpoint, served_dir)
    root = base_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=timeout_s) as client:
        r = client.post(f"{root}/collective_rpc", json={"method": "reload_weights"})
        if r.status_code != 200:
            raise ServingError(
                f"vLLM refused reload_weights ({r.status_code}: {r.text[:200]}); start it with VLLM_SERVER_DEV_MODE=1 "
                "(clawpipe serve --engine vllm does)"
            )
        client.post(f"{root}/reset_prefix_cache")
    return {"status": "ok", "checkpoint": str(checkpoint)}


# ---------------------------------------------------------------- reading vLLM responses


def _token_id(entry: dict[str, Any]) -> int | None:
    tok = entry.get("token")
    if isinstance(tok, str) and tok.startswith("token_id:"):
        return int(tok.split(":", 1)[1])
    return None


def parse_chat_response(body: dict[str, Any]) -> dict[str, Any]:
    """From a non-streamed chat/completions body: prompt ids and per choice ids, logprobs, text, tool calls."""
    choices = []
    for ch in body.get("choices") or []:
        lp_content = ((ch.get("logprobs") or {}).get("content")) or []
        ids = ch.get("token_ids")
        if ids is None:
            ids = [_token_id(e) for e in lp_content]
        msg = ch.get("message") or {}
        choices.append(
            {
                "index": ch.get("index", 0),
                "token_ids": list(ids),
                "logprobs": [e["logprob"] for e in lp_content]
                or list(((ch.get("logprobs") or {}).get("token_logprobs")) or []),
                "text": msg.get("content") if msg else ch.get("text"),
                "tool_calls": msg.get("tool_calls") or [],
                "finish_reason": ch.get("finish_reason"),
            }
        )
    return {"prompt_token_ids": body.get("prompt_token_ids"), "choices": choices}


def parse_chat_stream(lines: list[str]) -> dict[str, Any]:
    """An SSE chat/completions stream (its lines), read as :func:`parse_chat_response` reads the body the same
    call returns unstreamed: the stream is reassembled into that body first (:func:`clawpipe.apis.reassemble`)."""
    return parse_chat_response(reassemble("chat", json_events("\n".join(lines).encode())))
