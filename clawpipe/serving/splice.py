"""The model's own ids carried into the next turn.

Harnesses send earlier replies back as text or as structured tool calls. Re-encoding them through the chat
template rarely gives the ids the sampler produced (byte-level BPE merges differ, tool-call JSON is
re-serialised), so the next prompt would hold a context the model never saw. The engine therefore keeps, per
rollout (named by the proxy's ``x-clawpipe-rollout`` header), the ids of its recent completions keyed by the
exact text and tool-call ids it answered with. When a request's history holds an assistant turn that matches
one exactly, the prompt carries the sampled ids for that turn's body: the template is rendered with a
placeholder in place of the turn's content (its tool calls dropped, since the sampled ids hold them), the text
is cut around the placeholders, each piece is encoded, and the sampled ids go between. A turn the harness
changed does not match and is re-encoded as before, which shows in the trees as a genuine rewrite.

A request may also end in an open assistant turn (``continue``: Anthropic's prefill, vLLM's
``continue_final_message``): the template is rendered with that turn left open and its body goes in as its own
piece, encoded alone (or the sampled ids of a cut-off completion it repeats), so the prompt ends with exactly
the prefill's ids, the boundary the model's own answers start at. The completion is remembered joined to that
prefill, as a client sends the whole turn back.

Memory is bounded: the least recently used rollouts are forgotten beyond ``max_rollouts``, and a rollout's
oldest completions beyond ``max_tokens`` ids.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

ROLLOUT_HEADER = "x-clawpipe-rollout"
# the rollout of the request being handled (set by the endpoint from the proxy's header; None without one)
REQUEST_ROLLOUT: ContextVar[str | None] = ContextVar("clawpipe_request_rollout", default=None)


# How a prompt ends after the request's messages: a new assistant turn opened by the template's generation
# prompt (the default), the final assistant message left open to be continued (Anthropic's prefill, vLLM's
# continue_final_message), or the messages as they are (vLLM's add_generation_prompt false)
Ending = Literal["generate", "continue", "closed"]


class Prompt(list[int]):
    """A rendered prompt's ids, with how many of them were spliced in from earlier completions and the rollout
    the request belongs to (None when no proxy named one). A prompt ending in an open assistant turn also
    carries that turn's text (`prefill`) and how many of the last ids are its body (`prefill_ids`; None when
    the template did not let them be told apart)."""

    def __init__(
        self,
        ids: Sequence[int] = (),
        spliced: int = 0,
        rollout: str | None = None,
        prefill: str | None = None,
        prefill_ids: int | None = None,
    ) -> None:
        super().__init__(ids)
        self.spliced = spliced
        self.rollout = rollout
        self.prefill = prefill
        self.prefill_ids = prefill_ids
        self.spliced_turns = 0  # how many earlier turns the spliced ids are the bodies of

    def turn(self, content: str, ids: Sequence[int]) -> tuple[str, list[int]] | None:
        """A completion of this prompt as the whole assistant turn a client sends back: (text, ids) with the
        open turn's prefill in front; None when the prefill's ids are not known apart from the rest."""
        if self.prefill is None:
            return content, list(ids)
        if self.prefill_ids is None:
            return None
        return self.prefill + content, self[len(self) - self.prefill_ids :] + list(ids)


def call_key(call_id: str) -> str:
    """A tool call's id without its API prefix: the engine answers ``call_X`` on Chat and Responses and
    ``toolu_X`` on Messages for the same call."""
    for prefix in ("call_", "toolu_"):
        if call_id.startswith(prefix):
            return call_id[len(prefix) :]
    return call_id


def _args(text: Any) -> Any:
    """Tool-call arguments as a value (JSON text parsed; anything else as is), so a harness that re-serialises
    the same object still matches."""
    if isinstance(text, str):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text
    return text


@dataclass
class Turn:
    """One completion as the engine answered it: content, tool calls (key, name, arguments) and sampled ids."""

    content: str
    calls: list[tuple[str, str, Any]]
    ids: array[int] = field(default_factory=lambda: array("i"))

    def index_keys(self) -> list[tuple[str, str]]:
        if self.calls:
            return [("call", key) for key, _, _ in self.calls]
        return [("text", self.content)]

    def matches(self, message: dict[str, Any]) -> bool:
        calls = message.get("tool_calls") or []
        if (message.get("content") or "") != self.content or len(calls) != len(self.calls):
            return False
        for got, (key, name, args) in zip(calls, self.calls, strict=True):
            fn = got.get("function") or {}
            same_call = call_key(str(got.get("id") or "")) == key and fn.get("name") == name
            if not same_call or _args(fn.get("arguments")) != args:
                return False
        return True


@dataclass
class _Rollout:
    turns: OrderedDict[int, Turn] = field(default_factory=OrderedDict)
    index: dict[tuple[str, str], int] = field(default_factory=dict)
    tokens: int = 0
    next_id: int = 0


class TurnMemory:
    """Per rollout, the recent completions' sampled ids by their exact text / tool-call ids (thread-safe)."""

    def __init__(self, max_rollouts: int = 256, max_tokens: int = 131072) -> None:
        self.max_rollouts = max(1, max_rollouts)
        self.max_tokens = max(1, max_tokens)
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"kept": 0, "spliced_turns": 0, "spliced_tokens": 0}

    def remember(self, rollout: str, content: str, calls: Sequence[Any], ids: Sequence[int]) -> None:
        """Keep one completion (calls: objects with id, name and arguments, as the client was told them)."""
        if not ids or len(ids) > self.max_tokens:
            return
        turn = Turn(content, [(call_key(c.id), c.name, _args(c.arguments)) for c in calls], array("i", ids))
        with self._lock:
            r = self._rollouts.get(rollout)
            if r is None:
                r = self._rollouts[rollout] = _Rollout()
                while len(self._rollouts) > self.max_rollouts:
                    self._rollouts.popitem(last=False)
            self._rollouts.move_to_end(rollout)
            tid, r.next_id = r.next_id, r.next_id + 1
            r.turns[tid] = turn
            r.tokens += len(turn.ids)
            for key in turn.index_keys():
                r.index[key] = tid  # the latest completion with this text wins
            while r.tokens > self.max_tokens:
                old_id, old = r.turns.popitem(last=False)
                r.tokens -= len(old.ids)
                for key in old.index_keys():
                    if r.index.get(key) == old_id:
                        del r.index[key]
            self.stats["kept"] += 1

    def find(self, rollout: str, messages: list[dict[str, Any]]) -> dict[int, list[int]]:
        """{message index: sampled ids} for the assistant messages the engine generated as they are."""
        found: dict[int, list[int]] = {}
        with self._lock:
            r = self._rollouts.get(rollout)
            if r is None:
                return found
            self._rollouts.move_to_end(rollout)
            for i, m in enumerate(messages):
                if m.get("role") != "assistant":
                    continue
                calls = m.get("tool_calls") or []
                key = ("call", call_key(str(calls[0].get("id") or ""))) if calls else ("text", m.get("content") or "")
                tid = r.index.get(key)
                turn = r.turns.get(tid) if tid is not None else None
                if turn is not None and turn.matches(m):
                    found[i] = turn.ids.tolist()
        return found

    def count(self, turns: int, tokens: int) -> None:
        with self._lock:
            self.stats["spliced_turns"] += turns
            self.stats["spliced_tokens"] += tokens


