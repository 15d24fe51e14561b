"""Text-side helpers of the engine: per-token strings and bytes, incremental detokenization with stop strings,
and parsing ``<tool_call>{...}</tool_call>`` spans out of generated text. No torch here.
"""

from __future__ import annotations

import bisect
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from clawpipe.serving.policy import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


BYTE_DECODER: dict[str, int] = {v: k for k, v in _bytes_to_unicode().items()}


class TokenTable:
    """Per-token display string and raw bytes for a tokenizer (byte-level BPE decoded exactly)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids)
        try:
            decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        except Exception:
            decoder = {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self.byte_pieces = _byte_fallback_ids(tokenizer, decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}
        # the most text characters one token can stand for (a byte-level piece's characters are its bytes)
        self.longest_piece = max(map(len, tokenizer.get_vocab()), default=1)

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """(token string, its bytes) for one id; partial UTF-8 tokens keep their true bytes."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            piece = ""
        if self._byte_level and token_id not in self._special and all(c in BYTE_DECODER for c in piece):
            raw = bytes(BYTE_DECODER[c] for c in piece)
        else:
            raw = (
                self._tokenizer.decode([token_id]).encode("utf-8") if token_id not in self._special else piece.encode()
            )
        text = raw.decode("utf-8", errors="replace")
        out = (text, list(raw))
        self._cache[token_id] = out
        return out

    def logprob_entries(
        self, token_ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]] | None = None
    ) -> list[dict[str, Any]]:
        """The chat-completions `logprobs.content` entries for ids, their logprobs and top alternatives."""
        out = []
        for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            text, raw = self.entry(tid)
            top = [self._top(t, v) for t, v in tops[i]] if tops else []
            out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
        return out

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.entry(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}


def _byte_fallback_ids(tokenizer: Any, decoder: dict[str, Any]) -> frozenset[int]:
    """The ids of ``<0xNN>`` pieces when the decoder falls back to bytes (SentencePiece-style tokenizers, as
    Llama 2's and Mistral's): a run of them decodes as one, and as U+FFFD for every byte of it when the run is not
    valid UTF-8, so each piece's text depends on the pieces after it."""
    parts = decoder.get("decoders") or [decoder]
    if not any(isinstance(d, dict) and d.get("type") == "ByteFallback" for d in parts):
        return frozenset()
    vocab = tokenizer.get_vocab()
    return frozenset(i for piece, i in vocab.items() if len(piece) == 6 and piece.startswith("<0x") and piece[5] == ">")


