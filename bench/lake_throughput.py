"""Lake landing throughput and saved-query latency on synthetic capture segments.

Run: ``.venv/bin/python bench/lake_throughput.py [--small N] [--large N] [--query-calls N] [--landing-only]``
Response shapes of a vLLM-style upstream: small = 200 prompt ids + 64 generated (~7 KB), large = 16k
prompt ids + 512 generated (~150 KB). Landing rates are measured on varied calls (each with its own random
ids, logprobs, token texts and request text, lengths +-50%, as real captures are) and, beside them
(``*_uniform``), on one identical request and response repeated, the shape of earlier figures. Landing is
single-threaded and runs in a child process; its rate on one core is calls / CPU seconds of that process
(the figure that holds on a shared machine; the wall-clock rate is printed beside it), its peak RSS the
child's own high-water mark. Saved queries run over a lake of ``--query-calls`` small uniform calls (landed
segment by segment, in rounds, to bound disk use). Prints human lines, then one JSON line with the figures
and their ratios to the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clawpipe import capture  # noqa: E402

TARGET_SMALL, TARGET_LARGE, TARGET_QUERY_S, TARGET_LAND_RSS_MB, TARGET_QUERY_RSS_MB = 20_000, 1_000, 1.0, 1024, 2048
SAVED = (
    "reward_by_harness_iteration",
    "calls_tokens_per_rollout",
    "latency_by_policy_version",
    "retokenized_call_rate",
    "failure_reasons",
)


def response(n_prompt: int, n_gen: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": 0,
            "model": "mock-model",
            "prompt_token_ids": list(range(1000, 1000 + n_prompt)),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "tok " * n_gen},
                    "token_ids": list(range(5000, 5000 + n_gen)),
                    "logprobs": {
                        "content": [
                            {"token": "tok", "logprob": -0.25, "bytes": [116, 111, 107], "top_logprobs": []}
                            for _ in range(n_gen)
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        }
    ).encode()


_WORDS = [
    "the",
    "a",
    "to",
    "of",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "for",
    "on",
    "with",
    "as",
    "are",
    "this",
    "be",
    "at",
    "or",
    "have",
    "from",
    "by",
    "not",
    "but",
]
_WORDS += ["def", "return", "import", "self", "(", ")", ":", "\n", "    ", "x", "=", "+", "1", "0", "if", "else"]


def varied_response(rng: random.Random, n_prompt: int, n_gen: int) -> bytes:
    """A response with its own ids, logprobs and text (lengths vary +-50% around the given ones)."""
    n_prompt = max(1, int(n_prompt * rng.uniform(0.5, 1.5)))
    n_gen = max(1, int(n_gen * rng.uniform(0.5, 1.5)))
    pieces = [rng.choice(_WORDS) + (" " if rng.random() < 0.6 else "") for _ in range(n_gen)]
    content = []
    for p in pieces:
        lp = -rng.expovariate(2.0)  # the same entry shape as the uniform calls (no top_logprobs asked for)
        content.append({"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []})
    return json.dumps(
        {
            "id": f"chatcmpl-{rng.getrandbits(64):016x}",
            "object": "chat.completion",
            "created": 1764547200 + rng.randrange(86400),
            "model": "mock-model",
            "prompt_token_ids": [rng.randrange(151_000) for _ in range(n_prompt)],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop" if rng.random() < 0.9 else "length",
                    "message": {"role": "assistant", "content": "".join(pieces)},
                    "token_ids": [rng.randrange(151_000) for _ in range(n_gen)],
                    "logprobs": {"content": content},
                }
            ],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen},
        }
    ).encode()


def varied_request(rng: random.Random, size: int) -> bytes:
    words, n = [], 0
    while n < size - 120:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": " ".join(words)}]}).encode()


def request(size: int) -> bytes:
    msg = "x" * max(0, size - 120)
    return json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": msg}]}).encode()


def write_segments(
    captures: Path, n: int, *, large: bool, per_segment: int, run_id: str, start: int = 0, varied: bool = False
) -> int:
    """Write ``n`` calls into sealed segments; returns bytes written. ``varied``: every call its own ids,
    logprobs and texts (lengths +-50%); else one identical request and response in every call."""
    body = response(16000, 512) if large else response(200, 64)
    req = request(64 * 1024 if large else 512)
    rng = random.Random(start)
    captures.mkdir(parents=True, exist_ok=True)
    total = 0
    t0 = time.time()
    for s in range(0, n, per_segment):
        frames = []
        for i in range(start + s, start + min(n, s + per_segment)):
            rollout = f"ro-{i // 10}"
            header = {
                "call_id": uuid.uuid4().hex,
                "run_id": run_id,
                "iteration": (i // 100_000) % 10,
                "rollout_id": rollout,
                "seq": i % 10,
                "api": "chat",
                "method": "POST",
                "path": "/v1/chat/completions",
                "stream": False,
                "http_status": 200,
                "status": "ok" if i % 97 else "http_error",
                "error": None if i % 97 else "upstream said 500",
                "model": "mock-model",
                "policy_version": i // 250_000,
                "t_start": t0 + i * 0.001,
                "t_end": t0 + i * 0.001 + 0.02 + (i % 50) * 0.001,
                "upstream_ms": 18.0,
                "request_changes": {"return_token_ids": True},
                "token_source": "retokenized" if i % 31 == 0 else "upstream",
                "upstream": "http://127.0.0.1:9",
            }
            if varied:
                body = varied_response(rng, 16000, 512) if large else varied_response(rng, 200, 64)
                req = varied_request(rng, 64 * 1024 if large else 512)
            frames.append(capture.encode_record(header, req, body))
        data = b"".join(frames)
        (captures / f"bench-{uuid.uuid4().hex[:8]}-{start + s}.seg").write_bytes(data)
        total += len(data)
    return total


def write_rollouts(captures: Path, n_calls: int, run_id: str) -> None:
    rows_dir = captures / "results" / run_id
    for r in range(n_calls // 10):
        it = (r * 10 // 100_000) % 10
        d = rows_dir / str(it)
        d.mkdir(parents=True, exist_ok=True)
        row = {
            "rollout_id": f"ro-{r}",
            "run_id": run_id,
            "iteration": it,
            "harness": ("chat-loop", "claude-code", "codex")[r % 3],
            "status": "succeeded" if r % 13 else "failed",
            "reward": (r % 7) / 6,
            "attempt": 0,
            "policy_version": r * 10 // 250_000,
        }
        with open(d / "results-bench.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def land_child(captures: str, lake: str) -> None:
    """Child process body: land on one core, print calls/s and peak RSS as JSON."""
    from clawpipe.lake import land

    warm = Path(tempfile.mkdtemp(prefix="clawpipe-lake-warm-"))
    write_segments(warm / "cap", 10, large=False, per_segment=10, run_id="warm")
    land(warm / "cap", warm / "lake")  # first use of pyarrow's writers and kernels loads code: not landing
    shutil.rmtree(warm)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    rep = land(captures, lake)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"calls": rep.calls, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": rss}))


def run_land(captures: Path, lake: Path) -> dict[str, float]:
    os.sync()  # flush the freshly written segments first: dirty-page writeback would throttle the lander
    out = subprocess.run(
        [sys.executable, __file__, "--child-land", str(captures), str(lake)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def query_child(lake: str) -> None:
    from clawpipe.lake import run_saved

    times = {}
    for name in SAVED:
        run_saved(lake, name)  # warm the OS page cache once
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            run_saved(lake, name)
            best.append(time.perf_counter() - t0)
        times[name] = sorted(best)[1]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "peak_rss_mb": rss}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=100_000, help="small calls for the landing rate")
    ap.add_argument("--large", type=int, default=3_000, help="large calls for the landing rate")
    ap.add_argument("--query-calls", type=int, default=1_000_000, help="calls in the lake the saved queries read")
    ap.add_argument("--round", type=int, default=200_000, help="calls generated and landed per round")
    ap.add_argument("--landing-only", action="store_true", help="skip the saved-query lake")
    ap.add_argument("--child-land", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--child-query", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_land:
        land_child(*args.child_land)
        return
    if args.child_query:
        query_child(args.child_query)
        return
    work = Path(tempfile.mkdtemp(prefix="clawpipe-lake-bench-"))
    try:
        figures: dict[str, object] = {}
        # -- landing rate, small and large, each from fresh segments into a fresh lake
        for kind, n, varied in (
            ("small", args.small, True),
            ("large", args.large, True),
            ("small_uniform", args.small, False),
            ("large_uniform", args.large, False),
        ):
            caps, lake = work / f"cap-{kind}", work / f"lake-{kind}"
            large = kind.startswith("large")
            size = write_segments(caps, n, large=large, per_segment=100 if large else 2000, run_id=kind, varied=varied)
            r = run_land(caps, lake)
            rate, wall_rate = r["calls"] / r["cpu_s"], r["calls"] / r["wall_s"]
            print(
                f"land {kind}: {r['calls']} calls, {size / 1e6:.0f} MB: {r['cpu_s']:.2f}s cpu = {rate:,.0f} calls/s "
                f"on one core ({r['wall_s']:.2f}s wall = {wall_rate:,.0f} calls/s), peak RSS {r['peak_rss_mb']:.0f} MB"
            )
            figures[f"land_{kind}_calls_per_s"] = round(rate)
            figures[f"land_{kind}_wall_calls_per_s"] = round(wall_rate)
            figures[f"land_{kind}_peak_rss_mb"] = round(r["peak_rss_mb"])
            shutil.rmtree(caps)
            shutil.rmtree(lake)
        if args.landing_only:
            print(json.dumps(figures))
            return
        # -- a lake of query-calls small calls, landed in rounds (peak RSS of each landing process)
        caps, lake = work / "cap-q", work / "lake-q"
        peak = 0.0
        landed = 0
        t_land = 0.0
        for start in range(0, args.query_calls, args.round):
            n = min(args.round, args.query_calls - start)
            write_segments(caps, n, large=False, per_segment=5000, run_id="bench", start=start)
            r = run_land(caps, lake)
            peak, landed, t_land = max(peak, r["peak_rss_mb"]), landed + r["calls"], t_land + r["wall_s"]
            for p in caps.glob("*.seg"):
                p.unlink()
        write_rollouts(caps, args.query_calls, "bench")
        r = run_land(caps, lake)
        print(f"lake for queries: {landed} calls landed in {t_land:.1f}s, peak landing RSS {peak:.0f} MB")
        figures["query_lake_calls"] = landed
        figures["land_1m_peak_rss_mb"] = round(peak)
        out = subprocess.run(
            [sys.executable, __file__, "--child-query", str(lake)], check=True, capture_output=True, text=True
        )
        q = json.loads(out.stdout.strip().splitlines()[-1])
        for name, t in q["times"].items():
            print(f"saved query {name}: {t * 1000:.0f} ms over {landed} calls")
        print(f"query peak RSS {q['peak_rss_mb']:.0f} MB")
        figures["saved_query_s"] = {k: round(v, 3) for k, v in q["times"].items()}
        figures["saved_query_max_s"] = round(max(q["times"].values()), 3)
        figures["query_peak_rss_mb"] = round(q["peak_rss_mb"])
        figures["ratios"] = {
            "small_rate_vs_target": round(figures["land_small_calls_per_s"] / TARGET_SMALL, 2),
            "large_rate_vs_target": round(figures["land_large_calls_per_s"] / TARGET_LARGE, 2),
            "query_target_vs_max_s": round(TARGET_QUERY_S / max(figures["saved_query_max_s"], 1e-9), 2),
            "land_rss_target_vs_peak": round(TARGET_LAND_RSS_MB / max(peak, 1), 2),
            "query_rss_target_vs_peak": round(TARGET_QUERY_RSS_MB / max(q["peak_rss_mb"], 1), 2),
        }
        print(json.dumps(figures))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
