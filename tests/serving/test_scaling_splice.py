"""Splicing the sampled ids of a long history grows with its text: the rendered prompt is cut at the turns'
placeholders in one pass, not once per turn. Counted in characters the cut reads and copies (no timing: the
machines are shared), at two history lengths, through the tiny policy's real tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clawpipe.serving.splice import render_open, render_spliced


class CountingText(str):
    """A rendered prompt that counts the characters its searches read and its cuts copy."""

    touched = 0

    def __str__(self) -> str:
        return self  # str() of the rendered text keeps counting

    def _add(self, n: int) -> None:
        CountingText.touched += n

    def find(self, sub: str, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        at = super().find(sub, start, end)
        begin = start or 0
        self._add(at + len(sub) - begin if at >= 0 else len(self) - begin)
        return at

    def count(self, sub: str, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        self._add(len(self))
        return super().count(sub, start, end)

    def partition(self, sep: str) -> tuple[str, str, str]:  # type: ignore[override]
        self._add(len(self))
        before, got, after = super().partition(sep)
        return CountingText(before), got, CountingText(after)

    def __contains__(self, sub: object) -> bool:
        self._add(len(self))
        return super().__contains__(sub)  # type: ignore[operator]

    def __getitem__(self, key: Any) -> str:
        out = super().__getitem__(key)
        self._add(len(out))
        return out


class CountingTokenizer:
    """The real tokenizer, its rendered chat text handed back as a :class:`CountingText`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return CountingText(self._tok.apply_chat_template(*args, **kwargs))


@pytest.fixture(scope="module")
def tokenizer(policy_dir: Path) -> Any:
    from clawpipe.serving.policy import load_tokenizer

    return load_tokenizer(policy_dir)


def history(tok: Any, turns: int) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """A conversation of ``turns`` user and assistant turns, each answer found with its sampled ids."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent."}]
    found: dict[int, list[int]] = {}
    for t in range(turns):
        messages.append({"role": "user", "content": f"step {t}: run the tests and say what failed"})
        answer = f"step {t} ran; test_{t} failed"
        found[len(messages)] = list(tok.encode(answer + "<|im_end|>", add_special_tokens=False))
        messages.append({"role": "assistant", "content": answer})
    return messages, found


def test_cutting_a_long_history_at_its_turns_reads_its_text_a_bounded_number_of_times(tokenizer: Any) -> None:
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    per_char = {}
    for turns in (100, 200):
        messages, found = history(tokenizer, turns)
        CountingText.touched = 0
        counted = render_open(CountingTokenizer(tokenizer), messages, None, found, eos)
        touched = CountingText.touched
        plain = render_spliced(tokenizer, messages, None, found, eos)
        assert counted is not None and plain is not None
        assert list(counted) == plain[0]  # the same prompt
        assert counted.spliced == plain[1] == sum(len(ids) for ids in found.values())
        assert counted.spliced_turns == turns
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        per_char[turns] = touched / len(text)
    # each character is read a few times whatever the length (a cut per turn read the rest of the text per turn)
    assert max(per_char.values()) < 4, per_char
    assert per_char[200] / per_char[100] < 1.15, per_char


def test_a_placeholder_rendered_twice_is_not_spliced(tokenizer: Any) -> None:
    """A template that repeats a turn (here: the last assistant message echoed into the system prompt) cannot
    be cut into pieces around each turn once: the prompt is rendered as usual."""

    class Echoing(CountingTokenizer):
        def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            last = [m for m in messages if m["role"] == "assistant"][-1]
            messages = [{"role": "system", "content": f"Earlier you said: {last['content']}"}, *messages[1:]]
            return self._tok.apply_chat_template(messages, *args, **kwargs)

    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    messages, found = history(tokenizer, 3)
    assert render_open(Echoing(tokenizer), messages, None, found, eos) is None
    assert render_open(CountingTokenizer(tokenizer), messages, None, found, eos) is not None
