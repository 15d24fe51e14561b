"""train_step end to end on a real lake (Parquet + DuckDB), checkpoints, resume, publishing, tracking, CLI."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

from clawpipe import tables
from clawpipe.errors import TrainingError
from clawpipe.schemas import MODEL_CALLS, ROLLOUTS
from clawpipe.serving.policy import compute_logprobs, init_policy
from clawpipe.train.checkpoint import load_policy, read_policy_version
from clawpipe.train.config import make_config
from clawpipe.train.step import train_step
from clawpipe.trees.reconstruct import build_iteration
from tests.train.helpers import random_group_trees

RUN = "run-t"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return init_policy(tmp_path_factory.mktemp("policy") / "v0", size="tiny", seed=0)


def write_lake(
    lake: Path,
    policy: Path,
    iteration: int = 0,
    *,
    bad_rewards: dict[str, float | None] | None = None,
    trees: bool = True,
) -> dict[str, str]:
    """Land the calls of random group trees (captured logprobs from the policy itself) and their rollouts,
    and build their trees with the trees room (unless trees=False); then add a retokenized call and a call
    outside every tree (trees=True only). bad_rewards: rollout id -> the reward to land instead."""
    model = load_policy(policy).model.eval()
    with_trees = trees
    trees, infos = random_group_trees(5, versions=(0,))
    for i, info in enumerate(infos.values()):
        info.reward = (i % 3) / 2  # no zero-variance group
    call_rows, harness = [], {}
    for tree in trees:
        for k, s in enumerate(tree.sequences):
            toks = tree.token_ids[s.positions].tolist()
            prompt, comp = toks[: s.n_prompt], toks[s.n_prompt :]
            call_rows.append(
                dict(
                    call_id=f"{tree.tree_id}-c{k}", choice_index=0, run_id=RUN, iteration=iteration,
                    rollout_id=s.rollout_id, seq=k, status="ok", token_source="upstream", policy_version=0,
                    prompt_token_ids=prompt, completion_token_ids=comp,
                    completion_logprobs=compute_logprobs(model, prompt, comp),
                )
            )  # fmt: skip
    roll_rows = []
    for rid, info in infos.items():
        reward = (bad_rewards or {}).get(rid, info.reward)
        roll_rows.append(
            dict(rollout_id=rid, run_id=RUN, iteration=iteration, group_id=info.group_id, harness=info.harness,
                 reward=reward, status="succeeded")
        )  # fmt: skip
        harness[rid] = info.harness
    roll_rows.append(dict(roll_rows[0], rollout_id="infra", status="infra_error", reward=None))
    tables.replace_partition(lake, "rollouts", RUN, iteration, pa.Table.from_pylist(roll_rows, schema=ROLLOUTS))
    # a rollout cut off before its result row (a killed run reruns it under a new id): its call has a tree
    call_rows.append(dict(call_rows[0], call_id="cut", rollout_id="cut-off"))
    tables.replace_partition(lake, "model_calls", RUN, iteration, pa.Table.from_pylist(call_rows, schema=MODEL_CALLS))
    if with_trees:
        build_iteration(lake, RUN, iteration)
        # a retokenized call and a call the trees left out: neither is trained
        call_rows.append(dict(call_rows[0], call_id="retok", token_source="retokenized"))
        call_rows.append(dict(call_rows[0], call_id="stray", prompt_token_ids=[7, 7, 7]))
        calls = pa.Table.from_pylist(call_rows, schema=MODEL_CALLS)
        tables.replace_partition(lake, "model_calls", RUN, iteration, calls)
    return harness


def call_rows_in_trees(lake: Path) -> list:
    con = tables.connect(lake)
    return con.sql("select call_id from model_calls where call_id not in ('retok', 'stray', 'cut')").fetchall()


class Recorder:
    def __init__(self, log_calls: list) -> None:
        self.calls = log_calls

    def log_metrics(self, metrics, step=None):
        self.calls.append((dict(metrics), step))


def test_train_step_checkpoint_and_resume(home, tmp_path, policy_dir):
    lake = tmp_path / "lake"
    write_lake(lake, policy_dir)
    cfg = make_config(learning_rate=1e-3, max_tokens_per_micro_batch=128)
    logged: list = []
    out = tmp_path / "ckpt"
    result = train_step(
        RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=out, config=cfg, tracker=Recorder(logged)
    )
    m = result.metrics
    assert result.policy_version == 1 and result.checkpoint_dir == out / "policy-v1"
    for f in ("model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "trainer_state.json"):
        assert (result.checkpoint_dir / f).is_file(), f
    assert read_policy_version(result.checkpoint_dir) == 1
    # loading: the stray calls and the cut-off rollout's call counted, not trained; infra_error skipped by status
    assert m["load/calls_not_in_tree"] == 1 and m["load/rollouts_skipped_status"] == 1
    assert m["load/calls_without_rollout"] == 1
    assert m["load/calls"] == m["sequences"] == len(call_rows_in_trees(lake))
    # captured logprobs came from this very policy: the mismatch detector reads ~0
    assert m["logprob/max_abs_diff_current"] < 1e-4
    assert m["tokens/flattened"] > m["tokens/unique"] > 0
    expected = ["loss/total", "entropy", "clip_fraction", "grad_norm", "reward/mean", "reward/std"]
    expected += ["reward/mean/alpha", "reward/mean/beta", "time/step_s", "throughput/flattened_tokens_per_s"]
    for key in expected:
        assert key in m, key
    assert logged and logged[0][1] == 0 and "train/loss/total" in logged[0][0]
    # the checkpoint differs from its parent and resumes with its optimizer state
    before = load_policy(policy_dir).model.state_dict()
    after = load_policy(result.checkpoint_dir)
    assert any(not torch.equal(before[k], v) for k, v in after.model.state_dict().items())
    assert after.optimizer_state is not None and after.optimizer_state["state"]
    write_lake(lake, policy_dir, iteration=1)
    second = train_step(RUN, 1, lake_root=lake, policy_dir=result.checkpoint_dir, out_dir=out, config=cfg)
    assert second.policy_version == 2 and (out / "policy-v2" / "optimizer.pt").is_file()
    state = torch.load(out / "policy-v2" / "optimizer.pt", weights_only=True)
    assert max(int(s["step"]) for s in state["state"].values()) == 2  # Adam's step count continued


def test_trains_on_trees_built_by_clawpipe_trees(home, tmp_path, policy_dir):
    """The contract with the trees room: every trainable call is found in the group trees it builds, and the
    packed batch holds exactly the unique tokens of our own trie over the same calls."""
    from clawpipe.train.batch import build_batch
    from clawpipe.train.loading import load_trees
    from clawpipe.trees.reconstruct import build_iteration

    lake = tmp_path / "lake"
    write_lake(lake, policy_dir, trees=False)
    build_iteration(lake, RUN, 0)
    cfg = make_config()
    trees, infos, stats = load_trees(lake, RUN, 0, cfg)
    assert stats.get("calls_not_in_tree", 0) == 0 and stats.get("calls_without_logprobs", 0) == 0
    ours, _ = random_group_trees(5, versions=(0,))
    assert stats["calls"] == sum(len(t.sequences) for t in ours)
    batch = build_batch(trees, infos, cfg, policy_version=0)
    assert batch.flattened_tokens == sum(t.flattened_tokens for t in ours)
    assert batch.unique_tokens == sum(t.n_tokens for t in ours)
    result = train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=cfg)
    assert result.metrics["logprob/max_abs_diff_current"] < 1e-4


def test_bad_inputs(home, tmp_path, policy_dir):
    lake = tmp_path / "lake"
    cfg = make_config()
    with pytest.raises(TrainingError, match=r"no config\.json"):
        train_step(RUN, 0, lake_root=lake, policy_dir=tmp_path, out_dir=tmp_path / "o", config=cfg)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(TrainingError, match="does not load"):
        train_step(RUN, 0, lake_root=lake, policy_dir=broken, out_dir=tmp_path / "o", config=cfg)
    with pytest.raises(TrainingError, match="trees build"):
        train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=cfg)
    # no usable reward anywhere: the step says so, naming a rollout
    write_lake(lake, policy_dir, bad_rewards={f"g{g}r{i}": None for g in range(2) for i in range(4)})
    with pytest.raises(TrainingError, match=r"every group .* left out for its rewards.*g0r0"):
        train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=cfg)
    tables.replace_partition(lake, "rollouts", RUN, 0, ROLLOUTS.empty_table())
    with pytest.raises(TrainingError, match=r"no rows in rollouts: land its results first"):
        train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=cfg)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_rollout_without_a_reward_leaves_its_group_out_of_the_step(home, tmp_path, policy_dir, algorithm):
    """A verifier that returned nothing for one rollout (reward null) costs its group, not the step."""
    lake = tmp_path / "lake"
    write_lake(lake, policy_dir, bad_rewards={"g1r2": None})
    logged: list = []
    cfg = make_config(algorithm=algorithm, learning_rate=1e-3)
    result = train_step(
        RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=cfg, tracker=Recorder(logged)
    )
    m = result.metrics
    assert m["groups_skipped_no_reward"] == 1 and m["rollouts_no_reward"] == 1 and m["groups"] == 2
    assert m["rollouts"] == 4 and m["tokens/trained"] > 0 and "empty_step" not in m  # group g0 trained
    assert np.isfinite(m["loss/total"]) and result.policy_version == 1
    assert logged[0][0]["train/groups_skipped_no_reward"] == 1 and logged[0][0]["train/rollouts_no_reward"] == 1


@pytest.mark.parametrize("logprob", [-9999.0, -1e30, 5.0])
def test_a_call_with_an_impossible_captured_logprob_is_left_out_of_the_step(home, tmp_path, policy_dir, logprob):
    """An engine writes a -inf logprob as -9999.0: exp(current - captured) overflowed, and the one token made
    the whole step's gradient NaN. The call is left out and counted; the rest of its rollout trains."""
    lake = tmp_path / "lake"
    write_lake(lake, policy_dir, trees=False)
    rows = tables.connect(lake).sql("select * from model_calls order by call_id").to_arrow_table().to_pylist()
    victim = next(r for r in rows if r["call_id"] != "cut")
    victim["completion_logprobs"] = [logprob, *victim["completion_logprobs"][1:]]
    tables.replace_partition(lake, "model_calls", RUN, 0, pa.Table.from_pylist(rows, schema=MODEL_CALLS))
    build_iteration(lake, RUN, 0)
    result = train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=make_config())
    m = result.metrics
    assert m["load/calls_logprobs_out_of_range"] == 1 and np.isfinite(m["loss/total"]) and np.isfinite(m["grad_norm"])
    assert m["load/calls"] == len(call_rows_in_trees(lake)) - 1


