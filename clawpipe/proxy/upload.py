"""Uploading a proxy's sealed capture segments and its host's rollout result files to object storage.

Runs as a thread of the proxy process, started and stopped with its :class:`~clawpipe.proxy.segments.
SegmentWriter` when ``CLAWPIPE_LAKE_URI`` names an object store. It lives there, not in a separate
service, because the writer is the one that seals segments: it wakes the uploader on each seal, and on
shutdown the last segment is sealed and uploaded before the process exits, with nothing else to start,
watch or stop on a worker host.

Every pass uploads each sealed segment not yet confirmed and each result file that grew
(:func:`clawpipe.objstore.remote_name` says where). An upload is confirmed when the store reports the
local size; only then may the local segment be deleted (``delete_uploaded``), so a failed or partial
upload is retried on the next pass and nothing is lost. Re-uploading is harmless: same name, same bytes.

Another process on the host (a rollout shard that just finished) can have everything in the store *now*
rather than at the next seal: :func:`request_flush` drops a request file in ``<capture_dir>/flush/``; the
uploader (polling that folder every ``flush_poll_s``) takes it, has the writer seal its open segment,
uploads, and answers with a ``.done`` file saying whether every sealed file is confirmed. Files, not an
HTTP endpoint, because the requester runs on the same host and the proxy's admin surface stays as it is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawpipe import objstore
from clawpipe.errors import CaptureError
from clawpipe.procs import pid_alive

log = logging.getLogger(__name__)

FLUSH_DIR = "flush"  # under the capture folder: seal-and-upload requests, answers, live-uploader markers


class Uploader:
    """Copies ``capture_dir``'s sealed segments and results under ``dest_url`` (a capture prefix)."""

    def __init__(
        self,
        capture_dir: str | Path,
        dest_url: str,
        *,
        host: str | None = None,
        interval_s: float = 5.0,
        delete_uploaded: bool = False,
        seal: Callable[[], object] | None = None,
        flush_poll_s: float = 0.5,
    ) -> None:
        self.capture_dir = Path(capture_dir)
        self.dest_url = dest_url.rstrip("/")
        self.host = host or objstore.host_id(self.capture_dir)
        self.interval_s = interval_s
        self.delete_uploaded = delete_uploaded
        self.seal = seal  # seals the writer's open segment (flush requests); None: only sealed files go up
        self.flush_poll_s = flush_poll_s
        self._flush = self.capture_dir / FLUSH_DIR
        self._alive = self._flush / f"uploader-{os.getpid()}.alive"
        self._fs: Any = None
        self._root = ""
        self._confirmed: dict[Path, int] = {}  # local file -> size the store holds
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.uploads = 0
        self.errors = 0
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._fs, self._root = objstore.filesystem(self.dest_url)
        self._flush.mkdir(parents=True, exist_ok=True)
        self._alive.write_text(self.host)  # request_flush looks for a live uploader before asking
        self._thread = threading.Thread(target=self._run, name="capture-upload", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """Stop the thread after one last pass (uploads what the writer sealed on close)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._alive.unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.upload_once()
            if stopping:
                self.serve_flush_requests()  # a requester waiting at shutdown still gets its answer
                return
            next_pass = time.monotonic() + self.interval_s
            while not self._wake.is_set() and time.monotonic() < next_pass:
                self.serve_flush_requests()
                self._wake.wait(min(self.flush_poll_s, max(0.0, next_pass - time.monotonic())))
            self._wake.clear()

    def serve_flush_requests(self) -> int:
        """Answer each pending flush request: seal, upload, write ``<token>.done``; returns requests served."""
        if not self._flush.is_dir():
            return 0
        served = 0
        for req in sorted(self._flush.glob("*.request")):
            taken = req.with_suffix(f".taken-{os.getpid()}")
            try:
                os.rename(req, taken)  # one uploader takes each request, even if several share the folder
            except FileNotFoundError:
                continue
            if self.seal is not None:
                self.seal()
            self.upload_once()
            pending = [str(p.name) for p in self._candidates() if not self._is_confirmed(p)]
            report = {"ok": not pending, "pending": pending, "host": self.host, "uploads": self.uploads}
            done = req.with_suffix(".done")
            tmp = req.with_suffix(".done.tmp")
            tmp.write_text(json.dumps(report))
            os.replace(tmp, done)
            taken.unlink(missing_ok=True)
            served += 1
        return served

    def _is_confirmed(self, path: Path) -> bool:
        try:
            return self._confirmed.get(path) == path.stat().st_size
        except FileNotFoundError:
            return True  # deleted after its confirmed upload

    def _candidates(self) -> list[Path]:
        if not self.capture_dir.is_dir():
            return []
        found = sorted(self.capture_dir.glob("*.seg"))
        results = self.capture_dir / "results"
        if results.is_dir():
            found += sorted(results.rglob("*.jsonl"))
        return found

    def upload_once(self) -> int:
        """One pass; returns files uploaded. Errors are logged and retried on the next pass."""
        if self._fs is None:
            self._fs, self._root = objstore.filesystem(self.dest_url)
        n = 0
        for path in self._candidates():
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            if self._confirmed.get(path) == size:
                continue
            name = objstore.remote_name(self.capture_dir, path, self.host)
            if name is None:
                continue
            try:
                n += self._upload(path, size, f"{self._root}/{name}")
            except OSError as exc:
                self.errors += 1
                self.last_error = exc
                log.warning("capture upload failed file=%s dest=%s error=%s", path, self.dest_url, exc)
        return n

    def _upload(self, path: Path, size: int, remote: str) -> int:
        uploaded = 0
        try:
            stored = int(self._fs.info(remote).get("size") or 0)
        except FileNotFoundError:
            stored = -1
        if stored != size:
            # read once: a result file may grow meanwhile, and the store must hold exactly what was read
            data = path.read_bytes()
            size = len(data)
            self._fs.pipe_file(remote, data)
            stored = int(self._fs.info(remote).get("size") or 0)
            if stored != size:
                raise OSError(f"store holds {stored} bytes of {remote}, {size} were sent")
            uploaded = 1
            self.uploads += 1
        self._confirmed[path] = size
        if self.delete_uploaded and path.suffix == ".seg":
            path.unlink(missing_ok=True)  # confirmed above: the store has every byte
            self._confirmed.pop(path, None)
        return uploaded


def live_uploader(capture_dir: str | Path) -> bool:
    """Whether a process whose uploader serves ``capture_dir`` is alive (a killed proxy leaves a stale marker)."""
    for marker in (Path(capture_dir) / FLUSH_DIR).glob("uploader-*.alive"):
        pid = marker.stem.split("-", 1)[1]
        if pid.isdigit() and pid_alive(int(pid)):
            return True
    return False


def request_flush(capture_dir: str | Path, timeout_s: float = 60.0) -> dict[str, Any] | None:
    """Have the live uploader of ``capture_dir`` seal its writer's open segment and upload every sealed file
    now; returns its report (``ok``: all confirmed in the store), or None when no uploader is alive there.

    Raises CaptureError when the uploader does not answer within ``timeout_s``.
    """
    if not live_uploader(capture_dir):
        return None
    flush = Path(capture_dir) / FLUSH_DIR
    token = uuid.uuid4().hex
    tmp = flush / f"{token}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, flush / f"{token}.request")  # the uploader sees the request whole
    done = flush / f"{token}.done"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done.is_file():
            report: dict[str, Any] = json.loads(done.read_text())
            done.unlink(missing_ok=True)
            return report
        time.sleep(0.1)
    with contextlib.suppress(FileNotFoundError):
        (flush / f"{token}.request").unlink()
    raise CaptureError(
        f"the capture uploader of {capture_dir} did not answer a flush within {timeout_s:.0f}s; "
        "check that the host's proxy is running and can reach the object store"
    )
