"""Rollouts fanned out as shards: splitting, the rerun id rule, the pipeline's watch over shards, and the host
proxy shared by a host's shards. The whole fanned-out run (two worker hosts, a real Prefect server, a real S3
server, a worker killed mid-shard) is tests/objstore/test_scale_out.py, beside the S3 server fixture."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import fsspec
import httpx
import pytest

from clawpipe.config import Settings
from clawpipe.errors import ConfigError, Halted, SandboxError
from clawpipe.pipeline import attempts, fanout, shards
from clawpipe.pipeline.config import HarnessEntry, PipelineConfig
from clawpipe.pipeline.stages import sample_specs

CHAT_LOOP = [HarnessEntry(name="chat-loop", task_set="guess")]

# --- splitting and ids -------------------------------------------------------------------------------


def test_split_makes_even_consecutive_shards() -> None:
    items = list(range(10))
    parts = shards.split(items, 4)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert [x for p in parts for x in p] == items  # nothing lost, nothing twice, order kept
    assert shards.split(items, 10) == [items]
    assert shards.split([], 3) == []
    assert [len(p) for p in shards.split(list(range(9)), 2)] == [2, 2, 2, 2, 1]
    with pytest.raises(ConfigError, match="shard_size"):
        shards.split(items, 0)


def test_rerun_ids_follow_the_attempt_rule() -> None:
    assert attempts.attempt_id("g.0", 1) == "g.0"
    assert attempts.attempt_id("g.0", 3) == "g.0.a3"
    assert attempts.attempt_ids("g.0", 3) == ["g.0", "g.0.a2", "g.0.a3"]
    done = {"g.0": {"rollout_id": "g.0"}, "g.1.a2": {"rollout_id": "g.1.a2"}}
    kept, todo = attempts.plan(["g.0", "g.1", "g.2"], done, 3)
    assert kept == {"g.0": done["g.0"], "g.1": done["g.1.a2"]}  # a row under any earlier id is kept
    assert todo == [("g.2", "g.2.a3")]  # the rest runs under an id never used before
    kept, todo = attempts.plan(["g.0", "g.1"], {}, 1)
    assert kept == {} and todo == [("g.0", "g.0"), ("g.1", "g.1")]


def test_attempt_counter_survives_a_new_process(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "r" / "shards" / "rollout-0.attempt"
    assert [attempts.AttemptCounter(path).next() for _ in range(3)] == [1, 2, 3]
    assert attempts.AttemptCounter(path).current == 3


def test_shard_request_travels_as_plain_json() -> None:
    req = shards.ShardRequest(
        cfg={"samples": 2}, run_id="r", iteration=0, batch_id="rollout-0", index=1, attempt=2, policy_version=3,
        evaluation=False, rollout_ids={"g.0": "g.0.a2"}, upstreams=["http://127.0.0.1:1/v1"],
    )  # fmt: skip
    again = shards.ShardRequest.from_params(json.loads(json.dumps(req.to_params())))
    assert again == req and again.key == "rollout-0.s1.a2"


def test_a_fanned_out_run_needs_an_object_store_lake(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, lake_uri=str(tmp_path / "lake"))
    with pytest.raises(ConfigError, match="CLAWPIPE_LAKE_URI"):
        shards.lake_uri_of(settings)


def test_worker_hosts_reach_the_policy_server_by_the_advertised_name() -> None:
    import socket

    from clawpipe.pipeline.services import advertised_host

    assert advertised_host("127.0.0.1") == "127.0.0.1"
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0") == socket.getfqdn()  # bound everywhere: reached by this host's name


# --- the pipeline's watch, against a scripted runner (beside the real run below) ------------------------


class ScriptedRunner:
    """Shards "run" by writing their rows to the lake; the ones named in ``stall`` start, beat once, then stop
    beating (a killed worker whose flow run stays RUNNING); those in ``starting`` stay taken by a worker and
    never beat (a worker killed while starting the flow run's process: it stays PENDING)."""

    def __init__(self, lake: str, stall: set[int], starting: frozenset[int] = frozenset()) -> None:
        self.lake, self.stall, self.starting = lake, stall, starting
        self.reqs: dict[str, shards.ShardRequest] = {}
        self.given_up: dict[str, str] = {}
        self.cancelled: dict[str, str] = {}

    def submit(self, req: shards.ShardRequest) -> str:
        handle = f"h{len(self.reqs)}"
        self.reqs[handle] = req
        if req.index not in self.starting:
            fs, path = fsspec.core.url_to_fs(shards.shard_state_path(self.lake, req, ".json"))
            fs.pipe_file(path, b'{"beat": 1}')
        return handle

    def state(self, handle: str) -> str:
        req = self.reqs[handle]
        if handle in self.given_up:
            return "failed"
        if req.index in self.stall:
            return "running"
        if req.index in self.starting:
            return "starting"
        rows = "".join(
            json.dumps({"rollout_id": rid, "status": "ok", "reward": 1.0, "harness": "chat-loop"}) + "\n"
            for rid in req.rollout_ids.values()
        )
        fs, path = fsspec.core.url_to_fs(shards.results_url(self.lake, "hostA", req))
        fs.pipe_file(path, rows.encode())
        return "completed"

    def give_up(self, handle: str, reason: str) -> None:
        self.given_up[handle] = reason

    def cancel(self, handle: str, reason: str) -> bool:
        self.cancelled[handle] = reason
        return True


class Clock:
    """Fake time for the pipeline's watch: ``sleep`` advances it, then runs ``on_sleep(now)`` (what the
    shards do meanwhile)."""

    def __init__(self, on_sleep: Callable[[float], None] | None = None) -> None:
        self.now = 0.0
        self.on_sleep = on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep:
            self.on_sleep(self.now)


def _watch(tmp_path: Path, cfg: PipelineConfig, runner: ScriptedRunner, clock: Clock) -> fanout.FanOut:
    """Batch 0 of run1 fanned out over ``runner`` with the fake ``clock``."""
    specs = sample_specs(cfg, "run1", 0, policy_version=0)
    counter = attempts.AttemptCounter(tmp_path / "attempt")
    return fanout.FanOut(
        cfg, specs, runner, runner.lake, "rollout-0", ["http://u/v1"], counter, clock=clock, sleep=clock.sleep
    )


def _memory_lake() -> str:
    return f"memory://lake-{uuid.uuid4().hex[:8]}"


def _stall_cfg(**kw: object) -> PipelineConfig:
    return PipelineConfig(shard_size=2, backend="process", eval_tasks=0, harnesses=CHAT_LOOP, **kw)  # type: ignore[arg-type]


def test_a_stalled_shard_is_fenced_and_rerun_under_new_ids(tmp_path: Path) -> None:
    runner = ScriptedRunner(_memory_lake(), stall={1})
    clock = Clock()
    fan = _watch(tmp_path, _stall_cfg(groups=2, samples=3, shard_stall_s=10), runner, clock)
    out = fan.run()
    assert out["n"] == len(fan.specs) == 6
    assert [r.key for r in fan.submitted] == [
        "rollout-0.s0.a1",
        "rollout-0.s1.a1",
        "rollout-0.s2.a1",
        "rollout-0.s3.a2",
    ]
    stalled, rerun = fan.submitted[1], fan.submitted[3]
    assert fan.given_up == [stalled.key] and "heartbeat stopped" in runner.given_up["h1"]
    assert list(rerun.rollout_ids) == list(stalled.rollout_ids)  # the same rollouts, in the same groups ...
    assert list(rerun.rollout_ids.values()) == [f"{sid}.a2" for sid in stalled.rollout_ids]  # ... under new ids
    assert 10 < clock.now < 20  # noticed once the heartbeat had been still for shard_stall_s
    # a late upload by the stalled shard is refused: the decision it would claim is taken
    assert shards.decide(runner.lake, stalled, shards.PUBLISHED) == shards.GIVEN_UP


def test_a_shard_that_claimed_its_rows_first_is_awaited_not_rerun(tmp_path: Path) -> None:
    """The shard decides to publish just as its heartbeat goes quiet for shard_stall_s: the pipeline's
    give-up loses the conditional create, waits for the rows and reruns nothing (the group stays whole)."""
    runner = ScriptedRunner(_memory_lake(), stall={1})

    def slow_shard(now: float) -> None:
        slow = next(r for r in runner.reqs.values() if r.index == 1)
        if now >= 9:
            shards.decide(runner.lake, slow, shards.PUBLISHED)  # it claims its rows (later calls find them claimed)
        if now >= 14:
            runner.stall.discard(1)  # its one upload lands a few seconds after its claim

    fan = _watch(tmp_path, _stall_cfg(groups=2, samples=3, shard_stall_s=10), runner, Clock(slow_shard))
    out = fan.run()
    assert out["n"] == 6 and fan.given_up == [] and runner.given_up == {}
    assert [r.key for r in fan.submitted] == ["rollout-0.s0.a1", "rollout-0.s1.a1", "rollout-0.s2.a1"]
    assert shards.decide(runner.lake, fan.submitted[1], shards.GIVEN_UP) == shards.PUBLISHED


def test_a_shard_taken_by_a_worker_that_died_starting_it_is_rerun(tmp_path: Path) -> None:
    runner = ScriptedRunner(_memory_lake(), stall=set(), starting=frozenset({0}))
    clock = Clock()
    cfg = _stall_cfg(groups=1, samples=4, shard_stall_s=10, shard_start_s=30)
    fan = _watch(tmp_path, cfg, runner, clock)
    assert fan.run()["n"] == 4
    assert fan.given_up == ["rollout-0.s0.a1"] and "no heartbeat" in runner.given_up["h0"]
    assert 30 < clock.now < 40  # the longer start allowance, not shard_stall_s, applied before any heartbeat
    assert list(fan.submitted[-1].rollout_ids.values()) == [f"{sid}.a2" for sid in fan.submitted[0].rollout_ids]


def test_a_batch_whose_shards_never_finish_fails_clearly(tmp_path: Path) -> None:
    runner = ScriptedRunner(_memory_lake(), stall={0, 1, 2})
    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=2, shard_stall_s=5), runner, Clock())
    with pytest.raises(SandboxError, match="no result after 3 attempts"):
        fan.run()
    assert len(fan.submitted) == 3 and len(fan.given_up) == 3


