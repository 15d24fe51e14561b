"""Fixtures of the serving tests: the tiny default policy, a scripted (imprinted) policy that answers one
conversation with a tool call and the follow-up with text, and one engine server shared by the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ADMIN = "test-admin-token"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the number",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer"}},
                "required": ["number"],
            },
        },
    }
]
USER = "Guess my number."
CALL_TEXT = '<tool_call>{"name": "guess", "arguments": {"number": 42}}</tool_call><|im_end|>'
FINAL_TEXT = "You got it: 42."
FIRST_TURN: list[dict[str, Any]] = [{"role": "user", "content": USER}]
SECOND_TURN: list[dict[str, Any]] = [
    *FIRST_TURN,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "guess", "arguments": '{"number": 42}'}}],
    },
    {"role": "tool", "content": "correct"},
]


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from clawpipe.serving.policy import init_policy

    return init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def scripted_dir(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy imprinted to answer FIRST_TURN with a guess(42) call and SECOND_TURN with FINAL_TEXT."""
    from clawpipe.serving.policy import imprint_policy, load_tokenizer

    tok = load_tokenizer(policy_dir)

    def render(messages: list[dict[str, Any]]) -> list[int]:
        return tok.apply_chat_template(
            messages, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
        )

    examples = [
        (render(FIRST_TURN), tok.encode(CALL_TEXT, add_special_tokens=False)),
        (render(SECOND_TURN), tok.encode(FINAL_TEXT + "<|im_end|>", add_special_tokens=False)),
    ]
    return imprint_policy(policy_dir, tmp_path_factory.mktemp("policy") / "scripted", examples)


@pytest.fixture(scope="session")
def server(scripted_dir: Path) -> Iterator[Any]:
    """The engine serving the scripted policy on an ephemeral port (context 4096 to make overflow cheap)."""
    from clawpipe.serving.server import start_server

    handle = start_server(
        scripted_dir, device="cpu", admin_token=ADMIN, max_model_len=4096, served_name="tiny", max_batch=32
    )
    yield handle
    handle.stop()
