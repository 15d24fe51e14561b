"""Production-shaped captured calls for the benchmarks: one generator every bench that feeds captures uses.

What a real capture looks like, and what this draws (see bench/README.md for the figures):

- rollouts of several calls (turns drawn 1..2x ``turns``); each call's prompt is the previous call's prompt,
  its sampled answer and a new user or tool-result message: multi-turn prefixes, as agents produce;
- token ids from a Zipf-like law over a 151k vocabulary (few ids very common, a long tail), texts from
  the pieces of those ids (a fixed piece per id, so text and ids agree), logprobs mostly near 0 with a tail;
- lengths log-normal around the shape's median (``small``: 200 prompt + 64 sampled tokens; ``large``:
  16k + 512), clipped to [1/4, 4] x the median;
- tool calls in ~30% of answers (a function name from a small set, JSON arguments of varied size), finish
  reasons stop / length / tool_calls, ~1% upstream errors, ~3% retokenized calls;
- every call its own uuid4 call id, response id, timings and request bytes.

Nothing is repeated byte for byte: ``calls(...)`` draws a fresh record each time from a seeded generator,
so runs are reproducible. ``write_segments`` frames the records into sealed capture segments.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from clawpipe import capture

VOCAB = 151_000
SHAPES = {"small": (200, 64, 4), "large": (16_000, 512, 6)}  # median prompt, sampled tokens, turns per rollout
TOOLS = ("bash", "read_file", "write_file", "search", "apply_patch", "list_dir", "run_tests")
_SYLLABLES = ("the", "in", "re", "er", "on", "at", "en", "ing", "def", "self", "ret", "urn", "im", "port")
_SYLLABLES += ("x", "y", "(", ")", ":", "=", ".", ",", "_", "0", "1", "2", "if", "for", "an", "is", "\n", "    ")


def _piece_table(rng: np.random.Generator, n: int) -> list[str]:
    """One text piece per token id (1-3 syllables, a leading space on ~half): ids and text agree."""
    lengths = rng.integers(1, 4, size=n)
    picks = rng.integers(0, len(_SYLLABLES), size=int(lengths.sum()))
    spaces = rng.random(n) < 0.5
    out, pos = [], 0
    for i in range(n):
        k = int(lengths[i])
        piece = "".join(_SYLLABLES[j] for j in picks[pos : pos + k])
        out.append((" " + piece) if spaces[i] else piece)
        pos += k
    return out


# the pieces of the 8k most frequent ids are kept; rarer ids reuse one of them (the text's shape is what counts)
_PIECES = _piece_table(np.random.default_rng(12345), 8192)
_PIECE_BYTES = [list(p.encode()) for p in _PIECES]


@dataclass
class Shape:
    prompt: int
    sampled: int
    turns: int = 6  # median calls per rollout
    tool_rate: float = 0.3
    error_rate: float = 0.01
    retokenized_rate: float = 0.03
    context: int | None = None  # the model's context: a longer prompt is compacted (tree data only)


def shape(name: str) -> Shape:
    p, s, t = SHAPES[name]
    return Shape(p, s, t)


class CallGen:
    """Draws production-shaped calls, rollout by rollout, from one seed."""

    def __init__(self, seed: int, shp: Shape, *, run_id: str = "bench", model: str = "mock-model") -> None:
        self.rng = np.random.default_rng(seed)
        self.shape, self.run_id, self.model = shp, run_id, model
        self.t = 1_764_547_200.0 + seed

    # -- distributions ------------------------------------------------------------------------------
    def length(self, median: int) -> int:
        x = median * float(self.rng.lognormal(0.0, 0.5))
        return int(min(max(x, median / 4), median * 4)) or 1

    def ids(self, n: int) -> np.ndarray:
        # Zipf-like ranks (s ~ 1.1) folded into the vocabulary, then scattered so common ids are not all small
        ranks = self.rng.zipf(1.1, size=n) % VOCAB
        return (ranks * 7919) % VOCAB

    def logprobs(self, n: int) -> np.ndarray:
        lp = -self.rng.exponential(0.35, size=n)
        tail = self.rng.random(n) < 0.05
        lp[tail] -= self.rng.exponential(4.0, size=int(tail.sum()))
        return lp

    # -- records ------------------------------------------------------------------------------------
    def rollout(self, rollout_id: str, iteration: int, policy_version: int = 0) -> Iterator[tuple[dict, bytes, bytes]]:
        """(header, request, response) for each call of one rollout, prompts growing turn by turn."""
        rng, shp = self.rng, self.shape
        n_turns = max(1, int(rng.integers(shp.turns // 2 + 1, shp.turns * 2)))
        # the first prompt (system + task) is a third of the median; each turn adds what the last one sampled
        # plus a tool result or user message sized so that the rollout's mean prompt lands near the median
        grow = max(1, int((2 * shp.prompt / 3) / max(1.0, (n_turns - 1) / 2) - shp.sampled))
        prompt = self.ids(self.length(shp.prompt // 3))
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.text(self.ids(min(len(prompt) // 3, 400)))},
            {"role": "user", "content": self.text(self.ids(min(len(prompt) // 2, 2000)))},
        ]
        for seq in range(n_turns):
            n_gen = self.length(shp.sampled)
            sampled = self.ids(n_gen)
            lps = self.logprobs(n_gen)
            tool = rng.random() < shp.tool_rate
            header = self.header(rollout_id, iteration, seq, policy_version)
            request = orjson.dumps(
                {"model": self.model, "messages": messages, "logprobs": True, "max_tokens": shp.sampled * 4}
            )
            response = self.response(prompt, sampled, lps, tool, header)
            yield header, request, response
            answer = self.text(sampled)
            messages = [*messages, {"role": "assistant", "content": answer}]
            added = self.ids(self.length(grow))
            messages.append({"role": "tool" if tool else "user", "content": self.text(added)})
            prompt = np.concatenate([prompt, sampled, added])
            self.t += float(rng.exponential(2.0))

    def text(self, ids: np.ndarray) -> str:
        return "".join([_PIECES[i & 8191] for i in ids.tolist()])

    def header(self, rollout_id: str, iteration: int, seq: int, policy_version: int) -> dict[str, Any]:
        rng, shp = self.rng, self.shape
        u = float(rng.random())
        latency = float(rng.lognormal(-3.0, 0.8))
        error = u < shp.error_rate
        return {
            "call_id": uuid.uuid4().hex,
            "run_id": self.run_id,
            "iteration": iteration,
            "rollout_id": rollout_id,
            "seq": seq,
            "api": "chat",
            "method": "POST",
            "path": "/v1/chat/completions",
            "stream": False,
            "http_status": 500 if error else 200,
            "status": "http_error" if error else "ok",
            "error": "upstream said 500" if error else None,
            "model": self.model,
            "policy_version": policy_version,
            "t_start": self.t,
            "t_end": self.t + latency,
            "upstream_ms": latency * 1000 * 0.95,
            "request_changes": {"return_token_ids": True},
            "token_source": "retokenized" if 1 - u < shp.retokenized_rate else "upstream",
            "upstream": "http://127.0.0.1:9",
        }

    def response(self, prompt: np.ndarray, sampled: np.ndarray, lps: np.ndarray, tool: bool, hdr: dict) -> bytes:
        rng = self.rng
        if hdr["status"] != "ok":
            return b'{"error":{"message":"upstream said 500","type":"server_error"}}'
        ids = sampled.tolist()
        content = [
            {"token": _PIECES[i & 8191], "logprob": lp, "bytes": _PIECE_BYTES[i & 8191], "top_logprobs": []}
            for i, lp in zip(ids, lps.tolist(), strict=True)
        ]
        text = "".join([c["token"] for c in content])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "stop" if rng.random() < 0.92 else "length"
        if tool:
            name = TOOLS[int(rng.integers(len(TOOLS)))]
            args = {"path": f"src/{text[:24].strip()}.py", "content": text[: int(rng.integers(8, 400))]}
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            ]
            finish = "tool_calls"
        return orjson.dumps(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(hdr["t_start"]),
                "model": self.model,
                "prompt_token_ids": prompt,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "message": message,
                        "token_ids": sampled,
                        "logprobs": {"content": content},
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt) + len(ids),
                },
            },
            option=orjson.OPT_SERIALIZE_NUMPY,
        )


def calls(
    n: int, shp: Shape, *, seed: int = 0, run_id: str = "bench", iteration: int = 0, start: int = 0
) -> Iterator[tuple[dict, bytes, bytes]]:
    """``n`` calls drawn rollout by rollout (rollout ids ``ro-<seed>-<k>``); policy_version steps every 250k."""
    gen = CallGen(seed, shp, run_id=run_id)
    made, k = 0, 0
    while made < n:
        for rec in gen.rollout(f"ro-{seed}-{k}", iteration, policy_version=(start + made) // 250_000):
            yield rec
            made += 1
            if made >= n:
                return
        k += 1


def write_segments(
    captures: Path,
    n: int,
    shp: Shape,
    *,
    per_segment: int,
    seed: int = 0,
    run_id: str = "bench",
    iteration: int = 0,
    start: int = 0,
) -> tuple[int, dict[str, int]]:
    """Write ``n`` drawn calls into sealed segments of ``per_segment`` records.

    Returns (bytes written, calls per rollout id)."""
    captures.mkdir(parents=True, exist_ok=True)
    total, frames = 0, []
    rollouts: dict[str, int] = {}
    tag = f"{seed}-{uuid.uuid4().hex[:8]}"

    def flush(i: int) -> None:
        nonlocal total, frames
        data = b"".join(frames)
        (captures / f"bench-{tag}-{i:08d}.seg").write_bytes(data)
        total += len(data)
        frames = []

    i = 0
    for header, request, response in calls(n, shp, seed=seed, run_id=run_id, iteration=iteration, start=start):
        frames.append(capture.encode_record(header, request, response))
        rollouts[header["rollout_id"]] = rollouts.get(header["rollout_id"], 0) + 1
        i += 1
        if len(frames) >= per_segment:
            flush(i)
    if frames:
        flush(i)
    return total, rollouts


def write_results(captures: Path, rollouts: dict[str, int], run_id: str, iteration: int, seed: int = 0) -> None:
    """Append the rollouts' result rows under ``<captures>/results/<run_id>/<iteration>/``."""
    d = captures / "results" / run_id / str(iteration)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "results-bench.jsonl", "ab") as f:
        for row in rollout_results(rollouts, run_id, iteration, seed):
            f.write(orjson.dumps(row) + b"\n")


