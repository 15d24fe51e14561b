"""An S3 endpoint that misbehaves as some S3-compatible stores do: a forwarder in front of the test's moto
server that drops request headers it names (a store that ignores ``If-None-Match``) and answers the first
requests of a kind with ``503 SlowDown`` (a store shedding load). Everything else passes through unchanged."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "host"}
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultyS3:
    """``url`` forwards to ``upstream``; ``drop`` names headers never passed on; ``slow_down[method]`` is how many
    of the next requests with that method get a 503 SlowDown instead of an answer."""

    def __init__(self, upstream: str, *, drop: tuple[str, ...] = ()) -> None:
        self.upstream, self.drop = upstream.rstrip("/"), {h.lower() for h in drop}
        self.slow_down: dict[str, int] = {}
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request, refused ones included
        self.refused = 0
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=30)
        faulty = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                size = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(size) if size else b""
                with faulty._lock:
                    faulty.seen.append((self.command, self.path))
                    left = faulty.slow_down.get(self.command, 0)
                    if left:
                        faulty.slow_down[self.command] = left - 1
                        faulty.refused += 1
                if left:
                    self._reply(503, {"content-type": "application/xml"}, SLOW_DOWN)
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() not in faulty.drop
                }
                r = faulty._client.request(self.command, faulty.upstream + self.path, headers=headers, content=body)
                out = {
                    k: v for k, v in r.headers.items() if k.lower() not in HOP | {"content-length", "content-encoding"}
                }
                # a HEAD answer has no body but tells the object's size
                size = r.headers.get("content-length", "0") if self.command == "HEAD" else None
                self._reply(r.status_code, out, r.content, size)

            def _reply(self, status: int, headers: dict[str, str], body: bytes, size: str | None = None) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", size if size is not None else str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultyS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
