"""Injected faults for retry tests: a stage fails once, after doing (part of) its work.

``CLAWPIPE_INJECT_FAULTS=land_batch@0,reconstruct_batch@1`` makes each named stage fail once at that
iteration. A marker file under the runs directory remembers that the fault fired, so the retry (or a
resumed run) goes through; that is what proves a retried stage leaves exactly-once data.
"""

from __future__ import annotations

from clawpipe.config import get_settings


def inject_fault(stage: str, iteration: int) -> None:
    """Raise once at ``stage@iteration`` when CLAWPIPE_INJECT_FAULTS asks for it; otherwise do nothing."""
    settings = get_settings()
    wanted = {f.strip() for f in settings.inject_faults.split(",") if f.strip()}
    point = f"{stage}@{iteration}"
    if point not in wanted:
        return
    marker = settings.runs_dir / "faults" / point
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    raise RuntimeError(f"injected fault at {point} (CLAWPIPE_INJECT_FAULTS)")