def render_spliced(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    found: dict[int, list[int]],
    stop_ids: set[int],
    ending: Ending = "generate",
) -> tuple[list[int], int] | None:
    """(prompt ids with the sampled ids of the `found` turns spliced in, how many ids were spliced), or None
    when the template does not render each placeholder exactly once (the caller then renders as usual).

    A turn's sampled ids end with the end-of-turn token the model chose; the template's own end-of-turn text
    right after the placeholder is then dropped, so the turn ends once, as the model ended it."""
    got = render_open(tokenizer, messages, tools, found, stop_ids, ending)
    return None if got is None else (list(got), got.spliced)


def render_open(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    found: dict[int, list[int]],
    stop_ids: set[int],
    ending: Ending = "generate",
) -> Prompt | None:
    """The prompt of `messages` ending as `ending` says, with the `found` turns' sampled ids spliced in (see
    render_spliced), or None when the template does not render each placeholder exactly once.

    With ending "continue" the final message is rendered open (transformers' continue_final_message) with a
    placeholder for its body; the body then goes in encoded alone, or as the sampled ids of the completion it
    repeats when they spell exactly its text (cut off by max_tokens; the ids of one that ended its turn would
    close the turn being continued, those of one cut at a stop string hold the stop string too)."""
    last = len(messages) - 1
    found = dict(found)
    if ending == "continue" and last in found and not _spells(tokenizer, found[last], messages[last]["content"]):
        del found[last]
    lead = f"\u27e6clawpipe-turn-{secrets.token_hex(8)}-"  # what every placeholder of this render starts with
    marks = {i: f"{lead}{i}\u27e7" for i in found}
    if ending == "continue":
        marks.setdefault(last, f"{lead}{last}\u27e7")
    staged = []
    for i, m in enumerate(messages):
        if i in marks:
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = marks[i]
        staged.append(m)
    text = str(
        tokenizer.apply_chat_template(
            staged,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=ending == "generate",
            continue_final_message=ending == "continue",
        )
    )
    order = sorted(marks)
    pieces = _cut(text, [marks[i] for i in order], lead)
    if pieces is None:
        return None
    if ending == "continue" and pieces[-1]:
        log.debug("chat template rendered text after the open final turn; not splicing")
        return None
    ids: list[int] = []
    spliced = turns = 0
    prefill_ids: int | None = None
    for k, piece in enumerate(pieces):
        if k > 0:
            i = order[k - 1]
            turn = found.get(i)
            if turn is None:  # the open final turn's text, encoded on its own
                turn = encode_prefill(tokenizer, messages[i]["content"])
            else:
                spliced += len(turn)
                turns += 1
                tail = _ending(tokenizer, turn, stop_ids)
                if tail and piece.startswith(tail):
                    piece = piece[len(tail) :]
            ids += turn
            if ending == "continue" and i == last:
                prefill_ids = len(turn)
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    prefill = str(messages[last]["content"]) if ending == "continue" else None
    got = Prompt(ids, spliced, prefill=prefill, prefill_ids=prefill_ids)
    got.spliced_turns = turns
    return got


