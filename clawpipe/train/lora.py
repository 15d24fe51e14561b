"""LoRA training (peft): low-rank adapters on the policy's linear layers, the base weights frozen.

Only the adapters (and the PPO value head) take gradients and AdamW state, so the optimizer's memory is that
of the adapters instead of twice the model's. A LoRA checkpoint ``policy-v<N>/`` holds:

- the MERGED model (base + adapters) as the plain HF folder: what the engine's /admin/reload takes, so the
  engine needs no adapter support and serves at full speed;
- ``adapter/``: the adapters alone (peft's ``save_pretrained``), for engines that load LoRA adapters at run
  time (vLLM's /v1/load_lora_adapter) on top of the base model;
- ``trainer_state.json["lora_base"]``: the base model's folder. The next step loads that base and the
  adapters (trainable) and goes on with the adapters' optimizer state (``optimizer.pt``).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from clawpipe.errors import TrainingError
from clawpipe.modelbuild import MODEL_BUILD
from clawpipe.train.checkpoint import STATE_FILE, LoadedPolicy, load_policy
from clawpipe.train.config import TrainConfig

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"


def lora_base_of(policy_dir: Path) -> Path | None:
    """The base folder of a LoRA checkpoint (None for a full checkpoint)."""
    state = policy_dir / STATE_FILE
    if not (policy_dir / ADAPTER_DIR).is_dir() or not state.is_file():
        return None
    base = json.loads(state.read_text()).get("lora_base")
    return Path(base) if base else None


def prepare(loaded: LoadedPolicy, config: TrainConfig) -> tuple[Any, Path]:
    """The peft model to train and its base folder: the checkpoint's adapters over their base when it is a
    LoRA checkpoint, else fresh adapters over the loaded (full) model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base_dir = lora_base_of(loaded.path)
    if base_dir is not None:
        if not (base_dir / "config.json").is_file():
            raise TrainingError(
                f"LoRA checkpoint {loaded.path} names base {base_dir}, which is gone: restore it or start from "
                "the merged folder with fresh adapters (copy it without adapter/)"
            )
        base = load_policy(base_dir).model
        with MODEL_BUILD:  # transformers swaps process-wide state while it builds (clawpipe/modelbuild.py)
            model = PeftModel.from_pretrained(base, loaded.path / ADAPTER_DIR, is_trainable=True)
        rank = getattr(model.peft_config["default"], "r", None)
        if rank != config.lora_rank:
            log.warning(
                "adapters in %s have rank %s; lora_rank = %d applies to fresh adapters only",
                loaded.path,
                rank,
                config.lora_rank,
            )
        return model, base_dir
    lcfg = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(loaded.model, lcfg), loaded.path


def merged_copy(peft_model: Any) -> Any:
    """A plain HF model with the adapters folded into the weights (the trained model stays as it is)."""
    return copy.deepcopy(peft_model).merge_and_unload()


def save_adapter(peft_model: Any, folder: Path) -> None:
    peft_model.save_pretrained(folder / ADAPTER_DIR)
