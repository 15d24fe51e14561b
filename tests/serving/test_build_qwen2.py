"""build_qwen2: the one way a Qwen2-shaped model is built from a shape (the default policy, the training tests,
the benches and the GPU check all use it)."""

from __future__ import annotations

from pathlib import Path

import torch

from clawpipe.serving import policy

SHAPE = {"hidden": 32, "intermediate": 48, "layers": 2, "heads": 4, "kv_heads": 2}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_qwen2_is_shaped_as_asked_and_the_same_for_a_seed() -> None:
    model = policy.build_qwen2(**SHAPE, vocab=40, max_positions=256, seed=5)
    cfg = model.config
    got = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads)
    assert got == (32, 48, 2, 4) and (cfg.num_key_value_heads, cfg.vocab_size) == (2, 40)
    assert cfg.max_position_embeddings == 256 and cfg.model_type == "qwen2"
    assert next(model.parameters()).dtype == torch.float32
    assert _same_weights(model, policy.build_qwen2(**SHAPE, vocab=40, max_positions=256, seed=5))
    assert not _same_weights(model, policy.build_qwen2(**SHAPE, vocab=40, max_positions=256, seed=6))
    tied = policy.build_qwen2(**SHAPE, vocab=40, tie_embeddings=True, seed=5)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def test_init_policy_saves_the_model_build_qwen2_builds(tmp_path: Path) -> None:
    folder = policy.init_policy(tmp_path / "p", size="tiny", seed=3)
    saved = policy.load_model(folder, "cpu")
    tok = policy.load_tokenizer(folder)
    pad, eos = tok.convert_tokens_to_ids(policy.ENDOFTEXT), tok.convert_tokens_to_ids(policy.IM_END)
    special = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    built = policy.build_qwen2(**policy.SIZES["tiny"], vocab=len(tok), seed=3, **special)
    assert _same_weights(saved, built)
