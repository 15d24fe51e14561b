"""Register the pipeline flow as a Prefect deployment on a process work pool (``clawpipe deploy``).

Needs a real Prefect server (PREFECT_API_URL): an ephemeral server cannot schedule
(docs/ARCHITECTURE.md, "Pitfalls measured on these machines").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from pathlib import Path

from clawpipe.config import prepare_environment
from clawpipe.configfile import read_config
from clawpipe.pipeline.config import PipelineConfig

prepare_environment()

from prefect import flow  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.actions import WorkPoolCreate  # noqa: E402
from prefect.exceptions import ObjectAlreadyExists  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def ensure_pool(name: str) -> None:
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


def deploy(*, pool: str, name: str, config: PipelineConfig, cron: str | None) -> str:
    ensure_pool(pool)
    source = flow.from_source(source=str(ROOT), entrypoint="flows/pipeline.py:pipeline")
    if isinstance(source, Coroutine):  # from_source is sync here; the union is for async callers
        raise TypeError("flow.from_source returned a coroutine in a sync context")
    deployment_id = source.deploy(
        name=name,
        work_pool_name=pool,
        cron=cron,
        parameters={"cfg": config.model_dump(mode="json")},
        build=False,
        push=False,
        print_next_steps=False,
    )
    return str(deployment_id)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.deploy")
    p.add_argument("--pool", default="clawpipe")
    p.add_argument("--name", default="clawpipe-pipeline")
    p.add_argument("--config-file", help="validated PipelineConfig (written by clawpipe.configfile)")
    p.add_argument("--cron")
    a = p.parse_args(argv)
    dep = deploy(
        pool=a.pool,
        name=a.name,
        config=read_config(PipelineConfig, a.config_file) if a.config_file else PipelineConfig(),
        cron=a.cron,
    )
    print(f"deployment pipeline/{a.name} id {dep} on pool {a.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
