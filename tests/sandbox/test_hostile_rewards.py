"""Rewards that are not numbers: a task set's verifier handing back a string, a bool, None, NaN or an
infinity makes that rollout's row an infra error naming the value (never a reward of 1.0 from ``True`` or
``"1"``), and reward info holding NaN or text that is not UTF-8 is written as plain JSON; the neighbours
are scored as usual."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from clawpipe.sandbox import RolloutSpec, load_manifest, run_rollouts
from tests.sandbox.support import URLLIB_HARNESS, EchoTaskSet, Upstream, make_harness

ODD_REWARDS: dict[str, Any] = {
    "string": "1",
    "bool": True,
    "none": None,
    "nan": math.nan,
    "inf": math.inf,
    "list": [1.0],
}


class OddRewards(EchoTaskSet):
    """The echo task set, whose verifier returns the reward named by the task's data.kind."""

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[Any, dict[str, Any]]:
        kind = task["data"]["kind"]
        if kind == "odd_info":
            return 0.5, {
                "ratio": math.nan,
                "peak": -math.inf,
                "name": "bad-\udcff-byte",
                "nested": [math.inf, "\ud800"],
            }
        if kind == "honest":
            return super().verify(task, workdir)
        return ODD_REWARDS[kind], {}


@pytest.mark.sandbox
def test_rewards_that_are_not_numbers_are_refused_by_name_and_odd_info_is_plain_json(
    tmp_path: Path, upstream: Upstream
) -> None:
    ts = OddRewards()
    m = load_manifest(make_harness(tmp_path, "h", URLLIB_HARNESS))
    kinds = [*ODD_REWARDS, "odd_info", "honest"]
    specs = []
    for i, kind in enumerate(kinds):
        task = {**ts.generate(1, seed=i)[0], "data": {"answer": "42", "kind": kind}}
        specs.append(RolloutSpec(run_id="w", iteration=0, harness=m, task=task, model="m", rollout_id=kind))
    res = {
        r.rollout_id: r
        for r in run_rollouts(
            specs,
            proxy_url=upstream.url,
            backend="bwrap",
            concurrency=4,
            results_path=tmp_path / "results.jsonl",
            secret=b"s",
            scratch_dir=tmp_path / "scratch",
            task_sets={"echo": ts},
        )
    }
    for kind, value in ODD_REWARDS.items():
        r = res[kind]
        assert (r.status, r.reward) == ("infra_error", None), (kind, r.status, r.reward)
        assert "reward" in (r.error or "") and repr(value) in (r.error or ""), (kind, r.error)
    assert (res["honest"].status, res["honest"].reward) == ("succeeded", 1.0)
    odd = res["odd_info"]
    assert (odd.status, odd.reward) == ("succeeded", 0.5), odd.error
    rows = {}
    for line in (tmp_path / "results.jsonl").read_bytes().splitlines():
        row = json.loads(line.decode("utf-8"))
        rows[row["rollout_id"]] = row
    assert sorted(rows) == sorted(kinds)
    info = json.loads(rows["odd_info"]["reward_info"], parse_constant=lambda c: pytest.fail(f"{c} in reward_info"))
    assert info == {"ratio": "nan", "peak": "-inf", "name": "bad-\\xff-byte", "nested": ["inf", "\\xed\\xa0\\x80"]}
