"""Policies brought from elsewhere through the whole loop: served by the engine, their calls landed in a real lake
and built into trees, a training step on them, the checkpoint published to the running engine with
`/admin/reload`, and served again with the logprobs of the new weights. And the folders the trainer refuses.

The folders are built from the tiny default policy the way other tools save them
(tests/serving/test_brought_folders.py `brought`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from clawpipe import tables
from clawpipe.errors import TrainingError
from clawpipe.schemas import MODEL_CALLS, ROLLOUTS
from clawpipe.serving.policy import compute_logprobs, init_policy, load_model, load_tokenizer
from clawpipe.serving.server import start_server
from clawpipe.train.checkpoint import load_policy, publish
from clawpipe.train.config import make_config
from clawpipe.train.step import train_step
from clawpipe.trees.reconstruct import build_iteration
from tests.serving.test_brought_folders import brought, edit_json

RUN = "run-brought"
ADMIN = "brought-admin"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)


def chat(url: str, rollout: str, messages: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 6, "logprobs": True, "seed": seed, "temperature": 1.0},
        headers={"x-clawpipe-rollout": rollout},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def capture(url: str, lake: Path, groups: int = 2, samples: int = 4) -> int:
    """Two-turn conversations of groups x samples rollouts against the engine, landed as model_calls and
    rollouts of iteration 0 (the engine's own ids and logprobs, as the proxy lands them); returns the calls."""
    calls, rollouts = [], []
    for g in range(groups):
        for s in range(samples):
            rid = f"g{g}-r{s}"
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Guess my number, round {g}."}]
            for turn in range(2):
                j = chat(url, rid, messages, seed=100 * g + 10 * s + turn)
                choice = j["choices"][0]
                calls.append(
                    dict(
                        call_id=f"{rid}-c{turn}", choice_index=0, run_id=RUN, iteration=0, rollout_id=rid, seq=turn,
                        status="ok", token_source="upstream", policy_version=j["policy_version"],
                        prompt_token_ids=j["prompt_token_ids"], completion_token_ids=choice["token_ids"],
                        completion_logprobs=[e["logprob"] for e in choice["logprobs"]["content"]],
                        spliced_tokens=j.get("spliced_tokens", 0),
                    )
                )  # fmt: skip
                messages += [{"role": "assistant", "content": choice["message"]["content"] or ""}]
                messages += [{"role": "user", "content": "Higher."}]
            rollouts.append(
                dict(rollout_id=rid, run_id=RUN, iteration=0, group_id=f"g{g}", harness="chat-loop",
                     reward=(s % 3) / 2, status="succeeded")
            )  # fmt: skip
    tables.replace_partition(lake, "model_calls", RUN, 0, pa.Table.from_pylist(calls, schema=MODEL_CALLS))
    tables.replace_partition(lake, "rollouts", RUN, 0, pa.Table.from_pylist(rollouts, schema=ROLLOUTS))
    build_iteration(lake, RUN, 0)
    return len(calls)


LOOPS: dict[str, dict[str, Any]] = {
    "sharded-bf16-tied-template-in-config": {
        "shard_kb": 120, "dtype": torch.bfloat16, "tied": True, "template_in_config": True, "eos_ids": [2, 0],
    },
    "pickled-fp16-added-tokens-padding-rows": {
        "pickled": True, "dtype": torch.float16, "added_tokens": ["<think>", "</think>"], "vocab_size": 544,
    },
    "llama-bos-tokenizer-transformers-4-config": {"llama": True, "bos": True, "legacy_config": True},
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOOPS))
def test_brought_policy_serve_train_publish_serve(home: Path, tmp_path: Path, base: Path, name: str) -> None:
    folder = brought(base, tmp_path / "models" / name, **LOOPS[name])
    link = tmp_path / "models" / "policy"
    os.symlink(folder, link)  # pointed at through a link, as `policy = "<dir>"` may be
    ckpts = tmp_path / "ckpt"
    with start_server(link, device="cpu", admin_token=ADMIN, max_model_len=2048, reload_roots=[str(ckpts)]) as h:
        lake = tmp_path / "lake"
        n_calls = capture(h.url, lake)
        result = train_step(
            RUN, 0, lake_root=lake, policy_dir=link, out_dir=ckpts, config=make_config(learning_rate=1e-2)
        )
        m = result.metrics
        assert m["load/calls"] == n_calls and m["sequences"] == n_calls  # every served call trained
        assert m["logprob/max_abs_diff_current"] < 1e-4  # the trainer scores them as the engine sampled them
        assert all(math.isfinite(v) for v in m.values())
        ckpt = result.checkpoint_dir
        trained = load_policy(ckpt)
        assert trained.tokenizer is not None and len(trained.tokenizer) == len(load_tokenizer(folder))
        if LOOPS[name].get("tied"):
            model = trained.model
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == LOOPS[name].get(
            "eos_ids", 2
        )
        reply = publish(h.url, ckpt, result.policy_version, token=ADMIN, timeout_s=60)
        assert reply["policy_version"] == 1
        after = chat(h.url, "after", [{"role": "user", "content": "Guess my number, round 0."}], seed=7)
        assert after["policy_version"] == 1
        served = [e["logprob"] for e in after["choices"][0]["logprobs"]["content"]]
        ref = compute_logprobs(
            load_model(ckpt, "cpu", torch.float32), after["prompt_token_ids"], after["choices"][0]["token_ids"]
        )
        assert max(abs(a - b) for a, b in zip(served, ref, strict=True)) < 1e-4  # the new weights are served


