"""A rollout whose calls went through two proxies, landed from two real capture segments: each proxy numbers
the rollout's calls from 0, so their seq numbers clash, and the trees order such a rollout by the time each
proxy took the request. A re-encoded answer is then drift (not a retry of the call that sampled it), and a
request re-sent through the other proxy is the retry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from clawpipe.lake import land
from clawpipe.lake.query import run_audits
from clawpipe.trees import build_iteration
from tests.apis import captures as cx
from tests.lake import fixtures as fx
from tests.trees.fixtures import locate, read_stats, read_tree

T0 = 1_764_650_000.0
CAUSES = ("retry", "choice", "rewrite", "subagent", "drift")


class TwoProxies:
    """Chat calls of one rollout, each through proxy "a" or "b", numbered per proxy as the proxy does."""

    def __init__(self) -> None:
        self.frames: dict[str, list[bytes]] = {"a": [], "b": []}
        self.n = 0

    def call(self, proxy: str, request: dict[str, Any], text: str, *, sampled: list[int] | None = None) -> list[int]:
        """Send ``request`` through ``proxy``; the engine answers ``text`` with ids ``sampled`` (default: the ids
        the template gives the answer when it is sent back). Returns the sampled ids."""
        msg = {"role": "assistant", "content": text}
        ids = sampled if sampled is not None else cx.answer_ids("chat", request, msg)
        body = {
            "id": f"chatcmpl-{self.n}",
            "object": "chat.completion",
            "model": "m",
            "prompt_token_ids": cx.prompt_ids("chat", request),
            "choices": [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": "stop",
                    "token_ids": ids,
                    "logprobs": {"content": [{"token": "t", "logprob": -0.5, "top_logprobs": []} for _ in ids]},
                }
            ],
        }
        seq = len(self.frames[proxy])
        self.frames[proxy].append(
            cx.record(
                "chat",
                request,
                json.dumps(body).encode(),
                stream=False,
                seq=seq,
                call_id=f"call{self.n}",
                t_start=T0 + self.n,
            )
        )
        self.n += 1
        return ids

    def land_and_build(self, tmp_path: Path) -> Path:
        for proxy, frames in self.frames.items():  # one segment per proxy
            fx.write_segment(tmp_path / "cap" / f"{proxy}-000001.seg", frames)
        fx.write_results(tmp_path / "cap", [fx.rollout_row("r0", run_id=cx.RUN, reward=1.0)])
        report = land(tmp_path / "cap", tmp_path / "lake")
        assert (report.calls, report.rejects, report.segments) == (self.n, 0, 2)
        lake = tmp_path / "lake"
        assert len(cx.calls(lake)) == self.n
        build_iteration(lake, cx.RUN, 0)
        # the label audit ranks the calls as the builder does: the labels it gave are backed, not offending
        offending = {name: t.num_rows for name, t in run_audits(lake).items() if t.num_rows}
        assert offending == {}
        return lake


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_an_answer_re_encoded_by_a_call_through_the_other_proxy_is_drift_not_a_retry(tmp_path: Path) -> None:
    h = TwoProxies()
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}, _user("Count to three.")]
    for turn, word in enumerate(("one", "two")):  # proxy a: seq 0 and 1
        h.call("a", {"model": "m", "messages": history}, word)
        history = [*history, {"role": "assistant", "content": word}, _user(f"next {turn}")]
    third = {"model": "m", "messages": history}
    canonical = cx.answer_ids("chat", third, {"role": "assistant", "content": "three !"})
    sampled = [canonical[0], 7, *canonical[2:]]  # the engine sampled other ids for " " than the template gives
    h.call("a", third, "three !", sampled=sampled)  # proxy a: seq 2
    history = [*history, {"role": "assistant", "content": "three !"}, _user("done?")]
    h.call("b", {"model": "m", "messages": history}, "yes")  # proxy b: seq 0, the rollout's last call
    lake = h.land_and_build(tmp_path)

    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    assert {c: stats[f"branches_{c}"] for c in CAUSES} == {**dict.fromkeys(CAUSES, 0), "drift": 1}
    labelled = [n for n in nodes if n["branch_cause"]]
    assert len(labelled) == 1
    drift = labelled[0]
    assert not drift["generated"] and drift["drift_call_id"] == "call2"
    # the answer call2 sampled is one generated path, trained once, and carries no label
    third_path = locate(nodes, cx.prompt_ids("chat", third) + sampled)
    assert third_path is not None
    assert all(nodes[v]["branch_cause"] is None for v in third_path)
    gens = [nodes[v]["call_id"] for v in third_path if nodes[v]["generated"]]
    assert gens[-len(gens) + 2 :] == ["call2"] * (len(gens) - 2) and gens[:2] == ["call0", "call1"]
    assert nodes[third_path[-1]]["generated"] and nodes[third_path[-1]]["call_id"] == "call2"


def test_a_request_re_sent_through_the_other_proxy_is_the_retry(tmp_path: Path) -> None:
    h = TwoProxies()
    history: list[dict[str, Any]] = [_user("Name a colour.")]
    h.call("a", {"model": "m", "messages": history}, "red")  # a: seq 0
    history = [*history, {"role": "assistant", "content": "red"}, _user("Another.")]
    request = {"model": "m", "messages": history}
    h.call("a", request, "blue")  # a: seq 1; the harness gives up waiting and re-sends through b
    h.call("b", request, "green")  # b: seq 0
    lake = h.land_and_build(tmp_path)

    nodes = read_tree(lake, cx.RUN, 0, "rollout:r0")
    stats = read_stats(lake, cx.RUN, 0)["rollout:r0"]
    assert {c: stats[f"branches_{c}"] for c in CAUSES} == {**dict.fromkeys(CAUSES, 0), "retry": 1}
    (retry,) = [n for n in nodes if n["branch_cause"]]
    assert retry["branch_cause"] == "retry" and retry["generated"] and retry["call_id"] == "call2"