@dataclass
class Detokenizer:
    """Incremental text of one choice: decodes the new ids, finds stop strings, and holds back text that may
    still become a stop string or an incomplete UTF-8 character.

    Each step decodes only a short window: ids[prefix:] against ids[prefix:read] (both decodes start at the
    same id, so tokenizers that treat the first id specially agree), and the text grows by their difference
    once it does not end in an incomplete character. Decoding everything each step would be quadratic."""

    tokenizer: Any
    stop: list[str]
    hidden_ids: set[int]
    lazy: bool = False  # decode only when the final text is taken (no stop strings, not streamed)
    # byte-fallback pieces (TokenTable.byte_pieces): text is taken only once their run has ended, since a later
    # byte can turn the whole run's text into U+FFFD; decoding the run in parts would give other text
    byte_pieces: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    stopped_on: str | None = None
    _prefix: int = 0  # ids[_prefix:_read] decode to the end of `text`
    _read: int = 0
    # where each added id's text ends in `text` (hidden ids too, as empty text), once decoded; ids still
    # undecoded (an incomplete character, a lazy decode) have no entry yet
    _ends: list[int] = field(default_factory=list)
    _added: int = 0
    _released: int = 0  # ids handed out by `release`
    _given: int = 0  # characters handed out by `release`

    def add(self, token_id: int) -> None:
        """Append one id; sets `stopped_on` when a stop string appears (text is cut before it)."""
        self._added += 1
        if token_id in self.hidden_ids:
            if len(self._ends) == self._added - 1:  # nothing undecoded before it: it ends where the text does
                self._ends.append(len(self.text))
            return
        self.ids.append(token_id)
        if not self.lazy:
            self._advance(final=False)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _advance(self, final: bool) -> None:
        if self.stopped_on is not None or self._read == len(self.ids):
            return
        before = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self._decode(self.ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith("\ufffd") or self.ids[-1] in self.byte_pieces):
            return  # an incomplete character or a byte run not yet ended: wait for the next id
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self._settle()
        for s in self.stop:
            pos = self.text.find(s, max(0, self.emitted - len(s)))
            if pos >= 0:
                self.text = self.text[:pos]
                self.stopped_on = s
                return

    def take(self, final: bool) -> str:
        """The text not yet handed out that is safe to hand out now (all of it when final)."""
        if final:
            if self.lazy:
                self.text = self._decode(self.ids)
            else:
                self._advance(final=True)
            if self.stopped_on is None:
                self._settle()
        end = len(self.text)
        if not final:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.emitted, min(end, len(self.text) - hold))
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def _settle(self) -> None:
        """Every id added so far without an end ends where the text now does."""
        self._ends.extend([len(self.text)] * (self._added - len(self._ends)))

    def release(self) -> tuple[int, str]:
        """(how many more ids, the text to show with them), by the text `take` has handed out so far. With stop
        strings, whole ids only: the ids whose text reaches into a stop string are never released, and the text
        then ends before the stop string, at the end of the last whole id before it, so the ids and logprobs a
        response reports always decode to exactly its text. Without, every id at once, its text when complete."""
        limit = min(self.emitted, len(self.text))
        if not self.stop:
            # nothing can be cut: every id goes out at once, even before its character is complete (a run of
            # bytes that never decodes would otherwise hold the ids back to the end)
            n, end = self._added, limit
        else:
            n = bisect.bisect_right(self._ends, limit, lo=self._released)
            end = self._ends[n - 1] if n > self._released else self._given
        if n == self._released and end == self._given:
            return 0, ""
        count, piece = n - self._released, self.text[self._given : end]
        self._released, self._given = n, end
        return count, piece


MAX_ARGS_DEPTH = 64  # nesting of a generated call's arguments; deeper ones stay text


@dataclass
class ToolCall:
    """One parsed tool call."""

    id: str
    name: str
    arguments: str  # JSON text of an object


def new_id(prefix: str, n: int = 12) -> str:
    """A random id like ``call_3f9a...``."""
    return f"{prefix}{secrets.token_hex(n)}"


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split generated text into (content outside tool calls, tool calls).

    A span ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (closing tag optional at the end) whose
    JSON parses and names a function becomes a call; anything else stays text.
    """
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(TOOL_CALL_CLOSE, start)
        body_end = end if end >= 0 else len(text)
        after = end + len(TOOL_CALL_CLOSE) if end >= 0 else len(text)
        call = _parse_call(text[start + len(TOOL_CALL_OPEN) : body_end])
        if call is None:
            content.append(text[pos:after])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = after
        if pos >= len(text):
            break
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def _parse_call(body: str) -> ToolCall | None:
    # RecursionError: a degenerate policy's "[[[[..." nests deeper than the parser recurses; it stays text
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict) or nests_deeper(args, MAX_ARGS_DEPTH):
        return None  # deep arguments would fail to encode in the response, as a 500
    return ToolCall(id=new_id("call_"), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def nests_deeper(value: Any, limit: int) -> bool:
    """Whether a JSON value nests objects and lists more than `limit` levels deep (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def may_hold_tool_call(text: str) -> int:
    """Index from which text must be held back while streaming because a tool call may be starting there."""
    pos = text.find(TOOL_CALL_OPEN)
    if pos >= 0:
        return pos
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