def test_a_stopping_run_cancels_the_shards_it_watches_and_starts_no_more(tmp_path: Path) -> None:
    """An async run stopping (``halt`` set from its loop) while two shards run: both are fenced and cancelled
    on their workers, no shard is submitted after, and the batch raises Halted (no result rows are made up)."""
    halt = threading.Event()
    runner = ScriptedRunner(_memory_lake(), stall={0, 1})
    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=4), runner, Clock(lambda now: now >= 4 and halt.set()))
    fan.halt = halt
    with pytest.raises(Halted, match="batch rollout-0: the run is stopping; 2 shards cancelled"):
        fan.run()
    assert sorted(runner.cancelled) == ["h0", "h1"] and len(fan.submitted) == 2 and not runner.given_up
    assert "its run is stopping" in runner.cancelled["h0"]
    for req in fan.submitted:  # a shard that goes on regardless cannot publish rows
        assert shards.decide(runner.lake, req, shards.PUBLISHED) == shards.GIVEN_UP


def test_a_shard_ending_as_the_run_stops_is_not_rerun(tmp_path: Path) -> None:
    """The halt comes while the watch polls: the shard it finds ended without rows (its rollouts would run
    again under new ids) is not resubmitted; the one still running is cancelled."""
    halt = threading.Event()
    runner = ScriptedRunner(_memory_lake(), stall={1})
    state = runner.state

    def ended_without_rows(handle: str) -> str:
        if runner.reqs[handle].index == 0:
            halt.set()  # the run stops just as the watch finds shard 0 over
            return "failed"
        return state(handle)

    runner.state = ended_without_rows  # type: ignore[method-assign]
    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=4), runner, Clock())
    fan.halt = halt
    with pytest.raises(Halted, match="the run is stopping; 1 shards cancelled"):
        fan.run()
    assert [r.key for r in fan.submitted] == ["rollout-0.s0.a1", "rollout-0.s1.a1"]  # no rerun of shard 0
    assert list(runner.cancelled) == ["h1"]


