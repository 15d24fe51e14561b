"""Starting a distributed training step: the command line of torch.distributed's elastic launcher.

``clawpipe train --nproc N`` (and the pipeline's ``train = { nproc = N }``) run the step as N ranks of
``python -m clawpipe train`` under ``python -m torch.distributed.run``: ``--standalone`` (a local
rendezvous) on one node, or ``--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` across nodes
(the same command on every node). Each rank sees WORLD_SIZE > 1 and runs its share
(clawpipe.train.distributed); a rank's failure ends the whole launch with a non-zero code.
Imports no torch: the pipeline's flow builds these commands.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from clawpipe.errors import ConfigError, TrainingError

log = logging.getLogger(__name__)


def launcher_command(
    nproc: int, *, nnodes: int = 1, rdzv_endpoint: str | None = None, rdzv_id: str = "clawpipe"
) -> list[str]:
    """``python -m torch.distributed.run ... -m clawpipe train`` (append the train options)."""
    if nproc < 1 or nnodes < 1:
        raise ConfigError(f"nproc and nnodes must be >= 1 (got nproc={nproc}, nnodes={nnodes})")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ConfigError(
                f"nnodes = {nnodes} needs rdzv_endpoint = 'HOST:PORT' "
                "(a port on the first node that every node reaches)"
            )
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    else:
        cmd.append("--standalone")
    return [*cmd, "-m", "clawpipe", "train"]


def step_arguments(
    run_id: str,
    iteration: int,
    *,
    config: Path,
    policy: Path,
    out: Path,
    metrics_out: Path,
    mlflow_run_id: str | None,
    track: bool = True,
) -> list[str]:
    """The ``clawpipe train`` options every rank gets (the config as the JSON file the parent validated)."""
    # --run-id, not --run: the launcher's parser would take --run as an abbreviation of its --run-path
    args = ["--run-id", run_id, "--iteration", str(iteration), "--config", str(config), "--policy", str(policy)]
    args += ["--out", str(out), "--metrics-out", str(metrics_out)]
    if mlflow_run_id:
        args += ["--mlflow-run-id", mlflow_run_id]
    elif not track:
        args.append("--no-track")
    return args


def run_distributed(command: list[str], metrics_out: Path, *, output: IO[Any] | int | None = None) -> dict[str, Any]:
    """Run the launcher; the step's {checkpoint, policy_version, metrics} that rank 0 wrote."""
    metrics_out.unlink(missing_ok=True)
    log.info("distributed training step: %s", " ".join(command))
    code = subprocess.run(command, stdout=output, check=False).returncode
    if code != 0:
        raise TrainingError(
            f"the distributed training step failed (launcher exit code {code}); each rank's traceback is in the "
            "log above it"
        )
    try:
        return dict(json.loads(metrics_out.read_text()))
    except (OSError, ValueError) as exc:
        raise TrainingError(f"the distributed step ended without its metrics file {metrics_out}: {exc}") from exc
