"""The engine itself: logprob exactness against teacher forcing, stop strings, the KV budget, reload under load."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from clawpipe.errors import ServingError
from clawpipe.serving import policy
from clawpipe.serving.client import request_reload, server_health
from clawpipe.serving.engine import Engine, SamplingParams, generate
from tests.serving.conftest import ADMIN


def _prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_sampled_logprobs_equal_teacher_forced_logprobs(server: Any, scripted_dir: Path) -> None:
    """Through the HTTP API, batched with other requests of other lengths and temperatures, within 1e-4."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k")
    reference = policy.load_model(scripted_dir, "cpu")
    cases = [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 1.0)]
    results: list[Any] = [None] * 8

    def call(i: int) -> None:
        temp, top_p = cases[i % 4]
        results[i] = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello " * (i + 1)}],
            max_tokens=24,
            temperature=temp,
            top_p=top_p,
            seed=i,
            n=2 if i == 1 else 1,
            logprobs=True,
            extra_body={"return_token_ids": True},
        ).model_dump()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worst = 0.0
    for i, body in enumerate(results):
        temp = cases[i % 4][0]
        for choice in body["choices"]:
            ids = choice["token_ids"]
            got = [e["logprob"] for e in choice["logprobs"]["content"]]
            assert len(got) == len(ids) > 0
            want = policy.compute_logprobs(reference, body["prompt_token_ids"], ids, temp)
            worst = max(worst, *(abs(a - b) for a, b in zip(got, want, strict=True)))
    assert worst < 1e-4


def test_greedy_is_deterministic_and_a_seed_reproduces_sampling(policy_dir: Path) -> None:
    engine = Engine(policy_dir, device="cpu")
    try:
        prompt = _prompt(engine, "tell me a number")

        async def both() -> list[Any]:
            return await asyncio.gather(
                generate(engine, prompt, SamplingParams(temperature=0, max_tokens=16)),
                generate(engine, prompt, SamplingParams(temperature=0, max_tokens=16)),
                generate(engine, prompt, SamplingParams(temperature=1, max_tokens=16, seed=5)),
                generate(engine, prompt, SamplingParams(temperature=1, max_tokens=16, seed=5)),
            )

        (_, g1), (_, g2), (_, s1), (_, s2) = asyncio.run(both())
        assert g1[0]["token_ids"] == g2[0]["token_ids"]
        assert s1[0]["token_ids"] == s2[0]["token_ids"]

        # a seeded request samples the same tokens whatever shares its batch (a top-p neighbour included)
        seeded = SamplingParams(temperature=1, max_tokens=16, seed=11)
        nucleus = SamplingParams(temperature=1, top_p=0.5, max_tokens=16, seed=3)
        (_, alone), (_, alone_p) = (
            asyncio.run(generate(engine, prompt, seeded)),
            asyncio.run(generate(engine, prompt, nucleus)),
        )

        async def mixed() -> list[Any]:
            other = _prompt(engine, "a longer question about numbers")
            return await asyncio.gather(
                generate(engine, prompt, seeded),
                generate(engine, prompt, nucleus),
                generate(engine, other, SamplingParams(temperature=1, top_p=0.8, max_tokens=16, seed=9)),
                generate(engine, other, SamplingParams(temperature=0, max_tokens=16)),
            )

        (_, batched), (_, batched_p), *_ = asyncio.run(mixed())
        assert batched[0]["token_ids"] == alone[0]["token_ids"]
        assert batched_p[0]["token_ids"] == alone_p[0]["token_ids"]
    finally:
        engine.close()


def test_stop_string_cuts_text_and_ends_the_choice(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k")
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "temperature": 0, "max_tokens": 40}
    full = client.chat.completions.create(**ask).choices[0].message.content
    assert full and len(full) > 12
    stop = full[6:9]
    cut = client.chat.completions.create(**ask, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    # streamed: the same text arrives, never a piece of the stop string
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**ask, stop=stop, stream=True)
        if c.choices
    )
    assert text == full[: full.index(stop)]