def _cut(text: str, marks: list[str], lead: str) -> list[str] | None:
    """The text around the placeholders (``marks``, in the order they must appear; each starts with ``lead``), or
    None unless each appears exactly once, in that order.

    One pass finds them in order and one counts ``lead``: a history of n turns is cut in time linear in its
    text. (Cutting the rest of the text at each placeholder and searching the rest again for a second copy
    scanned and copied the text once per turn: n turns x the text, the square of the turns.)"""
    pieces: list[str] = []
    pos = 0
    for k, mark in enumerate(marks):
        at = text.find(mark, pos)
        if at < 0:
            log.debug("chat template did not render placeholder %d of %d in order; not splicing", k + 1, len(marks))
            return None
        pieces.append(text[pos:at])
        pos = at + len(mark)
    if text.count(lead) != len(marks):
        log.debug("chat template rendered a turn's placeholder more than once; not splicing")
        return None
    pieces.append(text[pos:])
    return pieces


def encode_prefill(tokenizer: Any, text: str) -> list[int]:
    """The ids of an open turn's text, special-token strings in it spelt as plain text: a prefill of
    "<|im_end|>" is the model's own words to go on from, and must not close the turn (nor open another) the
    way the token itself would."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _spells(tokenizer: Any, ids: list[int], text: Any) -> bool:
    """Whether `ids` decode to exactly `text` (end-of-turn and other special tokens included as their text)."""
    got = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return bool(got == text)


def _ending(tokenizer: Any, ids: list[int], stop_ids: set[int]) -> str:
    """The text of the end-of-turn ids the sampled ids end with ('' when none, e.g. cut by max_tokens)."""
    n = 0
    while n < len(ids) and ids[len(ids) - 1 - n] in stop_ids:
        n += 1
    return str(tokenizer.decode(ids[len(ids) - n :], skip_special_tokens=False)) if n else ""
