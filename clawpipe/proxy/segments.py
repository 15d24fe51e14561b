"""Durable capture: append framed call records to segment files with group commit.

One writer thread owns the open segment. The event loop hands it ``(header, request, response)`` plus a
callback; the thread frames every pending record (:func:`clawpipe.capture.encode_record`), writes them with
one ``os.write``, fsyncs once for the whole batch, and only then fires the callbacks on the event loop (one
wake-up per batch). The proxy releases a call's response (or the last bytes of a stream) to the harness in
that callback, which is the guarantee: *a call whose response reached the harness is on disk*.

Segments are ``<instance>-<n>.open`` while written and renamed to ``.seg`` when sealed (on rotation by size
or age, and on shutdown; a rotation opens the next segment before it seals the last, so while the writer
runs one is always open). The writer holds an exclusive ``flock`` on its open segment; on start, every
``.open`` segment in the directory whose lock is free belongs to a dead writer: its torn tail (an incomplete
frame after the last intact one) is cut and it is sealed (:mod:`clawpipe.proxy.recovery`), so a
crash loses nothing that was committed; damaged frames before that stay for landing to report as rejects.

A write that fails (a full disk, no descriptor left) fails only the records of its batch that it did not
write whole: their callbacks get a :class:`~clawpipe.errors.CaptureError` naming the cause, a partly written
frame is cut off again (so nothing torn sits between intact frames, and no intact frame a landing may have
read disappears), and the next batch tries again, in a fresh segment when the last one could not be
repaired, could not grow (RLIMIT_FSIZE) or none could be opened. :meth:`SegmentWriter.health` says whether capture is
failing; while it is and no record comes, the thread probes the directory once a second (a small file
written, synced and removed), so health turns good again once space or descriptors are freed.

When ``CLAWPIPE_LAKE_URI`` names an object store, an :class:`~clawpipe.proxy.upload.Uploader` runs beside
the writer and copies each sealed segment (and the host's result files) to the lake's capture prefix;
:meth:`SegmentWriter.seal_now` lets it seal the open segment on request (a flush, see upload.py), so a
finished rollout shard's calls are in the store before the shard reports done.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawpipe import capture, objstore
from clawpipe.errors import CaptureError
from clawpipe.proxy.recovery import fsync_dir, recover_dead_segments, still_named
from clawpipe.proxy.upload import Uploader

log = logging.getLogger(__name__)

Done = Callable[[BaseException | None], None]
UPLOAD_ENV = "CLAWPIPE_CAPTURE_UPLOAD"  # "0": never upload, even with an object-store lake
PROBE_EVERY_S = 1.0  # while writes fail: how often an idle writer checks whether the directory took space again
OPEN_TRIES = 8  # fresh segment names tried when starting proxies keep sealing the new one before it is locked
PROBE_BYTES = 64 << 10  # a probe write of this size must succeed before capture counts as healthy again


def upload_url_from_env() -> str | None:
    """The capture prefix to upload to: ``<CLAWPIPE_LAKE_URI>/captures`` when that is an object store."""
    lake_uri = os.environ.get("CLAWPIPE_LAKE_URI", "").strip()
    if not lake_uri or not objstore.is_remote(lake_uri) or os.environ.get(UPLOAD_ENV, "1") == "0":
        return None
    return objstore.captures_url(lake_uri)


class SegmentWriter:
    """Group-committing appender of capture records (one thread, one open segment at a time).

    Invariant: a record's callback fires only after the bytes of its frame were written and fsynced.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        instance: str,
        max_bytes: int = 64 << 20,
        max_age_s: float = 300.0,
        fsync: bool = True,
        upload_url: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        # sealed segments go to object storage when a URL is given or the environment names a remote lake
        self.upload_url = upload_url or upload_url_from_env()
        self.uploader: Uploader | None = None
        self.instance = instance
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.fsync = fsync
        self._cond = threading.Condition()
        self._pending: list[tuple[capture.CaptureHeader, bytes, bytes, Done]] = []
        self._seal_requests: list[threading.Event] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._fd = -1
        self._path: Path | None = None
        self._size = 0
        self._opened_at = 0.0
        self._n = 0
        self._post: Callable[[Callable[..., Any], Any], Any] | None = None
        self.records = 0
        self.batches = 0
        self.bytes_written = 0
        self.sealed: list[str] = []
        self.failure: str | None = None  # why the last write failed; None once one succeeds again
        self.failing_since: float | None = None  # epoch seconds of the first failure of the current run
        self.failed_records = 0  # records whose write failed (their calls were answered as not recorded)

    # --- lifecycle -----------------------------------------------------------------------------------
    def start(self, post: Callable[[Callable[..., Any], Any], Any]) -> None:
        """Recover dead segments, open a fresh one and start the thread.

        ``post(fn, arg)`` schedules ``fn(arg)`` on the caller's event loop (``loop.call_soon_threadsafe``).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        recover_dead_segments(self.directory)
        existing = [
            int(p.name[len(self.instance) + 1 :].split(".")[0])
            for p in self.directory.glob(f"{self.instance}-*")
            if p.name[len(self.instance) + 1 :].split(".")[0].isdigit()
        ]
        self._n = max(existing, default=-1) + 1
        self._post = post
        try:
            self._open_segment()
        except OSError as exc:  # a proxy that cannot write its first record does not start
            why = capture.write_failure(exc, self.directory)
            raise CaptureError(f"cannot open a capture segment in {self.directory}: {why}") from exc
        self._thread = threading.Thread(target=self._run, name=f"capture-{self.instance}", daemon=True)
        self._thread.start()
        if self.upload_url:
            self.uploader = Uploader(self.directory, self.upload_url, seal=self.seal_now)
            self.uploader.start()  # its first pass uploads what recovery just sealed

    def close(self) -> None:
        """Commit what is pending, seal the open segment and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.uploader is not None:
            self.uploader.close()  # one last pass: the segment sealed just now goes up before exit
            self.uploader = None

    def seal_now(self, timeout_s: float = 30.0) -> bool:
        """Seal the open segment (after committing what is pending) and open a fresh one; returns once done.

        Every record whose callback has fired is in a sealed segment afterwards. False if the writer is
        closing or did not answer within ``timeout_s``.
        """
        done = threading.Event()
        with self._cond:
            if self._closing or self._thread is None:
                return False
            self._seal_requests.append(done)
            self._cond.notify()
        return done.wait(timeout_s)

    @property
    def current_segment(self) -> str | None:
        return self._path.name if self._path else None

    def health(self) -> dict[str, Any]:
        """Whether records are being written: ``ok``, and while they are not, why and since when."""
        return {
            "ok": self.failure is None,
            "error": self.failure,
            "failing_since": self.failing_since,
            "failed_records": self.failed_records,
            "directory": str(self.directory),
        }

    # --- loop side -----------------------------------------------------------------------------------
    def submit(self, header: capture.CaptureHeader, request: bytes, response: bytes, done: Done) -> None:
        """Queue one record; ``done(None)`` runs on the event loop once it is durable (``done(exc)`` on failure)."""
        with self._cond:
            if self._closing:
                raise CaptureError("capture writer is closed; the proxy is shutting down")
            self._pending.append((header, request, response, done))
            if len(self._pending) == 1:
                self._cond.notify()

    # --- writer thread -------------------------------------------------------------------------------
    def _open_segment(self) -> None:
        for _ in range(OPEN_TRIES):
            path = self.directory / f"{self.instance}-{self._n:06d}{capture.OPEN_SUFFIX}"
            self._n += 1
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a starting proxy holds it, taking it for a dead one's: it seals it
                os.close(fd)
                continue
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            if not still_named(path, fd):
                # created, then sealed by a starting proxy before we locked it (a new segment's free lock looks
                # like a dead writer's): records written to it now would land after it was landed as finished
                os.close(fd)
                continue
            try:
                fsync_dir(self.directory)
            except OSError:  # no descriptor left for the directory, say: no half-made segment stays behind
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            self._fd, self._path, self._size, self._opened_at = fd, path, 0, time.monotonic()
            return
        raise OSError(errno.EBUSY, f"could not open a segment in {self.directory}: {OPEN_TRIES} were sealed by others")

    def _seal_current(self) -> None:
        fd, path, size = self._fd, self._path, self._size
        self._fd, self._path = -1, None
        if fd >= 0 and path is not None:
            self._seal(fd, path, size)

    def _seal(self, fd: int, path: Path, size: int) -> None:
        try:
            os.fsync(fd)
            if size == 0:
                path.unlink(missing_ok=True)
            else:
                sealed = path.with_suffix(capture.SEALED_SUFFIX)  # our frames are whole: no recovery scan
                os.replace(path, sealed)
                self.sealed.append(sealed.name)
            fsync_dir(self.directory)
            if self.uploader is not None:
                self.uploader.wake()
        finally:
            os.close(fd)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing and not self._seal_requests:
                    timeout = None
                    if self._size and self.max_age_s > 0:
                        timeout = max(0.05, self._opened_at + self.max_age_s - time.monotonic())
                    if self.failure is not None:
                        timeout = min(timeout or PROBE_EVERY_S, PROBE_EVERY_S)
                    if not self._cond.wait(timeout) and (self._size or self.failure is not None):
                        break  # age rotation check or failure probe below
                batch, self._pending = self._pending, []
                closing = self._closing
                seal_requests, self._seal_requests = self._seal_requests, []
            if batch:
                self._commit(batch)
            elif self.failure is not None and not closing:
                self._probe()
            if seal_requests and self._size:
                self._rotate()
            for done in seal_requests:
                done.set()
            if self._size and (
                self._size >= self.max_bytes
                or (self.max_age_s > 0 and time.monotonic() - self._opened_at >= self.max_age_s)
            ):
                self._rotate()
            if closing and not self._pending:
                with contextlib.suppress(OSError):
                    self._seal_current()
                with self._cond:  # a seal asked for while closing: the close just sealed everything
                    for done in self._seal_requests:
                        done.set()
                    self._seal_requests.clear()
                return

    def _rotate(self) -> None:
        """Seal the open segment and go on in a fresh one; when no fresh one can be opened, the open one is
        kept (rotation is tried again later): records keep going where they can."""
        fd, path, size = self._fd, self._path, self._size
        try:
            self._open_segment()  # the next segment exists before this one is sealed: one is always open
        except OSError as exc:
            log.error("segment rotation failed dir=%s error=%s", self.directory, exc)
            return
        if fd >= 0 and path is not None:
            try:
                self._seal(fd, path, size)
            except OSError as exc:  # left .open and unlocked: its frames land, the next start seals it
                log.error("sealing segment=%s failed error=%s", path.name, exc)

    def _commit(self, batch: list[tuple[capture.CaptureHeader, bytes, bytes, Done]]) -> None:
        callbacks = [cb for _, _, _, cb in batch]
        assert self._post is not None
        try:
            frames = [capture.encode_record(h, req, resp) for h, req, resp, _ in batch]
        except (ValueError, TypeError) as exc:
            log.error("capture records could not be framed error=%s", exc)
            error = CaptureError(f"the call's record could not be framed: {exc}")
            self._failed(str(error), len(batch))
            self._post(_fire, (callbacks, 0, error))
            return
        done, failure = self._write(frames)
        if done:
            self.records += done
            self.batches += 1
        if failure is None:
            if self.failure is not None:
                log.warning(
                    "capture writes succeed again dir=%s (failing since %s)", self.directory, self.failing_since
                )
            self.failure = self.failing_since = None
        else:
            self._failed(str(failure), len(frames) - done)
        self._post(_fire, (callbacks, done, failure))

    def _write(self, frames: list[bytes], *, again: bool = False) -> tuple[int, CaptureError | None]:
        """Append ``frames`` to the open segment (opening one when there is none) and sync them; returns how
        many of them (from the first) are on disk, and why the others are not.

        A write that stops part-way (a full disk) keeps the frames it wrote whole, synced: a landing may have
        read them already, so an intact frame never disappears; the partly written one is cut off again. A
        segment at the largest file the process may write (RLIMIT_FSIZE) is sealed and the rest goes to a
        fresh one."""
        data = b"".join(frames)
        written = 0
        try:
            if self._fd < 0:
                self._open_segment()
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                written += n
                view = view[n:]
        except OSError as exc:
            return self._stopped(frames, written, exc, again)
        if self.fsync:
            try:
                os.fdatasync(self._fd)
            except OSError as exc:  # nothing of it is known to be on disk
                return self._stopped(frames, 0, exc, again)
        self._size += len(data)
        self.bytes_written += len(data)
        return len(frames), None

    def _stopped(self, frames: list[bytes], written: int, exc: OSError, again: bool) -> tuple[int, CaptureError | None]:
        """After a write of ``frames`` that stopped at ``written`` bytes: keep the frames wholly written (once
        synced), cut the rest off; the frames kept and why the others failed."""
        log.error("capture write failed segment=%s error=%s", self.current_segment, exc)
        done = keep = 0
        for frame in frames:
            if keep + len(frame) > written:
                break
            keep += len(frame)
            done += 1
        if done and self.fsync:
            try:
                os.fdatasync(self._fd)
            except OSError:
                done = keep = 0
        self._size += keep
        self.bytes_written += keep
        self._cut_back()
        if exc.errno == errno.EFBIG and self._size and not again:
            self._rotate()
            more, failure = self._write(frames[done:], again=True)
            return done + more, failure
        why = capture.write_failure(exc, self.directory)
        return done, CaptureError(f"the call's record could not be written to {self.directory}: {why}")

    def _cut_back(self) -> None:
        """Remove a partly written frame from the open segment, so later frames follow intact ones; a segment
        that cannot be cut is left (unlocked, ``.open``: its torn tail is cut when it is recovered) and the
        next write opens a fresh one."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, self._size)
            return
        except OSError as exc:
            log.error("cutting the failed write off segment=%s failed error=%s", self.current_segment, exc)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd, self._path, self._size = -1, None, 0

    def _failed(self, why: str, records: int) -> None:
        if self.failure is None:
            self.failing_since = time.time()
        self.failure = why
        self.failed_records += records

    def _probe(self) -> None:
        """While writes fail and no record comes: write, sync and remove a small file in the directory; once
        that works (space or descriptors were freed), capture counts as healthy again."""
        probe = self.directory / f".probe-{self.instance}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
                probe.unlink(missing_ok=True)
            if self._fd < 0:
                self._open_segment()
        except OSError as exc:
            self.failure = (
                f"the capture directory {self.directory} is not writable: {capture.write_failure(exc, self.directory)}"
            )
            return
        log.warning("capture directory writable again dir=%s (failing since %s)", self.directory, self.failing_since)
        self.failure = self.failing_since = None


def _fire(arg: tuple[list[Done], int, BaseException | None]) -> None:
    """Tell each record's caller: the first ``done`` are on disk, the others failed with ``error``."""
    callbacks, done, error = arg
    for i, cb in enumerate(callbacks):
        cb(None if i < done else error)
