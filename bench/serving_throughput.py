"""Serving throughput: requests/s and generated tokens/s of `clawpipe serve` at 1 and 16 concurrent clients, on
the tiny and small default policies, with dynamic batching on (max_batch 64) and off (max_batch 1), in one run;
then the server's RSS after 100 requests and after many more (no growth per request expected).

Run: .venv/bin/python bench/serving_throughput.py [--seconds 5] [--rounds 3] [--rss-requests 9900]
The server runs as a subprocess (the clients here do not share its GIL). Prints human lines, then one JSON line
whose last field is the batching speedup at 16 clients on the tiny policy (target >= 5x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from clawpipe.serving.load import drive_chat
from clawpipe.serving.policy import init_policy
from clawpipe.serving.server import ServerHandle, start_server_process

MAX_TOKENS = 64


async def _drive(url: str, clients: int, seconds: float, max_tokens: int = MAX_TOKENS) -> dict[str, float]:
    """`clients` concurrent loops of chat requests for `seconds`; returns req/s and generated tok/s."""
    return await drive_chat(url, clients, seconds, max_tokens=max_tokens, timeout=120)


async def _count(url: str, n: int, clients: int = 16) -> None:
    """Send exactly n short requests with `clients` concurrency."""
    left = n

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": f"n {left}"}], "max_tokens": 8, "seed": left},
            )
            r.raise_for_status()

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*[loop(client) for _ in range(clients)])


def _rss_mb(handle: ServerHandle) -> float:
    assert handle._process is not None
    return psutil.Process(handle._process.pid).memory_info().rss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=5.0, help="Measured seconds per configuration (all rounds).")
    p.add_argument("--rounds", type=int, default=3, help="Interleaved rounds per configuration (median taken).")
    p.add_argument(
        "--rss-requests", type=int, default=9900, help="Requests after the first RSS reading (100 + 9900 = 10k)."
    )
    args = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in ("tiny", "small"):
            model = init_policy(Path(tmp) / size, size=size, seed=0)
            servers = {
                mode: start_server_process(model, max_batch=max_batch, max_model_len=4096, admin_token="bench")
                for mode, max_batch in (("batched", 64), ("unbatched", 1))
            }
            try:
                for handle in servers.values():
                    asyncio.run(_drive(handle.url, 4, 1.0))  # warm-up
                # rounds interleave the modes so that load drift on a shared machine hits both alike
                runs: dict[str, list[dict[str, float]]] = {}
                for _ in range(args.rounds):
                    for clients in (1, 16):
                        for mode, handle in servers.items():
                            r = asyncio.run(_drive(handle.url, clients, args.seconds / args.rounds))
                            runs.setdefault(f"{size}_{mode}_c{clients}", []).append(r)
                for key, rs in runs.items():
                    results[key] = {k: statistics.median(r[k] for r in rs) for k in ("req_s", "tok_s")}
                    print(f"{key:22s}: {results[key]['req_s']:7.1f} req/s {results[key]['tok_s']:9.1f} tok/s (median)")
                if size == "tiny":
                    handle = servers["batched"]
                    asyncio.run(_count(handle.url, 100))
                    rss_100 = _rss_mb(handle)
                    t0 = time.monotonic()
                    asyncio.run(_count(handle.url, args.rss_requests))
                    rss_n = _rss_mb(handle)
                    growth = 100 * (rss_n - rss_100) / rss_100
                    print(
                        f"RSS after 100 requests {rss_100:.1f} MB, after {100 + args.rss_requests} "
                        f"{rss_n:.1f} MB ({growth:+.1f}%, {args.rss_requests / (time.monotonic() - t0):.0f} req/s)"
                    )
                    results.update(
                        rss_mb_after_100=round(rss_100, 1),
                        rss_mb_after_n=round(rss_n, 1),
                        rss_n_requests=100 + args.rss_requests,
                        rss_growth_pct=round(growth, 2),
                    )
            finally:
                for handle in servers.values():
                    handle.stop()
    for size in ("tiny", "small"):
        for clients in (1, 16):
            on, off = results[f"{size}_batched_c{clients}"], results[f"{size}_unbatched_c{clients}"]
            results[f"speedup_{size}_c{clients}"] = round(on["tok_s"] / max(off["tok_s"], 1e-9), 2)
    ratio = round(results["tiny_batched_c16"]["req_s"] / max(results["tiny_unbatched_c16"]["req_s"], 1e-9), 2)
    small = round(results["small_batched_c16"]["req_s"] / max(results["small_unbatched_c16"]["req_s"], 1e-9), 2)
    print(
        f"batching speedup at 16 clients: small {small}x req/s ({results['speedup_small_c16']}x tok/s); "
        f"tiny {results['speedup_tiny_c16']}x tok/s, {ratio}x req/s"
    )
    results["batching_speedup_16_clients"] = ratio
    results["load"] = [round(x, 1) for x in os.getloadavg()]  # shared machine: the load beside the figures
    print(json.dumps(results))


if __name__ == "__main__":
    main()
