"""Checkpoints (one directory per policy_version) and publishing them to the serving engine.

Layout of ``<out>/policy-v<N>/``: the model (config.json + model.safetensors, save_pretrained), the
tokenizer files, ``optimizer.pt`` (AdamW state, to resume), ``value_head.safetensors`` (PPO) and
``trainer_state.json`` ({"policy_version": N, "parent": ..., "run_id": ..., "iteration": ..., "config": ...}).
A distributed step (``nproc > 1``) writes ``sharded/`` (model and optimizer state, torch.distributed.checkpoint)
instead of ``optimizer.pt``; the HF files beside it are the same plain, unsharded model.
A checkpoint is written to a temporary sibling and renamed into place, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from clawpipe.errors import TrainingError
from clawpipe.modelbuild import MODEL_BUILD
from clawpipe.train.folder import check_after_load, check_before_load

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
VALUE_HEAD_FILE = "value_head.safetensors"


@dataclass
class LoadedPolicy:
    model: Any
    tokenizer: PreTrainedTokenizerFast | None
    policy_version: int
    optimizer_state: dict | None
    value_head_state: dict[str, torch.Tensor] | None
    path: Path


def checkpoint_dir(out_dir: str | os.PathLike[str], policy_version: int) -> Path:
    return Path(out_dir) / f"policy-v{policy_version}"


def read_policy_version(policy_dir: str | os.PathLike[str]) -> int:
    """The policy_version recorded in a checkpoint (0 for a directory clawpipe's trainer did not write)."""
    state = Path(policy_dir) / STATE_FILE
    if state.is_file():
        return int(json.loads(state.read_text()).get("policy_version", 0))
    return 0


def load_policy(policy_dir: str | os.PathLike[str], *, attn_implementation: str = "sdpa") -> LoadedPolicy:
    """Load model (float32), tokenizer, version and optimizer state; a clear TrainingError if it does not load."""
    path = Path(policy_dir)
    if not (path / "config.json").is_file():
        raise TrainingError(
            f"policy directory {path} has no config.json: pass a directory written by save_pretrained "
            "(e.g. `clawpipe model init` or a previous `clawpipe train` checkpoint)"
        )
    with MODEL_BUILD:  # transformers swaps process-wide state while it builds (clawpipe/modelbuild.py)
        check_before_load(path)
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation=attn_implementation, output_loading_info=True
            )
        except Exception as exc:  # transformers raises many types for broken checkpoints
            raise TrainingError(f"policy directory {path} does not load as a causal LM: {exc}") from exc
    model, info = loaded
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        try:
            # never AutoTokenizer: on a qwen2 config it swaps the pre-tokenizer and changes ids
            # (docs/ARCHITECTURE.md, pitfalls)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        except Exception as exc:
            raise TrainingError(f"tokenizer in {path} does not load: {exc}") from exc
    check_after_load(path, model, info, tokenizer)
    opt_state = None
    if (path / OPTIMIZER_FILE).is_file():
        opt_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    head = load_file(path / VALUE_HEAD_FILE) if (path / VALUE_HEAD_FILE).is_file() else None
    return LoadedPolicy(model, tokenizer, read_policy_version(path), opt_state, head, path)


def staging_dir(out_dir: str | os.PathLike[str], policy_version: int) -> Path:
    """A fresh temporary sibling of ``policy-v<N>`` that is renamed into place once complete."""
    final = checkpoint_dir(out_dir, policy_version)
    return final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    policy_version: int,
    model: Any,
    tokenizer: PreTrainedTokenizerFast | None,
    optimizer: torch.optim.Optimizer | None,
    value_head: torch.nn.Module | None = None,
    meta: dict[str, Any] | None = None,
    staged: Path | None = None,
) -> Path:
    """Write ``<out>/policy-v<N>`` atomically and return it (an existing one is replaced).

    staged: a temporary folder (from :func:`staging_dir`) that already holds other parts of the checkpoint
    (the distributed trainer's sharded state); it becomes the checkpoint."""
    final = checkpoint_dir(out_dir, policy_version)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged if staged is not None else staging_dir(out_dir, policy_version)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    if value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in value_head.state_dict().items()}, tmp / VALUE_HEAD_FILE)
    state = {"policy_version": policy_version, **(meta or {})}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
    if final.exists():
        old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    log.info("checkpoint written path=%s policy_version=%d", final, policy_version)
    return final


def publish(url: str, path: str | os.PathLike[str], policy_version: int, *, token: str, timeout_s: float) -> dict:
    """POST {url}/admin/reload {"path", "policy_version"} with the admin bearer token; returns the JSON reply."""
    import httpx

    endpoint = url.rstrip("/") + "/admin/reload"
    try:
        resp = httpx.post(
            endpoint,
            json={"path": str(Path(path).resolve()), "policy_version": policy_version},
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise TrainingError(
            f"could not reach the serving engine at {endpoint} ({exc}); the checkpoint is saved at {path}: "
            "start the engine (`clawpipe serve`) and publish again"
        ) from exc
    if resp.status_code >= 400:
        raise TrainingError(
            f"serving engine refused the reload ({resp.status_code}: {resp.text[:300]}); checkpoint at {path}"
        )
    try:
        return resp.json()
    except ValueError:
        return {"status": resp.status_code}
