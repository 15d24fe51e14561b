"""Peak memory of a process tree, sampled in a background thread (the run reports it in its summary)."""

from __future__ import annotations

import os
import threading

import psutil


class PeakMemory:
    """Samples the summed RSS of this process and all its descendants every ``interval`` seconds."""

    def __init__(self, interval: float = 0.5, pid: int | None = None) -> None:
        self.interval = interval
        self.root = psutil.Process(pid or os.getpid())
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-memory", daemon=True)

    def sample(self) -> int:
        total = 0
        procs = [self.root]
        try:
            procs += self.root.children(recursive=True)
        except psutil.Error:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sample()

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20