# ---------------------------------------------------------------- folders the trainer refuses


def test_trainer_refuses_a_pickle_carrying_code(tmp_path: Path, base: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    folder = brought(base, tmp_path / "evil", pickled=True)
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(TrainingError, match=r"pytorch_model\.bin does not load as weights \(.*system.*weights-only"):
        load_policy(folder)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"auto_map": {"AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}}, r"auto_map .*never runs code"),
        ({"model_type": "frobnicator"}, r"model_type 'frobnicator'"),
        ({"vocab_size": 2**31}, r"describes [\d,]+ parameters but its weight files hold"),
    ],
    ids=["auto_map", "unknown-model-type", "absurd-vocab"],
)
def test_trainer_refuses_foreign_code_and_absurd_sizes(tmp_path: Path, base: Path, change: dict, match: str) -> None:
    folder = brought(base, tmp_path / "odd")
    edit_json(folder / "config.json", **change)
    with pytest.raises(TrainingError, match=match):
        load_policy(folder)


def test_trainer_refuses_missing_tensors(tmp_path: Path, base: Path) -> None:
    """A tensor missing from the weights would be trained from random values: refused, named (the shard index
    still listing it, as a tool that dropped a tensor while resharding leaves it)."""
    folder = brought(base, tmp_path / "holey")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainingError, match=r"describes [\d,]+ parameters but its weight files hold"):
        load_policy(folder)


def test_trainer_refuses_shard_not_there_yet(tmp_path: Path, base: Path) -> None:
    folder = brought(base, tmp_path / "partial", shard_kb=120)
    last = sorted(folder.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(TrainingError, match=rf"lists {last.name}, which is not there"):
        load_policy(folder)


def test_trainer_refuses_tokenizer_ids_past_the_embedding(tmp_path: Path, base: Path) -> None:
    folder = brought(base, tmp_path / "small")
    tok = load_tokenizer(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    tok.save_pretrained(folder)
    with pytest.raises(TrainingError, match=r"513 ids but the model embeds only vocab_size 512"):
        load_policy(folder)


def other_decoder(arch: str) -> Any:
    """A small random decoder of another family than the Qwen2 the default policy is (tests.train.helpers VOCAB)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from tests.train.helpers import VOCAB

    torch.manual_seed(0)
    if arch == "gpt2":  # learned positions, its own mask handling, dropout 0.1 by default
        config: Any = GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=32, n_layer=2, n_head=4, eos_token_id=1)
    else:
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512,
        )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


@pytest.mark.parametrize(
    ("arch", "attention", "checkpointing"),
    [("llama", "blocks", False), ("llama", "blocks", True), ("llama", "dense", False), ("gpt2", "blocks", False)],
)
def test_other_decoders_packed_trees_equal_flat(arch: str, attention: str, checkpointing: bool) -> None:
    """Llama's decoder builds its own mask from what it is given and GPT-2's reads it as a tensor (Qwen2's passes
    a mask dict through): the packed tree forward still attends along the tree, without dropout (GPT-2 has 0.1),
    so loss and gradients equal the flat ones."""
    from tests.train.helpers import random_group_trees
    from tests.train.test_equivalence import assert_close, packed_and_flat

    model = other_decoder(arch)
    trees, infos = random_group_trees(1, versions=(3,))
    cfg = make_config(attention=attention, activation_checkpointing=checkpointing, max_tokens_per_micro_batch=256)
    _, sums, ref, packed, flat = packed_and_flat(model, trees, infos, cfg)
    assert_close(sums, ref, packed, flat)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_distributed_shards_each_decoder_layer_of_other_families(arch: str) -> None:
    """FSDP2 wraps one unit per decoder layer: found under whatever name the family gives its list (GPT-2: h)."""
    from clawpipe.train.distributed import decoder_layers

    model = other_decoder(arch)
    layers = decoder_layers(model)
    assert len(layers) == 2 and layers is (model.transformer.h if arch == "gpt2" else model.model.layers)


@pytest.mark.slow
def test_gpt2_shaped_policy_trains_in_two_ranks(home: Path, tmp_path: Path, base: Path) -> None:
    """`clawpipe train --nproc 2` on a GPT-2-shaped folder: FSDP2 finds its layers (``h``), the ranks train the
    trees and the exported checkpoint loads as the same architecture."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, GPT2Config

    from tests.train.test_step import RUN as STEP_RUN
    from tests.train.test_step import write_lake

    folder = brought(base, tmp_path / "gpt2")
    for f in ("model.safetensors", "config.json", "generation_config.json"):
        (folder / f).unlink()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=256, n_embd=32, n_layer=2, n_head=4, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_lake(home / "lake", folder, iteration=0)
    (tmp_path / "train.toml").write_text('device = "cpu"\n')
    cmd = [sys.executable, "-m", "clawpipe", "train", "--run", STEP_RUN, "--iteration", "0", "--nproc", "2"]
    cmd += ["--config", str(tmp_path / "train.toml"), "--policy", str(folder), "--out", str(tmp_path / "out")]
    cmd += ["--no-track", "--metrics-out", str(tmp_path / "m.json")]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = json.loads((tmp_path / "m.json").read_text())
    assert done["metrics"]["dist/world_size"] == 2.0
    assert done["metrics"]["logprob/max_abs_diff_current"] < 1e-4
    trained = load_policy(done["checkpoint"])
    assert type(trained.model).__name__ == "GPT2LMHeadModel"
