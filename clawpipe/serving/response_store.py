"""Responses kept for `previous_response_id`: for each stored response, the input it ran on (its own input after
its predecessors' inputs and outputs) and its output items, in memory, the most recent ones only."""

from __future__ import annotations

import collections
import threading
from typing import Any

from clawpipe.serving.params import RequestError

Items = list[dict[str, Any]]


class ResponseStore:
    """A bounded LRU of response id -> (input items, output items). Items are shared, not copied, between a
    response and the ones that continue it, so a chain of n turns costs n lists of references."""

    def __init__(self, max_responses: int) -> None:
        self.max_responses = max(0, max_responses)
        self._entries: collections.OrderedDict[str, tuple[Items, Items]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, input_items: Items, output_items: Items) -> None:
        with self._lock:
            self._entries[response_id] = (input_items, output_items)
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_responses:
                self._entries.popitem(last=False)

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
                f"{self.max_responses} responses created with store true (the default), in memory; send the whole "
                "conversation in 'input' instead",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return [*entry[0], *entry[1]]
