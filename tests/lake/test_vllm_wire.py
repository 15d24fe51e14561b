"""vLLM's real wire format (fixtures built from vLLM 0.33.0's own response classes, see fixtures_vllm/):
prompt ids are read where vLLM puts them, for every endpoint, streamed or not, large bodies included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clawpipe import capture
from clawpipe.lake import land, run_audits, run_sql
from clawpipe.lake.parse import parse_response
from tests.lake import fixtures as fx

FIXTURES = Path(__file__).resolve().parent / "fixtures_vllm"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def _fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_fixtures_cover_every_endpoint_streamed_or_not() -> None:
    kinds = {(f["api"], f["stream"]) for f in map(_fixture, NAMES)}
    assert kinds == {(api, stream) for api in ("chat", "completions") for stream in (False, True)}
    assert all(_fixture(n)["generated_by"].startswith("vllm 0.33.0") for n in NAMES)


def _land(tmp_path: Path, fixtures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    frames = [
        capture.encode_record(
            fx.header(api=f["api"], stream=f["stream"], call_id=name, policy_version=0),
            fx.request_body(f["api"], f["stream"]),
            f["body"].encode(),
        )
        for name, f in fixtures.items()
    ]
    fx.write_segment(tmp_path / "cap" / "vllm-1.seg", frames)
    rep = land(tmp_path / "cap", tmp_path / "lake")
    assert rep.rejects == 0
    return run_sql(tmp_path / "lake", "select * from model_calls order by call_id, choice_index").to_pylist()


@pytest.mark.parametrize("name", [n for n in NAMES if not n.endswith("_error")])
def test_prompt_and_completion_ids_land_from_vllm_bodies(tmp_path: Path, name: str) -> None:
    f = _fixture(name)
    rows = _land(tmp_path, {name: f})
    want = f["expected"]
    assert len(rows) == len(want["choices"])
    for row, choice in zip(rows, want["choices"], strict=True):
        assert row["prompt_token_ids"] == want["prompt_token_ids"], "prompt ids from where vLLM puts them"
        assert row["completion_token_ids"] == choice["token_ids"]
        np.testing.assert_allclose(row["completion_logprobs"], choice["logprobs"], rtol=1e-6)
        assert (row["finish_reason"], row["token_source"], row["status"]) == (choice["finish_reason"], "upstream", "ok")
        assert row["prompt_tokens"] is not None
    assert run_audits(tmp_path / "lake")["upstream_ids_missing"].num_rows == 0


def test_vllm_stream_cut_by_an_engine_error(tmp_path: Path) -> None:
    f = _fixture("completions_stream_error")
    (row,) = _land(tmp_path, {"e": f})
    assert (row["status"], row["error"]) == (f["expected"]["status"], f["expected"]["error"])
    assert row["prompt_token_ids"] == f["expected"]["prompt_token_ids"]


@pytest.mark.parametrize("name", ["completions", "chat"])
def test_large_vllm_bodies_take_the_fast_path_with_the_same_result(name: str) -> None:
    """Over 32 KB the prompt ids are parsed apart from the rest: also when they sit in the choice."""
    obj = json.loads(_fixture(name)["body"])
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 151_000, 20_000)]
    if name == "completions":
        obj["choices"][0]["prompt_token_ids"] = prompt
    else:
        obj["prompt_token_ids"] = prompt
    body = json.dumps(obj).encode()
    assert len(body) > 32 << 10
    parsed = parse_response(name, False, body)
    got = parsed.choices[0].prompt_token_ids if name == "completions" else parsed.prompt_token_ids
    assert [int(x) for x in got] == prompt
    small = parse_response(name, False, _fixture(name)["body"].encode())
    assert parsed.choices[0].token_ids == small.choices[0].token_ids
