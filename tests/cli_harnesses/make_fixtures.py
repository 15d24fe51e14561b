"""Record redacted fixtures of what each real CLI sends: tests/cli_harnesses/fixtures/<variant>-<mode>-<n>.json.

Run: .venv/bin/python -m tests.cli_harnesses.make_fixtures [VARIANT ...]   (after scripts/install_cli_harnesses.sh)

A variant is a CLI as the tests run it (support.VARIANTS: the CLI's name, or openclaw-<api> for each API
OpenClaw speaks); all of them without arguments.

Each fixture is one recorded request {"method", "path", "query", "headers", "body"} from a run against the
scripted upstream (first call: a shell tool call, second: text). Keys, ports, work dirs and per-run ids
are replaced by placeholders; the body is otherwise exactly what the CLI sent. Written: the first call of
the full and minimal modes and, for the minimal mode, the follow-up call (tool result in context).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.cli_harnesses.support import REPO, VARIANTS, harness_env, run_launcher, write_task
from tests.support.upstream import ScriptedUpstream, SeenRequest, shell_then_reply

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KEY = "cp1.testkey"


def redact(rec: SeenRequest, *, port: int, workdir: Path) -> dict[str, Any]:
    """A JSON-able fixture of one request with secrets and run-specific values replaced."""
    headers = dict(rec.headers)
    for name in ("authorization", "x-api-key"):
        if name in headers:
            headers[name] = headers[name].replace(KEY, "<key>")
    data = {"method": rec.method, "path": rec.path, "query": rec.params, "headers": headers, "body": rec.json()}
    text = json.dumps(data, indent=1, ensure_ascii=False)
    text = text.replace(str(workdir.resolve()), "<workdir>").replace(str(workdir), "<workdir>")
    text = text.replace(str(REPO), "<repo>")  # OpenClaw names its docs and skills under .node
    text = text.replace(f"127.0.0.1:{port}", "127.0.0.1:<port>").replace(KEY, "<key>")
    text = re.sub(r"\d{4}-\d{2}-\d{2}", "<date>", text)
    return json.loads(text)


def record(variant: str, mode: str) -> tuple[list[SeenRequest], int, Path]:
    harness, _, extra = VARIANTS[variant]
    with (
        tempfile.TemporaryDirectory(prefix="cp-fixture-") as tmp,
        ScriptedUpstream(default=shell_then_reply(), model="tiny") as up,
    ):
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        task = write_task(Path(tmp) / "task.json")
        env = harness_env(up.url, workdir, task, key=KEY, extra={"CLAWPIPE_CLI_MODE": mode, **extra})
        result = run_launcher(harness, env, workdir)
        if result.returncode != 0:
            raise RuntimeError(f"{variant}/{mode} exited {result.returncode}: {result.stderr[-1000:]}")
        reqs = up.model_requests()
        return reqs, up.port, workdir


def main() -> int:
    FIXTURES.mkdir(exist_ok=True)
    for variant in sys.argv[1:] or VARIANTS:
        for mode in ("full", "minimal"):
            reqs, port, workdir = record(variant, mode)
            keep = reqs[:1] if mode == "full" else reqs[:2]
            for n, rec in enumerate(keep, 1):
                path = FIXTURES / f"{variant}-{mode}-{n}.json"
                path.write_text(json.dumps(redact(rec, port=port, workdir=workdir), indent=1, ensure_ascii=False))
                print(f"{path.name}: {len(rec.body)} bytes, {len(rec.json().get('tools') or [])} tools")
    return 0


if __name__ == "__main__":
    sys.exit(main())
