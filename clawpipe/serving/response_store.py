"""Responses kept for `previous_response_id` and for reading back (`GET /v1/responses/{id}`, its input items,
`DELETE`): for each stored response, the input it ran on (its own input after its predecessors' inputs and
outputs), its output items and the response object itself, in memory, the most recent ones only, up to a count
and a size."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, NamedTuple

import orjson

from clawpipe.serving.params import RequestError

log = logging.getLogger(__name__)

Items = list[dict[str, Any]]
# what a response read back leaves out: the engine's per-token extensions (token ids, logprobs), which can be
# many times the size of the rest and are the capture's to keep, not the store's
_NOT_KEPT = ("prompt_token_ids", "token_ids", "logprobs", "spliced_tokens")


class _Entry(NamedTuple):
    context: Items  # the whole input the response ran on
    output: Items
    own_input: Items  # the part of it its request sent
    response: dict[str, Any]
    size: int


class ResponseStore:
    """A bounded LRU of response id -> (input items, output items). Items are shared, not copied, between a
    response and the ones that continue it, so a chain of n turns costs n lists of references.

    Each entry counts the JSON size of all it holds, its predecessors' items included (they stay alive as long
    as it does), and the entries together stay within max_bytes: without it, items the template never renders
    (reasoning, encrypted content) could pile up to 1024 request bodies in memory. An entry larger than the
    whole budget is not kept."""

    def __init__(self, max_responses: int, max_bytes: int = 256 * 2**20) -> None:
        self.max_responses = max(0, max_responses)
        self.max_bytes = max(0, max_bytes)
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self,
        response_id: str,
        input_items: Items,
        output_items: Items,
        response: dict[str, Any] | None = None,
        own_input: Items | None = None,
    ) -> None:
        """Keep response ``response_id``: ``input_items`` the whole input it ran on, ``own_input`` the part its
        request sent (default: all of it), ``response`` the object it answered (read back without the engine's
        per-token fields)."""
        kept = {k: v for k, v in (response or {"id": response_id}).items() if k not in _NOT_KEPT}
        own = input_items if own_input is None else own_input
        # the output items are the response's own (one copy in memory, counted once)
        same = kept.get("output") is output_items
        size = len(orjson.dumps([input_items, kept] if same else [input_items, output_items, kept]))
        if size > self.max_bytes:
            log.info("response %s not kept: %d bytes, over the store's %d", response_id, size, self.max_bytes)
            return
        with self._lock:
            old = self._entries.pop(response_id, None)
            self._bytes += size - (old.size if old else 0)
            self._entries[response_id] = _Entry(input_items, output_items, own, kept, size)
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1].size

    def _get(self, response_id: str) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
        return entry

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The response object kept under ``response_id`` (None: unknown, not stored or no longer kept)."""
        entry = self._get(response_id)
        return None if entry is None else entry.response

    def own_input(self, response_id: str) -> Items | None:
        """The input items response ``response_id``'s request sent (None: not kept)."""
        entry = self._get(response_id)
        return None if entry is None else entry.own_input

    def delete(self, response_id: str) -> bool:
        """Forget response ``response_id``; whether it was kept. Responses continuing it keep their context."""
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
        return entry is not None

    def context(self, response_id: Any) -> Items:
        """The items a request continuing `response_id` starts with: its input, then its output (as OpenAI
        expands previous_response_id); RequestError when it is unknown, not stored or no longer kept."""
        if not isinstance(response_id, str):
            raise RequestError("'previous_response_id' must be a string", param="previous_response_id")
        entry = self._get(response_id)
        if entry is None:
            raise RequestError(
                f"Previous response with id '{response_id}' not found: this server keeps the last "
                f"{self.max_responses} responses created with store true (the default), in memory, up to "
                f"{self.max_bytes // 2**20} MB; send the whole conversation in 'input' instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [*entry.context, *entry.output]
