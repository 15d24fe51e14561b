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
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from clawpipe import objstore

log = logging.getLogger(__name__)


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
    ) -> None:
        self.capture_dir = Path(capture_dir)
        self.dest_url = dest_url.rstrip("/")
        self.host = host or objstore.host_id(self.capture_dir)
        self.interval_s = interval_s
        self.delete_uploaded = delete_uploaded
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

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            self.upload_once()
            if stopping:
                return
            self._wake.wait(self.interval_s)
            self._wake.clear()

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