@pytest.mark.parametrize("raised", [KeyboardInterrupt, OSError])
def test_a_watch_that_ends_early_fences_and_cancels_its_shards(tmp_path: Path, raised: type[BaseException]) -> None:
    """The main thread's signal (a kill or cancel of a sync run) or an error of the watch (the task's retry
    follows and reruns the rollouts without rows under new ids): the live shard is fenced, so it cannot
    publish rows beside the rerun's, and cancelled on its worker. Before, an error of the watch left it
    running, and its rows landed beside the retry's."""
    runner = ScriptedRunner(_memory_lake(), stall={0})

    def on_sleep(now: float) -> None:
        if now >= 4:
            raise raised("stop")

    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=2), runner, Clock(on_sleep))
    with pytest.raises(raised):
        fan.run()
    assert list(runner.cancelled) == ["h0"]
    assert shards.decide(runner.lake, fan.submitted[0], shards.PUBLISHED) == shards.GIVEN_UP


def test_a_stopping_watch_awaits_a_publishing_shard_and_fences_all_before_an_api_away(tmp_path: Path) -> None:
    """A shard that claimed its rows before the stop is left to upload them, and awaited (so a rerun that
    follows finds them); every other shard is fenced before any cancel is asked, so an API that refuses the
    first cancel leaves none of them able to publish, and the pass stops there instead of waiting on each."""
    halt = threading.Event()
    runner = ScriptedRunner(_memory_lake(), stall={0, 1, 2})
    calls: list[str] = []

    def api_away(handle: str, reason: str) -> bool:
        calls.append(handle)
        raise ConnectionError("the API is away")

    def stop(now: float) -> None:
        if now >= 4 and not halt.is_set():
            shards.decide(runner.lake, runner.reqs["h0"], shards.PUBLISHED)  # shard 0 claims its rows first
            halt.set()
        elif halt.is_set() and now >= 6:
            runner.stall.discard(0)
            runner.state("h0")  # ... and uploads them while the stopping watch waits

    runner.cancel = api_away  # type: ignore[method-assign]
    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=6), runner, Clock(stop))
    fan.halt = halt
    lines: list[str] = []
    fan.log = _Lines(lines)
    with pytest.raises(Halted):
        fan.run()
    assert calls == ["h1"]  # h0 publishing: left alone; h1 refused: h2 not tried
    assert any("shard rollout-0.s0.a1 claimed its rows" in line for line in lines)
    assert any("could not cancel shards rollout-0.s1.a1, rollout-0.s2.a1" in line for line in lines), lines
    assert not any("have not uploaded them" in line for line in lines), lines  # awaited until they came
    assert all(rid in fan._final_rows() for rid in fan.submitted[0].rollout_ids.values())
    for req in fan.submitted[1:]:  # fenced before the refused cancel: neither can publish
        assert shards.decide(runner.lake, req, shards.PUBLISHED) == shards.GIVEN_UP


