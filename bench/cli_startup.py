"""Time `clawpipe --help` (target: under 1 s): median of 9 runs after one warm-up, in a fresh interpreter each.

python bench/cli_startup.py            # prints human lines, then one JSON line
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def main() -> None:
    cmd = [sys.executable, "-m", "clawpipe", "--help"]
    subprocess.run(cmd, capture_output=True, check=True)
    times = []
    for _ in range(9):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    print(f"clawpipe --help: median {median * 1000:.0f} ms over {len(times)} runs (target < 1000 ms)")
    load = [round(x, 1) for x in os.getloadavg()]  # the machine is shared: its load says what the figure means
    print(
        json.dumps({"cli_help_median_ms": round(median * 1000, 1), "runs": len(times), "target_ms": 1000, "load": load})
    )


if __name__ == "__main__":
    main()