@pytest.mark.parametrize("where", ["completion", "prompt"])
def test_a_call_with_a_token_id_outside_the_vocabulary_is_left_out_of_the_step(home, tmp_path, policy_dir, where):
    """The lake keeps any int32 id an engine reported; one outside the policy's embedding stopped the whole
    step with an index error. Its call is left out and counted; every other call trains."""
    lake = tmp_path / "lake"
    write_lake(lake, policy_dir, trees=False)
    rows = tables.connect(lake).sql("select * from model_calls order by call_id").to_arrow_table().to_pylist()
    victim = next(r for r in rows if r["call_id"] != "cut")
    vocab = int(load_policy(policy_dir).model.get_input_embeddings().num_embeddings)
    key = f"{where}_token_ids"
    victim[key] = [*victim[key][:-1], vocab + 7]
    tables.replace_partition(lake, "model_calls", RUN, 0, pa.Table.from_pylist(rows, schema=MODEL_CALLS))
    build_iteration(lake, RUN, 0)
    result = train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=make_config())
    m = result.metrics
    assert m["calls_token_ids_out_of_vocab"] >= 1 and np.isfinite(m["loss/total"]) and np.isfinite(m["grad_norm"])
    assert m["tokens/trained"] > 0 and result.policy_version == 1


@pytest.mark.slow
def test_harness_names_mlflow_refuses_still_log_their_metrics(home, tmp_path, policy_dir):
    """Harness names in the lake are free text: per-harness metric names must be ones MLflow takes."""
    from clawpipe.tracking import make_tracker

    lake = tmp_path / "lake"
    write_lake(lake, policy_dir)
    rows = tables.connect(lake).sql("select * from rollouts").to_arrow_table().to_pylist()
    odd = {"alpha": "claude@code+1", "beta": "a/../b"}
    for r in rows:
        r["harness"] = odd.get(r["harness"], r["harness"])
    tables.replace_partition(lake, "rollouts", RUN, 0, pa.Table.from_pylist(rows, schema=ROLLOUTS))
    tracker = make_tracker(True, experiment="train-harness-names")
    run_id = tracker.start_run("r1")
    result = train_step(
        RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=tmp_path / "o", config=make_config(), tracker=tracker
    )
    tracker.end()
    logged = tracker.client.get_run(run_id).data.metrics
    per_harness = sorted(k for k in logged if k.startswith("train/reward/mean/"))
    assert len(per_harness) == 2 and per_harness == sorted(
        f"train/{k}" for k in result.metrics if k.startswith("reward/mean/")
    )
    assert "train/loss/total" in logged


