"""A container the engine created but failed to start (it does so under load: "cannot start a stopped
process") is removed with its rollout. The SDK's ``containers.run`` raised without handing back the container it
had created, so a holder whose start failed outlived the rollout. The engine is real; only the start of the
first container is made to fail, as the engine's would."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from clawpipe.sandbox import load_manifest
from clawpipe.sandbox.backends.docker import LABEL, DockerBackend
from tests.sandbox.support import URLLIB_HARNESS, EchoTaskSet, Upstream, make_harness
from tests.sandbox.test_runner import run, specs_for


@pytest.mark.docker
def test_a_container_whose_start_failed_is_removed_and_the_rollout_retried(
    tmp_path: Path, upstream: Upstream, echo: EchoTaskSet, docker_host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from docker.models.containers import ContainerCollection

    created: list[Any] = []
    create = ContainerCollection.create

    def create_failing_first_start(self: ContainerCollection, *args: Any, **kwargs: Any) -> Any:
        container = create(self, *args, **kwargs)
        created.append(container.name)
        if len(created) == 1:

            def start(**_: Any) -> None:
                raise docker.errors.APIError("cannot start a stopped process: unknown")

            container.start = start
        return container

    monkeypatch.setattr(ContainerCollection, "create", create_failing_first_start)  # the SDK's run() calls it too
    backend = DockerBackend()
    try:
        m = load_manifest(make_harness(tmp_path, "chat", URLLIB_HARNESS))
        (result,) = run(specs_for(m, echo, 1), upstream, tmp_path, echo, backend=backend, max_attempts=2)
        assert (result.status, result.attempt, result.reward) == ("succeeded", 2, 1.0), result.error
        assert created[0].startswith("cp-hold")  # the one whose start failed
        client = docker.from_env()
        left = client.containers.list(all=True, filters={"label": LABEL})
        assert left == [], [(c.name, c.status) for c in left]
    finally:
        backend.close()
