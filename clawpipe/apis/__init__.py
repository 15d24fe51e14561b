"""The wire dialects of the four model APIs: chat (OpenAI Chat Completions), completions (OpenAI
Completions), responses (OpenAI Responses) and messages (Anthropic Messages).

A seam every room may use (it imports no server stack, no torch, no tracking):

- :mod:`clawpipe.apis.sse`: Server-Sent Events framing for writers, an incremental reader, and the JSON
  events of a whole stream;
- :mod:`clawpipe.apis.streams`: a streamed response reassembled into the body the same call would have
  returned unstreamed, one function per API;
- :mod:`clawpipe.apis.requests`: a request body turned into chat-template messages and tools, and the
  text of a content value.
"""

from clawpipe.apis.requests import request_messages, text_of
from clawpipe.apis.sse import SSEEvent, SSEReader, json_events, read_events, sse_frame
from clawpipe.apis.streams import reassemble

__all__ = [
    "SSEEvent",
    "SSEReader",
    "json_events",
    "read_events",
    "reassemble",
    "request_messages",
    "sse_frame",
    "text_of",
]
