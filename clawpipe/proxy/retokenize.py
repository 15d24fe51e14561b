"""Fallback token ids for calls whose upstream returned none (``token_source="retokenized"``).

Uses the served model's ``tokenizer.json`` (the ``tokenizers`` library) and its chat template (jinja2, as
``transformers`` renders it) — never ``transformers`` itself, which must stay out of the proxy. Runs in a
worker thread before the capture write, so the event loop never tokenizes. Re-encoded ids are an
approximation of what the sampler saw (docs/ARCHITECTURE.md, pitfalls: retokenization); the header marks them so
the lake and the trainer can keep them apart.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from clawpipe.apis import json_events, reassemble, request_messages, text_of
from clawpipe.capture import Retokenized, RetokenizedChoice
from clawpipe.errors import ConfigError

log = logging.getLogger(__name__)


def _raise(message: str) -> None:
    raise ValueError(message)


class Retokenizer:
    """Tokenizer + chat template of one model directory."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(model_dir)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"no tokenizer.json in {d}: pass the served model's directory as --tokenizer")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        # a second copy that spells special-token strings as text, as the engine encodes an open turn's prefill
        # (a flag on one shared tokenizer would race between the threads retokenizing)
        self._plain = Tokenizer.from_file(str(tok_file))
        self._plain.encode_special_tokens = True
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if not template:
            raise ConfigError(f"no chat template in {d} (tokenizer_config.json chat_template or chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template)
        self.eos_token = _token_text(config.get("eos_token")) or ""
        self.bos_token = _token_text(config.get("bos_token")) or ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, *, generation_prompt: bool) -> str:
        return self.template.render(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
        )

    def open_turn(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        """The ids of ``messages`` with the final (assistant) one left open, as the engine renders a prefill:
        the template's text up to where the final message's body goes, then that body encoded on its own."""
        body = messages[-1].get("content")
        body = body if isinstance(body, str) else text_of(body)
        mark = f"\u27e6clawpipe-open-{secrets.token_hex(8)}\u27e7"
        staged = [*messages[:-1], {**messages[-1], "content": mark}]
        text = self.render(staged, tools, generation_prompt=False)
        head, found, _ = text.partition(mark)
        if not found:  # a template that does not render the body as given: the prefill closes its turn
            return self.encode(self.render(messages, tools, generation_prompt=False))
        return self.encode(head) + self._plain.encode(body, add_special_tokens=False).ids

    def retokenize(self, api: str, request: bytes, response: bytes, stream: bool) -> Retokenized:
        """The prompt's and each choice's ids for one captured call, encoded here."""
        req = json.loads(request)
        choices = _completions(api, response, stream)
        if api == "completions":
            prompt = req.get("prompt", "")
            prompt_ids = self.encode(prompt if isinstance(prompt, str) else "".join(map(str, prompt)))
            return Retokenized(prompt_ids, [RetokenizedChoice(self.encode(t)) for t, _ in choices])
        messages, tools = request_messages(api, req)
        ending = prompt_ending(api, req, messages)
        if ending == "continue":
            prompt_ids = self.open_turn(messages, tools)
        else:
            prompt_ids = self.encode(self.render(messages, tools, generation_prompt=ending == "generate"))
        out = []
        for text, tool_calls in choices:
            body = text
            for call in tool_calls:
                body += "<tool_call>" + json.dumps(call, ensure_ascii=False) + "</tool_call>"
            out.append(RetokenizedChoice(self.encode(body + self.eos_token)))
        return Retokenized(prompt_ids, out)


def prompt_ending(api: str, req: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """How the engine ends a request's prompt: "continue" (an open final assistant turn: an Anthropic prefill,
    or chat's ``continue_final_message``), "generate" (a new assistant turn) or "none" (chat's
    ``add_generation_prompt: false``)."""
    last_is_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    if api == "messages":
        return "continue" if last_is_assistant else "generate"
    if api == "chat":
        if req.get("continue_final_message") is True and last_is_assistant:
            return "continue"
        if req.get("add_generation_prompt") is False:
            return "none"
    return "generate"


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _completions(api: str, response: bytes, stream: bool) -> list[tuple[str, list[dict[str, Any]]]]:
    """Per choice: (text, tool calls as {"name", "arguments"}); a stream is read as the body it reassembles to."""
    obj = reassemble(api, json_events(response)) if stream else json.loads(response)
    if api == "chat":
        out = []
        for c in obj.get("choices", []):
            msg = c.get("message") or {}
            calls = [
                {"name": t["function"]["name"], "arguments": _json_or_str(t["function"].get("arguments"))}
                for t in msg.get("tool_calls") or []
            ]
            out.append((msg.get("content") or "", calls))
        return out
    if api == "completions":
        return [(c.get("text", ""), []) for c in obj.get("choices", [])]
    if api == "messages":
        text = "".join(b.get("text", "") for b in obj.get("content", []) if b.get("type") == "text")
        calls = [
            {"name": b["name"], "arguments": b.get("input", {})}
            for b in obj.get("content", [])
            if b.get("type") == "tool_use"
        ]
        return [(text, calls)]
    return [_responses_output(obj)]


def _responses_output(obj: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    text, calls = "", []
    for item in obj.get("output", []):
        if item.get("type") == "message":
            text += text_of(item.get("content"))
        elif item.get("type") == "function_call":
            calls.append({"name": item.get("name"), "arguments": _json_or_str(item.get("arguments"))})
    return text, calls


def _json_or_str(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value else {}
        except ValueError:
            return value
    return value
