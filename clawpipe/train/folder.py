"""What the trainer checks of a policy folder before and after transformers loads it.

The trainer takes folders saved by other tools too (``clawpipe train --policy DIR``, ``policy = "<dir>"``). Before
loading: config.json must name an architecture transformers has built in and no model code of its own
(``auto_map``: clawpipe never passes trust_remote_code), and the weight files must hold as many parameters as the
config describes (counted from the safetensors headers, or a weights-only, memory-mapped unpickling of
``pytorch_model.bin``, against the model built on the meta device), so an absurd config (``vocab_size`` 2**31) or a
folder missing tensors is refused before transformers allocates and randomly fills what is missing. After
loading: no tensor may be missing, and every tokenizer id needs an embedding row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

from clawpipe.errors import TrainingError
from clawpipe.modelbuild import MODEL_BUILD

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_before_load(path: Path) -> None:
    """TrainingError when the folder's config names foreign code or more parameters than its weights hold."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise TrainingError(f"{path / 'config.json'} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise TrainingError(f"{path / 'config.json'} must hold a JSON object")
    if raw.get("auto_map"):
        raise TrainingError(
            f"{path / 'config.json'} names model code shipped in the folder (auto_map {raw['auto_map']}); clawpipe "
            "never runs code from a model folder (no trust_remote_code): remove auto_map if the model is a plain "
            f"{raw.get('model_type', '<model_type>')}, or use a built-in architecture"
        )
    if raw.get("model_type") not in CONFIG_MAPPING:
        raise TrainingError(
            f"{path / 'config.json'} has model_type {raw.get('model_type')!r}, not an architecture this transformers "
            "knows; clawpipe never runs code from a model folder: convert the model to a built-in causal LM"
        )
    wanted = _config_params(path)
    held = _stored_params(path)
    if held is not None and held < wanted:
        raise TrainingError(
            f"config.json of {path} describes {wanted:,} parameters but its weight files hold {held:,}: the config "
            "does not describe these weights (or tensors are missing); fix config.json or complete the weights"
        )


def _config_params(path: Path) -> int:
    try:
        cfg = AutoConfig.from_pretrained(str(path))
        # shapes only: nothing is allocated however large the config says it is; MODEL_BUILD: another thread's
        # build must not have tie_weights swapped out meanwhile (clawpipe/modelbuild.py)
        with MODEL_BUILD, torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # transformers raises many types for a config it cannot build
        raise TrainingError(f"{path} does not describe a causal LM transformers can build: {exc}") from exc
    return sum(p.numel() for p in model.parameters())


def _stored_params(path: Path) -> int | None:
    """Parameters held by the folder's weight files (None when it has none: transformers then says so)."""
    name = next((n for n in WEIGHT_FILES if (path / n).is_file()), None)
    if name is None:
        return None
    if name.endswith(".index.json"):
        try:
            files = sorted({path / f for f in json.loads((path / name).read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TrainingError(f"{path / name} is not a weight index with a weight_map ({exc})") from exc
        gone = [f.name for f in files if not f.is_file()]
        if gone:
            raise TrainingError(f"{path / name} lists {gone[0]}, which is not there: the folder is incomplete")
    else:
        files = [path / name]
    total = 0
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt") as f:
                    total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
            else:
                total += sum(v.numel() for v in _unpickled(file).values() if isinstance(v, torch.Tensor))
        except Exception as exc:  # safetensors' and the weights-only unpickler's own errors
            raise TrainingError(
                f"{file} does not load as weights ({_reason(exc)}); pickled weights are read weights-only and "
                "never run code: use safetensors from a source you trust, and a completely written folder"
            ) from exc
    return total


def _unpickled(file: Path) -> dict[str, Any]:
    """A pickled state dict, weights-only (a pickle naming any other callable is refused before it runs),
    memory-mapped unless it is in the legacy (non-zip) format, which cannot be."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


def _reason(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "global" in ln]
    return lines[0] if lines else f"{type(exc).__name__}: {str(exc)[:200]}"


def check_after_load(path: Path, model: Any, info: dict[str, Any], tokenizer: Any) -> None:
    """TrainingError when transformers filled tensors at random, or a tokenizer id has no embedding row."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise TrainingError(
            f"the weights in {path} lack {len(missing)} tensors the model needs ({', '.join(missing[:3])}); "
            "transformers would train them from random values: the folder is incomplete or its weights belong "
            "to another model"
        )
    vocab = int(model.config.vocab_size)
    if tokenizer is not None and len(tokenizer) > vocab:
        raise TrainingError(
            f"the tokenizer in {path} has {len(tokenizer)} ids but the model embeds only vocab_size {vocab}: resize "
            "the model's embeddings to the tokenizer (model.resize_token_embeddings) or use the tokenizer it was "
            "trained with"
        )