def test_kv_budget_queues_requests_instead_of_exceeding_it(policy_dir: Path) -> None:
    engine = Engine(policy_dir, device="cpu", kv_budget_tokens=200)
    try:
        prompt = _prompt(engine, "hi")  # ~10 tokens; each request reserves prompt + 60 = ~70 tokens: 2 fit

        async def many() -> list[Any]:
            return await asyncio.gather(
                *[generate(engine, prompt, SamplingParams(max_tokens=60, seed=i)) for i in range(6)]
            )

        results = asyncio.run(many())
        assert all(c[0]["finish_reason"] in ("stop", "length") for _, c in results)
        assert engine.stats["max_rows"] == 2
        with pytest.raises(ValueError, match="KV budget"):
            engine.check(prompt, SamplingParams(max_tokens=195))
    finally:
        engine.close()


def test_reload_under_load_fails_no_request_and_later_responses_report_the_new_version(
    policy_dir: Path, tmp_path: Path
) -> None:
    from clawpipe.serving.server import start_server

    new_dir = policy.init_policy(tmp_path / "v1", size="tiny", seed=1)
    handle = start_server(policy_dir, device="cpu", admin_token=ADMIN, max_model_len=2048, reload_roots=[tmp_path])
    try:
        results: list[tuple[float, float, int, int]] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def client_loop() -> None:
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        r = c.post(
                            f"{handle.url}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 30},
                        )
                        results.append((t0, time.monotonic(), r.status_code, r.json()["policy_version"]))
                    except BaseException as exc:  # collected and asserted below
                        errors.append(exc)

        threads = [threading.Thread(target=client_loop) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        with httpx.Client(timeout=60) as c:
            denied = c.post(f"{handle.url}/admin/reload", json={"path": str(new_dir)})
        r0 = time.monotonic()
        answer = request_reload(handle.url, new_dir, 7, ADMIN)
        r1 = time.monotonic()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        assert denied.status_code == 401
        assert answer["policy_version"] == 7
        assert not errors and all(status == 200 for _, _, status, _ in results)
        assert {v for *_, v in results} == {0, 7}
        assert all(v == 7 for t0, _, _, v in results if t0 > r1)  # started after the reload answered
        assert all(v == 0 for _, t1, _, v in results if t1 < r0)  # finished before it was asked
        assert server_health(handle.url)["policy_version"] == 7
        with pytest.raises(ServingError, match="refused"):
            request_reload(handle.url, tmp_path / "missing", 8, ADMIN)
        # a checkpoint still being written (truncated weights) and a body that is not JSON: 400, still serving
        partial = tmp_path / "partial"
        partial.mkdir()
        for f in new_dir.iterdir():
            data = f.read_bytes()
            (partial / f.name).write_bytes(data[: len(data) // 2] if f.name.endswith(".safetensors") else data)
        auth = {"Authorization": f"Bearer {ADMIN}"}
        with httpx.Client(timeout=60) as c:
            corrupt = c.post(f"{handle.url}/admin/reload", json={"path": str(partial)}, headers=auth)
            garbage = c.post(f"{handle.url}/admin/reload", content=b"garbage", headers=auth)
            after = c.post(f"{handle.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert corrupt.status_code == 400 and "completely written" in corrupt.json()["error"]["message"]
        assert garbage.status_code == 400 and "not valid JSON" in garbage.json()["error"]["message"]
        assert after.status_code == 200 and after.json()["policy_version"] == 7
    finally:
        handle.stop()


def test_prefix_cache_reuses_a_previous_prompt_and_stays_exact(policy_dir: Path) -> None:
    """A follow-up prompt extending an earlier one (a harness's next turn) reuses its KV; logprobs stay exact,
    also across more than one prefill chunk, with n > 1, and after a reload (which must clear the cache)."""
    engine = Engine(policy_dir, device="cpu")
    try:
        first = _prompt(engine, "Read the file and run the tests. " * 40)  # > PrefixCache.MIN_TOKENS
        params = SamplingParams(temperature=0.8, max_tokens=16, seed=1)
        _, (c1,) = asyncio.run(generate(engine, first, params))
        follow = first + c1["token_ids"] + _prompt(engine, "ok, the tests pass now. " * 60)  # > 512 new tokens
        _, choices = asyncio.run(generate(engine, follow, SamplingParams(temperature=0.8, max_tokens=16, seed=2, n=2)))
        assert engine.stats["prefix_hit_tokens"] >= len(first)
        reference = policy.load_model(policy_dir, "cpu")
        for c in [*choices, c1]:
            prompt = first if c is c1 else follow
            want = policy.compute_logprobs(reference, prompt, c["token_ids"], 0.8)
            assert max(abs(a - b) for a, b in zip(c["logprobs"], want, strict=True)) < 1e-4
        assert len(engine.prefix_cache._entries) == 2
        asyncio.run(engine.reload(policy_dir, 1))
        assert not engine.prefix_cache._entries
    finally:
        engine.close()


def test_sampled_logprobs_equal_the_trainers_scores(server: Any, scripted_dir: Path) -> None:
    """The issue's exactness contract, against clawpipe.train's own scoring of a flat sequence."""
    import numpy as np
    import torch

    from clawpipe.train.losses import score
    from clawpipe.train.packing import MicroBatch

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k")
    body = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "train me"}],
        max_tokens=20,
        temperature=0.7,
        seed=11,
        logprobs=True,
        extra_body={"return_token_ids": True},
    ).model_dump()
    prompt, ids = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    got = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    seq = prompt + ids
    n, p = len(seq), len(prompt)
    mb = MicroBatch(
        input_ids=torch.tensor([seq]),
        position_ids=torch.arange(n)[None],
        attention_mask=torch.ones((1, n), dtype=torch.long),
        score_rows=torch.arange(p - 1, n - 1),
        score_targets=torch.tensor(ids),
        contrib_index=np.arange(len(ids)),
        contrib_score=torch.arange(len(ids)),
        n_tokens=n,
    )
    with torch.no_grad():
        want = score(policy.load_model(scripted_dir, "cpu"), mb, temperature=0.7).logprob.tolist()
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_a_client_that_hangs_up_frees_its_rows(policy_dir: Path) -> None:
    """A non-streamed request whose client is gone is cancelled: its rows leave the batch at once instead of
    decoding to max_tokens for nobody (this prompt never reaches EOS greedily on the tiny policy)."""
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token=ADMIN, max_model_len=4096)
    try:
        body = {"prompt": "hi", "max_tokens": 4000, "n": 16, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{handle.url}/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{handle.url}/health").json())["running"] or health["waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health["stats"]["tokens"] < 16 * 4000 // 2  # the full request would be 64,000 tokens
    finally:
        handle.stop()


def test_stopping_the_server_ends_open_requests_at_once_with_a_clear_error(policy_dir: Path) -> None:
    """Queued, running and streaming requests get 503 / an error event saying the server is shutting down,
    instead of holding the shutdown open until they would have finished (or hanging)."""
    from clawpipe.serving.server import start_server

    handle = start_server(policy_dir, device="cpu", admin_token=ADMIN, max_model_len=4096, max_batch=16)
    outcomes: dict[int, Any] = {}
    body = {"prompt": "hi", "max_tokens": 4000, "n": 16, "temperature": 0}  # 16 rows: later ones queue

    def call(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            if i % 2:
                outcomes[i] = c.post(f"{handle.url}/v1/completions", json=body)
            else:
                with c.stream("POST", f"{handle.url}/v1/completions", json={**body, "stream": True}) as r:
                    outcomes[i] = [line for line in r.iter_lines() if line][-1]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (h := server_health(handle.url))["running"] == 0 or h["waiting"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    handle.stop()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and len(outcomes) == 4
    for i, out in outcomes.items():
        if i % 2:
            assert out.status_code == 503 and "shutting down" in out.json()["error"]["message"]
        else:
            assert "shutting down" in json.loads(out.removeprefix("data: "))["error"]["message"]


def test_batch_kv_grows_in_place_and_equals_concatenation() -> None:
    """Decode steps write their position into buffers with room (no copy of the whole cache per step), and what
    attention sees equals the concatenated cache; past the room the buffer grows."""
    import torch

    from clawpipe.serving.hf_cache import GrowingLayer

    k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    layer = GrowingLayer(k, v, capacity=7)
    buffer = layer._k.data_ptr()
    ref_k, ref_v = k, v
    for step in range(4):
        nk, nv = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        got_k, got_v = layer.update(nk, nv)
        ref_k, ref_v = torch.cat([ref_k, nk], 2), torch.cat([ref_v, nv], 2)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
        assert layer.get_seq_length() == 6 + step
        assert (layer._k.data_ptr() == buffer) == (step < 2)  # in place while it fits (7), then grown