class _Reload(BaseHTTPRequestHandler):
    seen: ClassVar[list] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Reload.seen.append((self.path, self.headers["Authorization"], body))
        ok = self.headers["Authorization"] == "Bearer sesame"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"policy_version": body["policy_version"]}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def reload_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reload)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_publish_and_cli(home, tmp_path, policy_dir, reload_server, monkeypatch):
    from clawpipe.cli import app
    from clawpipe.config import get_settings

    lake = Path(get_settings().lake_dir)
    write_lake(lake, policy_dir)
    monkeypatch.setenv("CLAWPIPE_ADMIN_TOKEN", "sesame")
    get_settings.cache_clear()
    cfg_file = tmp_path / "train.toml"
    cfg_file.write_text('learning_rate = 1e-3\naggregation = "per-rollout-mean"\n')
    out = tmp_path / "models"
    _Reload.seen.clear()
    res = CliRunner().invoke(
        app,
        ["train", "--run", RUN, "--iteration", "0", "--config", str(cfg_file), "--policy", str(policy_dir),
         "--out", str(out), "--publish-url", reload_server, "--no-track"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "policy_version 1" in res.output
    path, auth, body = _Reload.seen[-1]
    assert path == "/admin/reload" and auth == "Bearer sesame"
    assert body == {"path": str((out / "policy-v1").resolve()), "policy_version": 1}
    # without --policy the newest checkpoint in --out is the starting point
    res = CliRunner().invoke(app, ["train", "--run", RUN, "--iteration", "0", "--out", str(out), "--no-track"])
    assert res.exit_code == 0, res.output
    assert (out / "policy-v2").is_dir()
    monkeypatch.setenv("CLAWPIPE_ADMIN_TOKEN", "wrong")
    get_settings.cache_clear()
    cfg = make_config(publish_url=reload_server)
    with pytest.raises(TrainingError, match="refused"):
        train_step(RUN, 0, lake_root=lake, policy_dir=policy_dir, out_dir=out, config=cfg)


def test_cli_trains_paths_longer_than_the_micro_batch_target(home, tmp_path, policy_dir):
    """Every path of the lake is longer than max_tokens_per_micro_batch: the step trains (each long path in a
    micro-batch of its own) where it used to fail with 'a path of N tokens exceeds ...'."""
    from clawpipe.cli import app
    from clawpipe.config import get_settings

    lake = Path(get_settings().lake_dir)
    write_lake(lake, policy_dir)
    cfg_file = tmp_path / "train.toml"
    cfg_file.write_text("learning_rate = 1e-3\nmax_tokens_per_micro_batch = 16\n")
    metrics = tmp_path / "m.json"
    res = CliRunner().invoke(
        app,
        ["train", "--run", RUN, "--iteration", "0", "--config", str(cfg_file), "--policy", str(policy_dir),
         "--out", str(tmp_path / "models"), "--no-track", "--metrics-out", str(metrics)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    m = json.loads(metrics.read_text())["metrics"]
    assert m["tokens/largest_micro_batch"] > 16 and m["grad_norm"] > 0
    assert f"largest {int(m['tokens/largest_micro_batch'])} tokens (target 16" in res.output


@pytest.mark.slow
def test_mlflow_tracker(home):
    from clawpipe.tracking import NullTracker, make_tracker

    assert isinstance(make_tracker(False), NullTracker)
    tracker = make_tracker(True, experiment="train-test")
    run_id = tracker.start_run("r1")
    params = make_config().flat_params()
    tracker.log_params(params)
    tracker.log_params(params)  # idempotent
    tracker.log_metrics({"train/loss/total": 0.5, "train/reward/mean/alpha": 0.25, "skip": float("nan")}, step=3)
    tracker.end()
    run = tracker.client.get_run(run_id)
    assert run.data.params["aggregation"] == "token-mean" and len(run.data.params) == len(params)
    assert run.data.metrics == {"train/loss/total": 0.5, "train/reward/mean/alpha": 0.25}
    hist = tracker.client.get_metric_history(run_id, "train/loss/total")
    assert hist[0].step == 3 and str(tracker.tracking_uri).startswith("sqlite:///" + str(home.resolve()))


def test_packed_logits_match_plain_forward_on_the_default_policy(policy_dir):
    """The default policy (vocab 512) scores a packed tree exactly as separate forwards do."""
    from clawpipe.train.batch import build_batch
    from clawpipe.train.trainer import Trainer

    model = load_policy(policy_dir).model
    trees, infos = random_group_trees(9)
    batch = build_batch(trees, infos, make_config(), policy_version=None)
    trainer = Trainer(model, make_config())
    with torch.no_grad():
        got = np.zeros(len(batch.contrib), dtype=np.float32)
        for mb in trainer.pack(batch, "tree"):
            s = trainer._score(model, mb)
            got[mb.contrib_index] = s.logprob[mb.contrib_score].numpy()
        c = batch.contrib
        for sid, (ti, s) in enumerate(batch.sequences):
            toks = batch.trees[ti].token_ids[s.positions]
            sel = np.flatnonzero(c.seq == sid)
            ref = compute_logprobs(model, toks[: s.n_prompt].tolist(), toks[s.n_prompt :].tolist())
            assert np.allclose(got[sel], np.asarray(ref)[c.idx[sel] - s.n_prompt], atol=1e-5)