def test_a_shard_whose_submission_failed_is_fenced(tmp_path: Path) -> None:
    """The API created the shard's flow run but its answer was lost (a timeout): the watch fails, and the
    shard, which may run all the same, cannot publish beside the rows of the retry that follows."""
    runner = ScriptedRunner(_memory_lake(), stall=set())
    submit = runner.submit

    def lost_answer(req: shards.ShardRequest) -> str:
        if req.index == 1:
            submit(req)  # created on the server ...
            raise TimeoutError("the API did not answer")  # ... and the answer lost
        return submit(req)

    runner.submit = lost_answer  # type: ignore[method-assign]
    fan = _watch(tmp_path, _stall_cfg(groups=1, samples=4), runner, Clock())
    with pytest.raises(TimeoutError):
        fan.run()
    assert [r.key for r in fan.submitted] == ["rollout-0.s0.a1"]
    (lost,) = [r for r in runner.reqs.values() if r.index == 1]
    assert shards.decide(runner.lake, lost, shards.PUBLISHED) == shards.GIVEN_UP


class _Lines:
    """A logger that keeps its formatted lines."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def _keep(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)

    info = warning = _keep


@pytest.mark.slow
def test_one_host_proxy_per_host_shared_by_shards_and_stopped_with_the_worker(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from clawpipe.pipeline.services import host_proxy, stop_host_proxies
    from tests.support.upstream import ScriptedUpstream, say

    up = ScriptedUpstream(default=say("ok")).start()
    home = tmp_path / "host"
    try:
        with ThreadPoolExecutor(2) as pool:  # two shards starting at once on one host
            urls = list(pool.map(lambda _: host_proxy(home, [f"{up.url}/v1"], "admin"), range(2)))
        assert urls[0] == urls[1]
        (record,) = (home / "proxies").glob("*.json")
        pid = json.loads(record.read_text())["pid"]
        assert host_proxy(home, [f"{up.url}/v1"], "admin") == urls[0]  # a later shard reuses it
        assert httpx.get(f"{urls[0]}/admin/health", headers={"authorization": "Bearer admin"}).status_code == 200
        assert stop_host_proxies(home) == 1
        assert not record.exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        stop_host_proxies(home)
        up.stop()
