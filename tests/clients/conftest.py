"""Fixtures of the client-library tests: a tiny policy imprinted to play one tool round trip, the engine
serving it, the capture proxy in front of it, and a `route` per way a client reaches the model (the engine
directly; the proxy with the rollout key in the URL, as API key, or as bearer token).

The guessing game: the user says USER, the policy calls ``guess(42)``, the client sends the tool's answer
"correct", the policy answers FINAL_TEXT. Every client here sends the tool as given (one rendering), except
the Agents SDK, which builds a strict JSON schema from the function's signature (another); the imprint covers
both renderings of both turns; a client that rendered the tool otherwise would get other text and fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# Set before litellm or the Agents SDK is imported anywhere: no fetch of litellm's price list, no trace export.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

SECRET = b"clients-secret"
ADMIN = "clients-admin"
MODEL = "tiny"
USER = "Guess my number."
TOOL_RESULT = "correct"
FINAL_TEXT = "You got it: 42."
CALL_TEXT = '<tool_call>{"name": "guess", "arguments": {"number": 42}}</tool_call><|im_end|>'
DESCRIPTION = "Guess the number."
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"number": {"type": "integer"}},
    "required": ["number"],
}
# The tool in each API's own shape.
CHAT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "guess", "description": DESCRIPTION, "parameters": PARAMETERS},
}
RESPONSES_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "guess",
    "description": DESCRIPTION,
    "parameters": PARAMETERS,
}
ANTHROPIC_TOOL: dict[str, Any] = {"name": "guess", "description": DESCRIPTION, "input_schema": PARAMETERS}

# The renderings the imprint sees: the tool as the tests give it, and as the Agents SDK derives it from
# `def guess(number: int)` with its docstring (a strict schema, keys in pydantic's order).
_STRICT_PARAMETERS: dict[str, Any] = {
    "properties": {"number": {"title": "Number", "type": "integer"}},
    "required": ["number"],
    "title": "guess_args",
    "type": "object",
    "additionalProperties": False,
}
_TOOL_PARAMETERS = [PARAMETERS, _STRICT_PARAMETERS]


def _conversations() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first = [{"role": "user", "content": USER}]
    call = {"id": "c", "type": "function", "function": {"name": "guess", "arguments": '{"number": 42}'}}
    second = [
        *first,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": TOOL_RESULT},
    ]
    return first, second


@pytest.fixture(scope="session")
def guesser_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy imprinted to call guess(42) after USER and to answer FINAL_TEXT after the tool's result."""
    from clawpipe.serving.policy import imprint_policy, init_policy, load_tokenizer

    base = init_policy(tmp_path_factory.mktemp("policy") / "tiny", size="tiny", seed=0)
    tok = load_tokenizer(base)
    call = tok.encode(CALL_TEXT, add_special_tokens=False)
    final = tok.encode(FINAL_TEXT + "<|im_end|>", add_special_tokens=False)
    examples = []
    for parameters in _TOOL_PARAMETERS:
        tools = [
            {"type": "function", "function": {"name": "guess", "description": DESCRIPTION, "parameters": parameters}}
        ]
        for messages, completion in zip(_conversations(), (call, final), strict=True):
            prompt = tok.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
            )
            examples.append((prompt, completion))
    return imprint_policy(base, tmp_path_factory.mktemp("policy") / "guesser", examples)


@pytest.fixture(scope="session")
def engine(guesser_dir: Path) -> Iterator[Any]:
    from clawpipe.serving.server import start_server

    handle = start_server(
        guesser_dir, device="cpu", admin_token=ADMIN, max_model_len=4096, served_name=MODEL, max_batch=16
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def proxy(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from clawpipe.proxy import ProxyServer

    captures = tmp_path_factory.mktemp("captures")
    server = ProxyServer(upstreams=[engine.url], capture_dir=captures, secret=SECRET, admin_token=ADMIN)
    server.start()
    yield server
    server.stop(drain_timeout_s=5)


@pytest.fixture(scope="session")
def lake_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lake")


@dataclass
class Route:
    """How a client reaches the model: `direct` (the engine) or through the proxy with the rollout key in the
    URL (`url`), as the API key (`key`: x-api-key for Anthropic clients, bearer for OpenAI ones), or as a
    bearer token (`bearer`)."""

    name: str
    engine_url: str
    proxy: Any
    capture_dir: Path
    lake_dir: Path
    rollout_id: str = field(default_factory=lambda: f"c-{uuid.uuid4().hex[:12]}")

    @property
    def key(self) -> str:
        from clawpipe.keys import mint_key

        return mint_key(SECRET, run_id="clients", iteration=0, rollout_id=self.rollout_id)

    @property
    def proxied(self) -> bool:
        return self.name != "direct"

    def _root(self) -> str:
        if self.name == "direct":
            return self.engine_url
        if self.name == "url":
            return f"{self.proxy.url}/r/{self.key}"
        return self.proxy.url

    def openai_base(self) -> str:
        """Base URL for OpenAI clients (ends in /v1)."""
        return f"{self._root()}/v1"

    def openai_key(self) -> str:
        """API key for OpenAI clients, which send it as a bearer token."""
        return self.key if self.name in ("key", "bearer") else "unused"

    def anthropic_base(self) -> str:
        """Base URL for Anthropic clients (they append /v1/messages)."""
        return self._root()

    def anthropic_key(self) -> str:
        """x-api-key for Anthropic clients."""
        return self.key if self.name == "key" else "unused"

    def anthropic_headers(self) -> dict[str, str]:
        """Extra headers for Anthropic clients: the key as a bearer token on the `bearer` route."""
        return {"authorization": f"Bearer {self.key}"} if self.name == "bearer" else {}

    def landed_calls(self) -> list[dict[str, Any]]:
        """This route's calls in the lake's model_calls after landing everything the proxy has captured."""
        from clawpipe.lake import land, run_sql

        land(self.capture_dir, self.lake_dir)
        return run_sql(
            self.lake_dir,
            "select seq, api, stream, status, http_status, token_source, prompt_token_ids, completion_token_ids, "
            "tool_calls, finish_reason, request "
            "from model_calls where rollout_id = $r order by seq, choice_index",
            {"r": self.rollout_id},
        ).to_pylist()

    def check_captured(self, apis: list[tuple[str, bool]]) -> list[dict[str, Any]]:
        """Through the proxy: each client call, as (api, stream) in order, landed with prompt and completion
        token ids from the engine. Direct: nothing of this rollout was captured."""
        rows = self.landed_calls()
        if not self.proxied:
            assert rows == []
            return rows
        assert [(r["api"], r["stream"]) for r in rows] == apis
        for r in rows:
            assert r["status"] == "ok" and r["token_source"] == "upstream", r
            assert r["prompt_token_ids"] and r["completion_token_ids"], r
        return rows


# OpenAI clients send their API key as a bearer token, so `key` is their bearer route too.
OPENAI_ROUTES = ["direct", "url", "key"]
ANTHROPIC_ROUTES = ["direct", "url", "key", "bearer"]


@pytest.fixture
def route(request: pytest.FixtureRequest, engine: Any, proxy: Any, lake_dir: Path) -> Route:
    return Route(request.param, engine.url, proxy, Path(proxy.config.capture_dir), lake_dir)
