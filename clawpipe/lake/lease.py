"""The writer lease of a lake on object storage: one lander or compactor at a time, across hosts.

A local lake serialises its writers with ``flock``; an object store has no locks and no atomic rename,
so the lease is an object, ``_manifest/lease.json`` ({owner, expires}), and every step of it is a
conditional write the store decides alone:

- take a free lease: create it with ``If-None-Match: *`` (of two hosts, exactly one succeeds);
- take an expired lease (its holder died): overwrite it with ``If-Match: <the expired one's ETag>``
  (of two takers, exactly one succeeds); a taker then writes a fence (:func:`clawpipe.lake.manifest.fence`)
  so the old holder, if it was only paused, can no longer commit;
- renew: overwrite with ``If-Match: <our ETag>`` every ``ttl/3`` seconds from a thread; a failed
  renewal means the lease was taken, and the holder stops before publishing anything more;
- release: delete it.

Stores without conditional PUTs (fsspec ``memory://`` in tests) use create-if-absent only; their expiry
takeover is not safe against two takers and is documented as single-host.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import orjson

from clawpipe.errors import LakeError
from clawpipe.tables import LakeFS

log = logging.getLogger(__name__)

NAME = "_manifest/lease.json"
TTL_ENV = "CLAWPIPE_LAKE_LEASE_TTL"  # seconds; how long a dead writer blocks the lake (default 60)


def default_ttl() -> float:
    raw = os.environ.get(TTL_ENV) or "60"
    try:
        ttl = float(raw)
    except ValueError:
        ttl = float("nan")
    if not 0 < ttl < float("inf"):  # was taken as 60 s without a word
        raise LakeError(f"{TTL_ENV}={raw!r}: give the lease's time to live in seconds, a number above 0")
    return max(1.0, ttl)


class Lease:
    """A held lake writer lease; ``valid()`` is False once it may have passed to another writer."""

    def __init__(self, lake: LakeFS, *, ttl_s: float | None = None) -> None:
        self.lake, self.ttl_s = lake, ttl_s or default_ttl()
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self.expires = 0.0  # local monotonic deadline: past it, another writer may hold the lease
        self.took_over = False
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- store ------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        return orjson.dumps({"owner": self.owner, "expires": time.time() + self.ttl_s})

    def _put(self, if_match: str | None) -> bool:
        path = self.lake.full(NAME)
        body = self._body()
        t = time.monotonic()
        fs = self.lake.fsspec
        if if_match is None:
            ok = self.lake.create_exclusive(NAME, body)
        else:
            try:
                fs.pipe_file(path, body, IfMatch=if_match)
                ok = True
            except (OSError, TypeError):  # 412 PreconditionFailed: someone else's write came first
                ok = False
        if ok:
            self.etag = _etag(fs, path)
            self.expires = t + self.ttl_s
        return ok

    def _read(self) -> tuple[dict[str, Any], str | None] | None:
        fs = self.lake.fsspec
        path = self.lake.full(NAME)
        try:
            etag = _etag(fs, path)
            return orjson.loads(fs.cat_file(path)), etag
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError:
            return {"expires": 0}, _etag(fs, path)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def acquire(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if self._put(None):
                break
            held = self._read()
            expired = held is not None and float(held[0].get("expires", 0)) < time.time()
            if expired and held is not None and self._supports_if_match() and self._put(held[1]):
                self.took_over = True
                log.warning("took over the expired lake writer lease of %s", held[0].get("owner"))
                break
            if time.monotonic() > deadline:
                raise LakeError(
                    f"lake {self.lake.url} is held by another writer (lease {NAME}) for over {timeout_s:.0f}s; "
                    "wait for its landing or compaction to end, or delete the lease if its host is gone"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        self._thread = threading.Thread(target=self._renew, name="lake-lease", daemon=True)
        self._thread.start()

    def _supports_if_match(self) -> bool:
        return self.lake.scheme in ("s3", "s3a")

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if not self._supports_if_match():
                if not self._put_plain():
                    return
                continue
            if not self._put(self.etag):
                self.lost = True
                log.error("lost the lake writer lease of %s: another writer took it", self.lake.url)
                return

    def _put_plain(self) -> bool:
        held = self._read()
        if held is None or held[0].get("owner") != self.owner:
            self.lost = True
            return False
        self.lake.fsspec.pipe_file(self.lake.full(NAME), self._body())
        self.expires = time.monotonic() + self.ttl_s
        return True

    def valid(self) -> bool:
        """Still ours with a margin to spare (checked before anything is published or committed)."""
        margin = min(5.0, self.ttl_s / 4)
        return not self.lost and time.monotonic() + margin < self.expires

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost:
            return
        held = self._read()
        if held is not None and held[0].get("owner") == self.owner:
            self.lake.delete(NAME)


def _etag(fs: Any, path: str) -> str | None:
    info = fs.info(path)
    tag = info.get("ETag") or info.get("etag")
    return None if tag is None else str(tag)
