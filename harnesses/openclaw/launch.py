"""openclaw: runs OpenClaw headless through the shared launcher (harnesses/_kit/cli_launcher.py) with this folder's
cli.toml and harness.toml. The kit's path comes from $CLAWPIPE_HARNESS_KIT (harnesses/_kit/README.md)."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CLAWPIPE_HARNESS_KIT") or str(HERE.parent / "_kit"))
import cli_launcher  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli_launcher.main(HERE))
