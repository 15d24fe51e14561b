"""Build the upgrade fixtures: capture segments and lakes written by earlier clawpipe versions, with their code.

For each revision in ``REVISIONS`` the script extracts that revision's ``clawpipe`` and ``sql`` folders from
git (``git archive``) and runs a small program with them (``PYTHONPATH`` set to the extract) that

- writes capture segments the way that version's proxy framed them (its ``capture.encode_record``, with
  the header keys its proxy wrote) and a rollout results file (its ``capture.append_result``);
- lands ``landed/`` into ``lake/`` with that version's ``land`` and builds its prefix trees with its
  ``build_trees`` (tree tables in that version's columns);
- leaves ``pending/`` (one more segment of the same partition and one of a new iteration) unlanded, as a
  user upgrading with captures not yet landed would.

Run from the repository root: ``.venv/bin/python tests/lake/upgrade/make_fixtures.py``. The output folders
(``tests/lake/upgrade/<revision>/``) are committed; rerunning rewrites them (call ids and times change).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

# early (CPR1 frames, tree_stats.retokenized_calls, no tree_sequences), middle (framing with sync markers,
# kept_out_* and tree_sequences) and the last one before model_calls gained spliced_tokens
REVISIONS = {
    "c5b00d5": "early",
    "6995a72": "middle",
    "825f411": "before_spliced",
}

OLD_PROGRAM = r"""
import json, sys, time
from pathlib import Path
from clawpipe import capture
from clawpipe.lake import land
from clawpipe.trees.reconstruct import build_trees

out = Path(sys.argv[1])
RUN = "old-run"
T0 = 1_764_547_200.0  # fixed times: 2025-12-01


def header(call_id, iteration, rollout_id, seq, api="chat", status="ok", http_status=200):
    # the keys that version's proxy wrote (clawpipe/proxy/server.py), filled in as a finished call
    return {
        "call_id": call_id, "run_id": RUN, "iteration": iteration, "rollout_id": rollout_id, "seq": seq,
        "api": api, "method": "POST", "path": "/v1/chat/completions", "query": "", "stream": False,
        "http_status": http_status, "status": status, "error": None if status == "ok" else "upstream said no",
        "model": "tiny", "policy_version": 2, "t_start": T0 + seq, "t_end": T0 + seq + 0.25,
        "upstream_ms": 200.0, "request_changes": {"return_token_ids": True},
        "token_source": "upstream" if status == "ok" else "none", "upstream": "http://127.0.0.1:9",
    }


def chat(prompt_ids, ids, text):
    # a vLLM chat completion with return_token_ids and logprobs
    lps = [-0.5] * len(ids)
    return json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
        "prompt_token_ids": prompt_ids,
        "choices": [{
            "index": 0, "finish_reason": "stop", "token_ids": ids,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": []} for lp in lps]},
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": 0},
    }).encode()


def rollout_calls(iteration, rollout_id, first):
    # two turns: the second prompt extends the first call's prompt and completion
    p1, c1 = [1, 2, 3, first], [10 + first, 11]
    p2, c2 = p1 + c1 + [4], [20 + first, 21, 22]
    req = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return [
        (header(f"{rollout_id}-c0", iteration, rollout_id, 0), req, chat(p1, c1, "a")),
        (header(f"{rollout_id}-c1", iteration, rollout_id, 1), req, chat(p2, c2, "b")),
    ]


def segment(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for h, req, resp in records:
            f.write(capture.encode_record(h, req, resp))


def result(path, iteration, rollout_id, reward):
    path.parent.mkdir(parents=True, exist_ok=True)
    capture.append_result(path, {
        "rollout_id": rollout_id, "run_id": RUN, "iteration": iteration, "group_id": f"g{iteration}",
        "harness": "chat-loop", "task_set": "arith", "task_id": "t1", "sample_idx": int(rollout_id[-1]),
        "backend": "process", "status": "succeeded", "exit_code": 0, "reward": reward, "reward_info": {"ok": True},
        "n_calls": 2, "started_at": T0, "ended_at": T0 + 5, "duration_s": 5.0, "stderr_tail": "",
        "error": None, "attempt": 0, "policy_version": 2, "eval": False,
    })


landed = out / "landed"
failed = header("r0-fail", 0, "old-r0", 2, status="http_error", http_status=400)
calls = rollout_calls(0, "old-r0", 0) + rollout_calls(0, "old-r1", 1)
segment(landed / "seg-a.seg", calls + [(failed, b"{}", b'{"error": "no"}')])
result(landed / "results" / "results-a.jsonl", 0, "old-r0", 1.0)
result(landed / "results" / "results-a.jsonl", 0, "old-r1", 0.0)
report = land(landed, out / "lake")
print("landed", report)
print("trees", build_trees(out / "lake", RUN))

pending = out / "pending"
segment(pending / "seg-b.seg", rollout_calls(0, "old-r2", 2))
segment(pending / "seg-c.seg", rollout_calls(1, "old-r3", 3))
result(pending / "results" / "results-b.jsonl", 0, "old-r2", 0.5)
result(pending / "results" / "results-b.jsonl", 1, "old-r3", 1.0)
"""


def build(rev: str, label: str) -> None:
    dest = HERE / label
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"old-{rev}-") as tmp:
        archive = subprocess.run(["git", "archive", rev, "clawpipe", "sql"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        env = {**os.environ, "PYTHONPATH": tmp}
        subprocess.run([sys.executable, "-c", OLD_PROGRAM, str(dest)], cwd=tmp, env=env, check=True)
    # the lock file and staging folders are runtime state, not data
    for p in list(dest.rglob(".lock")) + list(dest.rglob("_staging")):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def main() -> None:
    for rev, label in REVISIONS.items():
        build(rev, label)
        print(f"{label}: written by {rev} into {HERE / label}")


if __name__ == "__main__":
    main()
