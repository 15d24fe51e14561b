"""LoRA training: only the adapters learn; the checkpoint's merged HF folder equals base + adapters, the
adapters are saved for run-time loading, and the next step resumes them with their optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clawpipe.serving.policy import init_policy
from clawpipe.train.checkpoint import load_policy
from clawpipe.train.config import make_config
from clawpipe.train.step import train_step
from tests.train.test_step import RUN, write_lake

pytestmark = [pytest.mark.slow]


def test_lora_step_trains_adapters_and_publishes_a_merged_folder(home: Path, tmp_path: Path):
    from peft import PeftModel

    torch.set_num_threads(1)
    base = init_policy(tmp_path / "v0", size="tiny", seed=0)
    for it in (0, 1):
        write_lake(home / "lake", base, iteration=it)
    cfg = make_config(device="cpu", lora_rank=4, learning_rate=1e-2, epochs=2)
    first = train_step(RUN, 0, lake_root=home / "lake", policy_dir=base, out_dir=tmp_path / "out", config=cfg)
    ckpt = first.checkpoint_dir
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["lora_base"] == str(base.resolve())
    assert (ckpt / "adapter" / "adapter_config.json").is_file()

    before = load_policy(base).model.state_dict()
    merged = load_policy(ckpt).model
    after = merged.state_dict()
    targeted = [k for k in after if any(f".{m}." in k for m in cfg.lora_target_modules)]
    assert targeted and any(not torch.equal(after[k], before[k]) for k in targeted)  # adapters learned
    assert all(torch.equal(after[k], before[k]) for k in after if k not in targeted)  # the rest is frozen
    # the optimizer held adapter state only (A and B per targeted layer)
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(opt["state"]) == 2 * len([k for k in targeted if k.endswith(".weight")])

    # the merged folder computes what base + adapters compute
    adapted = PeftModel.from_pretrained(load_policy(base).model, ckpt / "adapter").eval()
    ids = torch.randint(1, 500, (1, 40))
    with torch.no_grad():
        diff = (merged.eval()(input_ids=ids).logits - adapted(input_ids=ids).logits).abs().max()
    assert float(diff) < 1e-5

    second = train_step(RUN, 1, lake_root=home / "lake", policy_dir=ckpt, out_dir=tmp_path / "out", config=cfg)
    assert second.policy_version == 2
    assert json.loads((second.checkpoint_dir / "trainer_state.json").read_text())["lora_base"] == str(base.resolve())
    resumed = torch.load(second.checkpoint_dir / "optimizer.pt", weights_only=True)
    steps = {float(v["step"]) for v in resumed["state"].values()}
    assert steps == {4.0}  # 2 epochs in each step: the adapters' AdamW state went on from the first step


def test_lora_with_several_ranks_is_refused():
    from clawpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="nproc = 1"):
        make_config(lora_rank=8, nproc=2)
