"""A stand-in worker host (run as ``python -m tests.objstore.host HOME CALLS``): its own proxy in front of a
scripted upstream, captures under ``HOME/captures``, ``CALLS`` chat calls and one result row per rollout.

With ``CLAWPIPE_LAKE_URI`` naming a bucket, the proxy's uploader copies the captures there; the host exits
only after its proxy stopped (the last segment sealed and uploaded).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from clawpipe.keys import mint_key
from clawpipe.proxy import ProxyServer
from tests.lake import fixtures as fx
from tests.support.upstream import ScriptedUpstream, say

SECRET = b"host-secret"


def main(home: Path, calls: int) -> None:
    cap = home / "captures"
    up = ScriptedUpstream(default=say("ok")).start()
    server = ProxyServer(upstreams=[up.url], capture_dir=cap, secret=SECRET, admin_token="admin")
    server.start()
    rollouts = [f"{home.name}-r{i}" for i in range(2)]
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(calls):
                rid = rollouts[i % len(rollouts)]
                key = mint_key(SECRET, run_id="run1", iteration=0, rollout_id=rid)
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"call {i}"}]}
                r = client.post(f"{server.url}/r/{key}/v1/chat/completions", json=body)
                r.raise_for_status()
        fx.write_results(cap, [fx.rollout_row(rid) for rid in rollouts], batch=home.name)
    finally:
        server.stop(drain_timeout_s=5)
        up.stop()
    assert server.writer.uploader is None  # closed: its last pass ran


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
