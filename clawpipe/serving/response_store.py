"""Responses kept for `previous_response_id`: for each stored response, the input it ran on (its own input after
its predecessors' inputs and outputs) and its output items, in memory, the most recent ones only, up to a count
and a size."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import orjson

from clawpipe.serving.params import RequestError

log = logging.getLogger(__name__)

Items = list[dict[str, Any]]


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
        self._entries: collections.OrderedDict[str, tuple[Items, Items, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, input_items: Items, output_items: Items) -> None:
        size = len(orjson.dumps([input_items, output_items]))
        if size > self.max_bytes:
            log.info("response %s not kept: %d bytes, over the store's %d", response_id, size, self.max_bytes)
            return
        with self._lock:
            old = self._entries.pop(response_id, None)
            self._bytes += size - (old[2] if old else 0)
            self._entries[response_id] = (input_items, output_items, size)
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1][2]

    def context(self, response_id: Any) -> Items:
        """The items a request continuing `response_id` starts with: its input, then its output (as OpenAI
        expands previous_response_id); RequestError when it is unknown, not stored or no longer kept."""
        if not isinstance(response_id, str):
            raise RequestError("'previous_response_id' must be a string", param="previous_response_id")
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
        if entry is None:
            raise RequestError(
                f"Previous response with id '{response_id}' not found: this server keeps the last "
                f"{self.max_responses} responses created with store true (the default), in memory, up to "
                f"{self.max_bytes // 2**20} MB; send the whole conversation in 'input' instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [*entry[0], *entry[1]]
