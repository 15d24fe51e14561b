"""The default policy: deterministic, loadable exactly, a ChatML template with tools, digits from a random model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from clawpipe.serving import policy
from clawpipe.serving.text import TokenTable, parse_tool_calls


def _digest(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


def test_init_policy_is_deterministic_for_a_seed_and_tiny_is_about_0_2m_params(
    tmp_path: Path, policy_dir: Path
) -> None:
    again = policy.init_policy(tmp_path / "again", size="tiny", seed=0)
    other = policy.init_policy(tmp_path / "other", size="tiny", seed=1)
    assert _digest(again) == _digest(policy_dir)
    assert _digest(other)["model.safetensors"] != _digest(policy_dir)["model.safetensors"]
    model = policy.load_model(policy_dir, "cpu")
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 300_000
    assert model.config.model_type == "qwen2"


def test_small_policy_has_a_few_million_params(tmp_path: Path) -> None:
    model = policy.load_model(policy.init_policy(tmp_path / "small", size="small"), "cpu")
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 8_000_000


def test_tokenizer_round_trips_and_keeps_special_tokens(policy_dir: Path) -> None:
    tok = policy.load_tokenizer(policy_dir)
    assert len(tok) == policy.VOCAB_SIZE
    assert tok.eos_token == policy.IM_END and tok.padding_side == "left"
    text = 'Answer: 1234 <tool_call>{"name": "shell", "arguments": {"command": "ls -la"}}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids(policy.TOOL_CALL_OPEN) in ids
    # the table's bytes reassemble exactly what the tokenizer decodes, multi-byte characters included
    table = TokenTable(tok)
    uni = tok.encode("naïve → 5", add_special_tokens=False)
    assert bytes(b for t in uni for b in table.entry(t)[1]).decode() == "naïve → 5"


def test_chat_template_renders_roles_tools_and_tool_calls(policy_dir: Path) -> None:
    tok = policy.load_tokenizer(policy_dir)
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "shell", "arguments": {"c": "ls"}}}]},
        {"role": "tool", "content": "a.txt"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tools[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "shell", "arguments": {"c": "ls"}}</tool_call><|im_end|>\n' in text
    )
    assert "<|im_start|>tool\na.txt<|im_end|>\n<|im_start|>user" not in text
    assert text.endswith("<|im_start|>tool\na.txt<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nlist files<|im_end|>\n"


def test_a_fresh_random_policy_sometimes_emits_digits(policy_dir: Path) -> None:
    tok = policy.load_tokenizer(policy_dir)
    model = policy.load_model(policy_dir, "cpu")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Guess a number between 1 and 100."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt] * 16)
    for _ in range(32):
        logits = model(input_ids=ids).logits[:, -1]
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt], 1)
    texts = tok.batch_decode(ids[:, len(prompt) :])
    assert sum(any(ch.isdigit() for ch in t) for t in texts) >= 2


def test_parse_tool_calls_splits_text_and_calls() -> None:
    text = 'Let me check. <tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("shell", {"command": "ls"})]
    # string arguments, a missing closing tag at the end, and two calls
    content, calls = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b", "arguments": {}}'
    )
    assert content == "" and [c.name for c in calls] == ["a", "b"] and json.loads(calls[0].arguments) == {"x": 1}
    # malformed JSON or no name: stays text
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert parse_tool_calls(bad) == (bad, [])
