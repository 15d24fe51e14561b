"""Cancelling a rollout shard's flow run on a real Prefect server, as a stopping run does
(``PrefectShards.cancel``, flows/rollout_shard.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.prefect_server import running_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# run in a process of its own: importing the flows sets this process's Prefect settings
SCRIPT = """
import json, sys
from flows.rollout_shard import PrefectShards, get_client
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient
from prefect.states import Completed, Pending, Running, Scheduled

@flow
def shard() -> None: ...

paths = {"scheduled": [], "pending": [Pending()], "running": [Pending(), Running()],
         "completed": [Pending(), Running(), Completed()], "completed_meanwhile": [Pending(), Running()]}
with get_client(sync_client=True) as client:
    runs = {}
    for name, states in paths.items():
        run = client.create_flow_run(shard, state=Scheduled())
        for state in states:
            client.set_flow_run_state(run.id, state)
        runs[name] = run.id
    # the race: the stopping run reads the shard Running, the shard completes, then the cancel is proposed
    stale = client.read_flow_run(runs["completed_meanwhile"])
    client.set_flow_run_state(runs["completed_meanwhile"], Completed())
read = SyncPrefectClient.read_flow_run
SyncPrefectClient.read_flow_run = lambda self, i: stale if i == stale.id else read(self, i)
shards = PrefectShards("pool")
stopping = {name: shards.cancel(str(run_id), "shard s: its run is stopping") for name, run_id in runs.items()}
SyncPrefectClient.read_flow_run = read
with get_client(sync_client=True) as client:
    out = {}
    for name, run_id in runs.items():
        state = client.read_flow_run(run_id).state
        out[name] = [state.type.value, state.message, stopping[name]]
print(json.dumps(out))
"""


def test_a_stopping_run_cancels_shards_by_proposal_and_never_over_an_end(tmp_path: Path) -> None:
    # before: the cancel was forced, so a shard that completed between the read and the write was moved
    # back to Cancelling (and its worker, seeing it Cancelling, had nothing to stop: it stayed there)
    with running_server(tmp_path) as (_api, env):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-4000:]
        states = json.loads(done.stdout.strip().splitlines()[-1])
        assert states["scheduled"] == ["CANCELLED", "shard s: its run is stopping", True]  # no worker has it
        assert states["pending"][::2] == states["running"][::2] == ["CANCELLING", True]  # its worker stops it
        assert states["completed"][::2] == ["COMPLETED", False]
        # refused by the server, not forced over, and told as ended (before: forced back to Cancelling)
        assert states["completed_meanwhile"][::2] == ["COMPLETED", False]
