"""The real CLIs in bwrap sandboxes, through the capture proxy, in concurrent rollout batches.

Upstream: the scripted server (first call of a rollout: a shell tool call; follow-up: text; token ids in
contract A's shape in docs/ARCHITECTURE.md). Checked per harness: the rollout succeeded with the verifier's reward
(the tool ran
INSIDE the sandbox and wrote into the work dir), exactly two calls were captured, both with upstream token
ids, and the follow-up's prompt ids extend the first call's prompt + completion; landed into the lake and
reconstructed, each rollout's tree is one lineage (the tool result as context). OpenClaw runs over its
three APIs at once in full mode: on Responses it appends (one lineage); on Chat Completions and Messages
it moves its internal-context block after the tool result, and the tree shows that as one `rewrite` branch. A hanging
upstream ends every rollout as a timeout at the outer limit.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clawpipe import capture
from clawpipe.lake.parse import parse_response
from clawpipe.proxy import ProxyServer
from clawpipe.sandbox.manifest import HarnessManifest, find_harness
from clawpipe.sandbox.rollout import RolloutResult, RolloutSpec
from clawpipe.sandbox.runner import run_rollouts
from clawpipe.sandbox.uids import UidPool
from tests.cli_harnesses.support import REPO, VARIANTS, Blackhole, conversation
from tests.support.upstream import ScriptedUpstream, say, shell_then_reply

SECRET = b"cli-harness-test-secret"
COMMAND = "echo sandboxed > tool_ran.txt; id -u; echo marker-$((6*7))"
ONE_API_CLIS = ("claude-code", "codex", "qwen-code")
OPENCLAW = ("openclaw-chat", "openclaw-responses", "openclaw-messages")

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]


class ToolRanTask:
    """A stand-in for a file-based task set: reward 1 when the harness's tool wrote tool_ran.txt."""

    name = "fixit"

    def prepare(self, task: dict[str, Any], workdir: Path) -> None:
        (workdir / "README.txt").write_text("Create tool_ran.txt with the shell.\n")

    def verify(self, task: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
        f = workdir / "tool_ran.txt"
        ok = f.is_file() and f.read_text() == "sandboxed\n"
        return float(ok), {"tool_ran": ok}


def task_for(variant: str) -> dict[str, Any]:
    return {
        "task_set": "fixit",
        "task_id": f"cli-{variant}",
        "prompt": "Create the file tool_ran.txt in the current directory with the shell, then say you are done.",
        "data": {},
        "max_turns": 4,
    }


def manifest_in_mode(variant: str, mode: str) -> HarnessManifest:
    """The variant's manifest with CLAWPIPE_CLI_MODE (and OpenClaw's API) set, as a pipeline entry's env does."""
    harness, _, extra = VARIANTS[variant]
    return find_harness(harness, [REPO / "harnesses"]).with_env({"CLAWPIPE_CLI_MODE": mode, **extra})


def run_batch(
    proxy_url: str,
    tmp: Path,
    *,
    mode: str = "full",
    timeout_s: float = 90,
    variants: tuple[str, ...] = ONE_API_CLIS,
    batch: str = "cli",
) -> list[RolloutResult]:
    """One rollout per variant, all at once; the results in the order of ``variants``."""
    specs = [
        RolloutSpec(run_id="clirun", iteration=0, harness=manifest_in_mode(v, mode), task=task_for(v), model="tiny")
        for v in variants
    ]
    return run_rollouts(
        specs,
        proxy_url=proxy_url,
        backend="bwrap",
        concurrency=len(specs),
        results_path=tmp / "captures" / "results" / "clirun" / "0" / f"results-{batch}.jsonl",
        secret=SECRET,
        scratch_dir=tmp / "scratch",
        task_sets={"fixit": ToolRanTask()},
        harness_dirs=[REPO / "harnesses"],
        max_attempts=1,
        timeout_s=timeout_s,
        keep_workdirs=True,
    )


@pytest.fixture
def proxy_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[ProxyServer] = []

    def make(upstream_url: str, **kw: Any) -> ProxyServer:
        server = ProxyServer(
            upstreams=[upstream_url],
            capture_dir=tmp_path / "captures",
            secret=SECRET,
            admin_token="admin",
            fsync=False,
            **kw,
        )
        server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        s.stop()


def records_by_rollout(capture_dir: Path) -> dict[str, list[capture.CaptureRecord]]:
    out: dict[str, list[capture.CaptureRecord]] = {}
    for path in sorted(capture_dir.glob("*.seg")) + sorted(capture_dir.glob("*.open")):
        for rec in capture.read_segment(path):
            assert isinstance(rec, capture.CaptureRecord)
            out.setdefault(rec.header["rollout_id"], []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r.header["seq"])
    return out


def land_and_build_trees(captures: Path, lake: Path, run_id: str) -> dict[str, dict[str, Any]]:
    """Land the captures and results, build the trees; tree_stats rows of scope rollout by rollout id."""
    from clawpipe import tables
    from clawpipe.lake.landing import land
    from clawpipe.trees.reconstruct import build_trees

    report = land(captures, lake)
    assert report.rejects == 0, report.as_dict()
    build_trees(lake, run_id, 0)
    con = tables.connect(lake)
    query = "select * from tree_stats where scope = 'rollout' and run_id = $run_id"
    rows = con.sql(query, params={"run_id": run_id}).to_arrow_table().to_pylist()
    return {r["rollout_id"]: r for r in rows}


def check_two_call_rollout(
    variant: str, r: RolloutResult, recs: list[capture.CaptureRecord], *, extends: bool = True
) -> None:
    """A succeeded rollout with reward 1 whose two calls were captured with upstream ids; the follow-up
    extends the first call (``extends``) or, after OpenClaw's rewrite, extends all of it but the moved block."""
    api = VARIANTS[variant][1]
    assert r.status == "succeeded", (variant, r.status, r.error, r.stderr_tail[-1500:])
    assert r.exit_code == 0 and r.reward == 1.0, (variant, r.reward_info)
    assert r.n_calls == 2, (variant, r.n_calls)
    work = Path(r.workdir or "")
    assert (work / "home").is_dir() and (work / "out").is_dir()
    assert len(recs) == 2, variant
    calls = []
    for rec in recs:
        h = rec.header
        assert (h["api"], h["status"], h["stream"], h["token_source"]) == (api, "ok", True, "upstream"), h
        assert h["request_changes"]["added"]["return_token_ids"] is True
        calls.append(parse_response(api, True, rec.response, http_status=h["http_status"]))
    first_req, second_req = (json.loads(rec.request) for rec in recs)
    c1, c2 = conversation(api, first_req), conversation(api, second_req)
    if not extends:  # the last message of the first call moved after the tool call and its result
        assert c2[-1] == c1[-1] and len(c2) == len(c1) + 2, variant
        c1, c2 = c1[:-1], c2[:-1]
    assert c2[: len(c1)] == c1, f"{variant}: the follow-up extends the first request"
    tool_ctx = json.dumps(c2[len(c1) :])
    pool = UidPool.from_settings()  # `id -u` printed a uid of the sandbox's own from the clawpipe range
    uids = [int(n) for n in re.findall(r"\d+", tool_ctx)]
    assert "marker-42" in tool_ctx and any(pool.base <= u < pool.base + pool.count for u in uids), (
        f"{variant}: ran inside the sandbox as its own uid"
    )
    lineage = list(calls[0].prompt_token_ids or []) + list(calls[0].choices[0].token_ids or [])
    second_prompt = list(calls[1].prompt_token_ids or [])
    assert lineage and len(second_prompt) > len(lineage)
    assert (second_prompt[: len(lineage)] == lineage) is extends, f"{variant}: ids extend (one lineage) or not"


def test_each_cli_in_bwrap_through_the_proxy(tmp_path: Path, proxy_factory: Any, cli_installed: None) -> None:
    with ScriptedUpstream(default=shell_then_reply(COMMAND), model="tiny") as up:
        proxy = proxy_factory(up.url)
        results = run_batch(proxy.url, tmp_path)
        proxy.stop()
    by_harness = dict(zip(ONE_API_CLIS, results, strict=True))
    captured = records_by_rollout(tmp_path / "captures")
    for harness in ONE_API_CLIS:
        r = by_harness[harness]
        check_two_call_rollout(harness, r, captured[r.rollout_id])
    # Landed and reconstructed: each rollout's tree is one lineage (2 calls, 1 leaf, no branch of any kind).
    stats = land_and_build_trees(tmp_path / "captures", tmp_path / "lake", "clirun")
    for harness in ONE_API_CLIS:
        row = stats[by_harness[harness].rollout_id]
        assert (row["n_calls"], row["n_leaves"], row["kept_out_retokenized"], row["failed_calls"]) == (2, 1, 0, 0), row
        branches = [row[k] for k in row if k.startswith("branches_")]
        assert sum(branches) == 0 and row["drift_count"] == 0, row
    # Attribution: every capture carries the rollout that its sandbox's key names.
    for rollout_id, recs in captured.items():
        assert {rec.header["run_id"] for rec in recs} == {"clirun"}
        assert rollout_id in {r.rollout_id for r in results}


def test_openclaw_over_its_three_apis_in_bwrap(tmp_path: Path, proxy_factory: Any, cli_installed: None) -> None:
    """OpenClaw on Node 24 in bwrap (its /tmp writes land in the sandbox's private /tmp), full mode, over Chat
    Completions, Responses and Messages at once. The trees: one lineage on Responses (it appends); on the other two its
    follow-up moves the internal-context block after the tool result, a genuine history rewrite: two
    leaves and one `rewrite` branch (not drift: no completion was re-encoded; not a retry or subagent)."""
    with ScriptedUpstream(default=shell_then_reply(COMMAND), model="tiny") as up:
        proxy = proxy_factory(up.url)
        results = run_batch(proxy.url, tmp_path, mode="full", timeout_s=240, variants=OPENCLAW, batch="openclaw")
        proxy.stop()
    captured = records_by_rollout(tmp_path / "captures")
    by_variant = dict(zip(OPENCLAW, results, strict=True))
    for variant, r in by_variant.items():
        print(f"{variant}: {r.status} {r.duration_s:.1f} s, {r.n_calls} calls")
        check_two_call_rollout(variant, r, captured[r.rollout_id], extends=variant == "openclaw-responses")
        envelope = json.loads((Path(r.workdir or "") / "out" / "openclaw.json").read_text())
        assert (envelope["status"], envelope["final"], envelope["provider"]) == (
            "ok",
            "All done.",
            f"clawpipe-{VARIANTS[variant][1]}",
        )
    stats = land_and_build_trees(tmp_path / "captures", tmp_path / "lake", "clirun")
    for variant, r in by_variant.items():
        row = stats[r.rollout_id]
        branches = {k.removeprefix("branches_"): v for k, v in row.items() if k.startswith("branches_") and v}
        print(f"{variant}: tree n_calls={row['n_calls']} n_leaves={row['n_leaves']} branches={branches}")
        assert row["n_calls"] == 2 and row["drift_count"] == 0 and row["failed_calls"] == 0, row
        if variant == "openclaw-responses":
            assert (row["n_leaves"], branches) == (1, {}), row
        else:
            assert (row["n_leaves"], branches) == (2, {"rewrite": 1}), row


def test_hanging_endpoint_every_cli_rollout_ends_as_timeout(
    tmp_path: Path, proxy_factory: Any, cli_installed: None
) -> None:
    hole = Blackhole()
    try:
        proxy = proxy_factory(hole.url, upstream_timeout_s=120.0)
        results = run_batch(proxy.url, tmp_path, mode="minimal", timeout_s=6, variants=(*ONE_API_CLIS, "openclaw-chat"))
    finally:
        hole.close()
    for r in results:
        assert r.status == "timeout", (r.harness, r.status, r.error, r.stderr_tail[-800:])
        assert 6 <= r.duration_s < 30, (r.harness, r.duration_s)


def test_qwen_memory_side_call_lands_as_its_own_lineage(
    tmp_path: Path, proxy_factory: Any, cli_installed: None
) -> None:
    """Qwen Code with managed auto-memory ON (the shipped cli.toml turns it off) follows a text-only turn
    with a memory-extraction call under the same model name: captured like any call, its own lineage."""
    variant = tmp_path / "harnesses" / "qwen-code"
    shutil.copytree(REPO / "harnesses" / "qwen-code", variant)
    shutil.copytree(REPO / "harnesses" / "_kit", variant.parent / "_kit")  # the shared launcher sits beside it
    cli = (variant / "cli.toml").read_text()
    assert "enableManagedAutoMemory = false" in cli
    (variant / "cli.toml").write_text(cli.replace("enableManagedAutoMemory = false", "enableManagedAutoMemory = true"))
    base = find_harness("qwen-code", [REPO / "harnesses"])
    manifest = dataclasses.replace(base, dir=variant.resolve(), env={**base.env, "CLAWPIPE_CLI_MODE": "full"})
    with ScriptedUpstream(default=say("All done."), model="tiny") as up:
        proxy = proxy_factory(up.url)
        [result] = run_rollouts(
            [RolloutSpec(run_id="clirun", iteration=0, harness=manifest, task=task_for("qwen-code"), model="tiny")],
            proxy_url=proxy.url,
            backend="bwrap",
            results_path=tmp_path / "captures" / "results" / "clirun" / "0" / "results-mem.jsonl",
            secret=SECRET,
            scratch_dir=tmp_path / "scratch",
            task_sets={"fixit": ToolRanTask()},
            max_attempts=1,
            timeout_s=120,
        )
        proxy.stop()
    assert result.status == "succeeded", (result.status, result.error, result.stderr_tail[-1500:])
    [recs] = records_by_rollout(tmp_path / "captures").values()
    systems = [json.loads(rec.request)["messages"][0]["content"] for rec in recs]
    assert len(recs) == 2 and "memory extraction" in systems[1] and "memory extraction" not in systems[0]
    assert {json.loads(rec.request)["model"] for rec in recs} == {"tiny"}, "same model name as the main call"
    row = land_and_build_trees(tmp_path / "captures", tmp_path / "lake", "clirun")[result.rollout_id]
    # The side call does not extend the main lineage: a second leaf, classified as a subagent branch.
    assert (row["n_calls"], row["n_leaves"], row["branches_subagent"]) == (2, 2, 1), row