def rollout_results(calls_by_rollout: dict[str, int], run_id: str, iteration: int, seed: int = 0) -> list[dict]:
    """One result row per rollout (harness, status, reward), as the runner writes them."""
    rng = np.random.default_rng(seed)
    out = []
    for r, rid in enumerate(sorted(calls_by_rollout)):
        out.append(
            {
                "rollout_id": rid,
                "run_id": run_id,
                "iteration": iteration,
                "harness": ("chat-loop", "claude-code", "codex")[r % 3],
                "status": "succeeded" if rng.random() > 0.08 else "failed",
                "reward": float(rng.beta(2, 3)),  # graded, skewed low: most attempts fail part-way
                "attempt": 0,
                "policy_version": 0,
            }
        )
    return out


if __name__ == "__main__":  # a quick look at the figures the generator draws
    for name in SHAPES:
        t0 = time.process_time()
        recs = list(calls(2000, shape(name)))
        dt = time.process_time() - t0
        sizes = sorted(len(r) + len(q) for _, q, r in recs)
        plen = sorted(len(orjson.loads(r).get("prompt_token_ids", [])) for _, _, r in recs)
        print(
            f"{name}: {len(recs)} calls in {dt:.2f}s cpu; bytes p50 {sizes[len(sizes) // 2]:,} "
            f"p90 {sizes[len(sizes) * 9 // 10]:,}; prompt ids p50 {plen[len(plen) // 2]} "
            f"p90 {plen[len(plen) * 9 // 10]}"
        )
