"""A small disk for tests of what happens when one fills: a tmpfs of a given size (mounting needs root), and a
file that takes all but a given number of bytes of a filesystem's free space."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(path: Path, kib: int) -> Iterator[Path]:
    """A tmpfs of ``kib`` KiB mounted at ``path`` (unmounted afterwards)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path, leave: int) -> Path:
    """A file taking all but ``leave`` bytes of the filesystem's free space."""
    st = os.statvfs(directory)
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler
