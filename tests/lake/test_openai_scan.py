"""The compiled reader of plain OpenAI bodies (clawpipe/lake/_openai_scan.c) against msgspec's reader.

The compiled reader must give exactly the columns msgspec's reader gives, or step aside (None) and leave the
body to it: on production-shaped bodies, on hand-made edge shapes, on bodies broken in thousands of random
ways, on a million decimal logprobs, and through a whole landing (the Parquet written with it and without
it is the same).
"""

from __future__ import annotations

import array
import json
import math
import os
import random
import re
import struct
import sys
from decimal import Decimal, getcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawpipe.lake import land, openai_fast
from clawpipe.lake.openai_fast import _from_scan, parse_openai_fast, parse_openai_msgspec
from clawpipe.lake.parsed import ParsedCall

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import data

scan = openai_fast._openai_scan.scan if openai_fast._openai_scan is not None else None


def test_the_reader_is_built_by_the_install() -> None:
    # make setup compiles it (setup.py); a missing compiler would leave landing on the slower reader
    assert scan is not None, "clawpipe.lake._openai_scan was not built: install gcc and the Python headers, rerun make"


def _plain(v: Any) -> Any:
    if isinstance(v, array.array | np.ndarray):
        return [float(x) if isinstance(x, float | np.floating) else int(x) for x in v.tolist()]
    return v


def _fields(p: ParsedCall) -> dict[str, Any]:
    out = {k: _plain(getattr(p, k)) for k in ParsedCall.__slots__ if k not in ("choices", "response")}
    out["response"] = bytes(p.response) if p.response is not None else None
    out["choices"] = [{k: _plain(getattr(c, k)) for k in type(c).__slots__} for c in p.choices]
    return out


def _compiled(body: bytes | memoryview, api: str) -> ParsedCall | None:
    assert scan is not None
    got = scan(body)
    return None if got is None else _from_scan(got, body, api)


def _agree(body: bytes, api: str) -> bool:
    """The compiled answer equals msgspec's, or the compiled reader stepped aside; True where it answered."""
    fast = _compiled(body, api)
    if fast is None:
        return False
    slow = parse_openai_msgspec(body, api)
    assert slow is not None, f"msgspec refuses what the compiled reader took: {body[:300]!r}"
    assert _fields(fast) == _fields(slow), body[:300]
    return True


def _production_bodies(n: int, shape: str, seed: int) -> list[bytes]:
    return [resp for _, _, resp in data.calls(n, data.shape(shape), seed=seed)]


def test_agrees_on_production_shaped_bodies() -> None:
    bodies = _production_bodies(600, "small", 3) + _production_bodies(12, "large", 4)
    answered = sum(_agree(b, "chat") for b in bodies)
    assert answered >= 0.95 * len(bodies)  # all but the error bodies the generator mixes in


def _logprob_text(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.5:
        return repr(-rng.expovariate(1.0) * 10 ** rng.randint(-9, 2))
    if k < 0.7:
        return str(rng.randint(-40, 0))
    if k < 0.85:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 24)))
        return f"-0.{digits}e{rng.randint(-40, 5)}"
    bits = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
    return repr(bits) if math.isfinite(bits) else "-1.5"


def _edge_body(rng: random.Random, api: str) -> bytes:
    """A body of the plain shape with the variations servers and gateways produce."""
    choices = []
    for i in range(rng.choice([1, 1, 2, 4])):
        n_tok = rng.randint(0, 40)
        c: dict[str, Any] = {"index": i if rng.random() < 0.9 else rng.randint(0, 3)}
        if rng.random() < 0.9:
            c["finish_reason"] = rng.choice(["stop", "length", "tool_calls", None, "ä€😀"])
        if rng.random() < 0.8:
            c["token_ids"] = [rng.choice([0, 1, 7, 2**31 - 1, rng.randint(0, 200_000)]) for _ in range(n_tok)]
        elif rng.random() < 0.5:
            c["token_ids"] = None
        if rng.random() < 0.3:
            c["prompt_token_ids"] = (
                [rng.randint(0, 10**9) for _ in range(rng.randint(0, 30))] if rng.random() < 0.8 else None
            )
        text = "".join(rng.choice(["a", " ", "\n", '"', "\\", "é", "😀", "\u2028", "\t", "{", "]"]) for _ in range(30))
        if api == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if rng.random() < 0.3:
                msg["tool_calls"] = [
                    {
                        "id": f"call_{j}",
                        "type": "function",
                        "function": {"name": "f", "arguments": json.dumps({"x": [j, 1.5]})},
                    }
                    for j in range(rng.randint(0, 3))
                ]
            c["message"] = msg if rng.random() < 0.95 else None
        else:
            c["text"] = text
        lp_kind = rng.random()
        lps = [_logprob_text(rng) for _ in range(n_tok)]
        if lp_kind < 0.5:
            entries = [
                f'{{"token":{json.dumps(text[:3])},"logprob":{x},"bytes":[{rng.randint(0, 255)}],"top_logprobs":[]}}'
                for x in lps
            ]
            c["logprobs"] = "RAW:{" + '"content":[' + ",".join(entries) + "]}"
        elif lp_kind < 0.8:
            c["logprobs"] = "RAW:{" + '"tokens":["a"],"token_logprobs":[' + ",".join(lps) + "]}"
        elif lp_kind < 0.9:
            c["logprobs"] = None
        choices.append(c)
    top: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion" if api == "chat" else "text_completion",
        "choices": choices,
    }
    if rng.random() < 0.7:
        top["prompt_token_ids"] = [rng.randint(0, 150_000) for _ in range(rng.randint(0, 50))]
    if rng.random() < 0.7:
        top["usage"] = {"prompt_tokens": rng.randint(0, 99), "completion_tokens": rng.randint(0, 99), "total_tokens": 5}
    if rng.random() < 0.3:
        top["policy_version"] = rng.choice([None, 0, 3, 2**40])
    if rng.random() < 0.2:
        top["spliced_tokens"] = rng.randint(0, 500)
    if rng.random() < 0.5:
        top["model"] = rng.choice(["m", "Qwen/Qwen2-0.5B", None, "ünï"])
    keys = list(top)
    rng.shuffle(keys)
    indent = rng.choice([None, None, 1, 2])
    parts = []
    for k in keys:
        v = top[k]
        if k == "choices":
            inner = []
            for c in v:
                raw = {kk: vv for kk, vv in c.items() if not (isinstance(vv, str) and vv.startswith("RAW:"))}
                text = json.dumps(raw, indent=indent, ensure_ascii=rng.random() < 0.5)
                for kk, vv in c.items():
                    if isinstance(vv, str) and vv.startswith("RAW:"):
                        text = text[:-1].rstrip() + ("," if raw else "") + json.dumps(kk) + ":" + vv[4:] + "}"
                inner.append(text)
            parts.append('"choices": [' + ",".join(inner) + "]")
        else:
            parts.append(json.dumps(k) + ": " + json.dumps(v, indent=indent))
    return ("{" + ", ".join(parts) + "}").encode()


# a kept string (finish_reason, model) written with escapes: the one plain form handed back to msgspec
_KEPT_ESCAPED = re.compile(rb'"(finish_reason|model)":\s*"[^"]*\\')


def test_agrees_on_edge_shapes_of_the_plain_body() -> None:
    rng = random.Random(11)
    answered = 0
    for i in range(3000):
        api = "chat" if i % 2 else "completions"
        body = _edge_body(rng, api)
        took = _agree(body, api)
        assert took or _KEPT_ESCAPED.search(body), f"the plain shape was handed back: {body[:400]!r}"
        answered += took
    assert answered > 2000


_BREAKS = [
    lambda b, r: b[: r.randrange(len(b))],  # cut short
    lambda b, r: b[: (i := r.randrange(len(b)))] + bytes([r.randrange(256)]) + b[i + 1 :],  # one byte changed
    lambda b, r: (
        b[: (i := r.randrange(len(b)))] + r.choice([b",", b"]", b"}", b'"', b"\\", b"-", b".", b"e", b" "]) + b[i:]
    ),
    lambda b, r: b[: (i := r.randrange(len(b)))] + b[i + 1 :],  # one byte dropped
    lambda b, r: b.replace(b'"choices"', b'"ch\\u006fices"', 1),  # a key spelled with an escape
    lambda b, r: b.replace(b'"token_ids": [', b'"token_ids": [1, "2", ', 1),
    lambda b, r: b.replace(b'"index": 0', b'"index": 0, "index": 1', 1),  # a key twice
    lambda b, r: b.replace(b'"logprob":', b'"logprob":1e400, "x":', 1),
    lambda b, r: b.replace(b'"token_ids": [', b'"token_ids": [2147483648, ', 1),
    lambda b, r: b.replace(b'"token_ids": [', b'"token_ids": [-1, ', 1),
    lambda b, r: b.replace(b'"model": ', b'"model": 5, "m": ', 1),
    lambda b, r: b.replace(b'"role"', b'"r\\ud800le"', 1),  # a lone surrogate
    lambda b, r: b.replace(b'"role"', b'"r\xc0\xafle"', 1),  # an overlong UTF-8 form
    lambda b, r: b.replace(b'"id": "x"', b'"id": ' + b"[" * 300 + b"]" * 300, 1),  # deep nesting
    lambda b, r: b.replace(b'"id": "x"', b'"id": NaN', 1),
    lambda b, r: b + b"x",  # trailing bytes
    lambda b, r: b"\xef\xbb\xbf" + b,  # a byte order mark
    lambda b, r: b.replace(b'"choices": [', b'"error": {"message": "x"}, "choices": [', 1),
    lambda b, r: b.replace(b'"usage": {', b'"usage": {"prompt_tokens": 1.5, "x": ', 1),
    lambda b, r: b.replace(b"tool_calls", b"tool_calls\x00", 1),
]


def test_broken_bodies_are_left_to_msgspec_or_read_alike() -> None:
    rng = random.Random(5)
    seeds = [_edge_body(rng, "chat") for _ in range(40)] + _production_bodies(40, "small", 6)
    for i in range(12_000):
        body = _BREAKS[i % len(_BREAKS)](rng.choice(seeds), rng)
        fast, slow = _outcome(_compiled, body), _outcome(parse_openai_msgspec, body)
        if fast != ("answer", None):  # it answered (or raised, as landing's reject): msgspec must agree
            assert slow != ("answer", None), f"the compiled reader took a body msgspec refuses: {body[:300]!r}"
            assert fast == slow, body[:300]


def _outcome(read: Any, body: bytes) -> tuple[str, Any]:
    try:
        got = read(body, "chat")
    except Exception as exc:  # a tool call of another shape: both raise it, and landing makes it a reject
        return "raised", type(exc)
    return "answer", None if got is None else _fields(got)


def test_decimal_logprobs_are_read_as_python_reads_them() -> None:
    """The quick long-double path against float() on a million numbers, near-midpoints among them."""
    assert scan is not None
    rng = random.Random(7)
    getcontext().prec = 40
    for _ in range(100):
        texts = []
        for _ in range(10_000):
            k = rng.random()
            if k < 0.8:
                texts.append(_logprob_text(rng))
            else:  # a double plus or minus half an ulp, written out: the hardest case for double rounding
                x = rng.uniform(-30.0, 0.0)
                mid = Decimal(x) + Decimal(math.ulp(x)) / 2 * rng.choice([1, -1])
                texts.append(f"{mid:.{rng.randint(15, 19)}e}")
        got = scan(('{"choices":[{"logprobs":{"token_logprobs":[' + ",".join(texts) + "]}}]}").encode())
        assert got is not None
        values = got[6][0][5]
        for text, v in zip(texts, values, strict=True):
            want = float(text)
            assert v == want and math.copysign(1.0, v) == math.copysign(1.0, want), text


def test_views_are_read_in_place_and_never_past_their_end() -> None:
    body = _production_bodies(1, "small", 8)[0]
    frame = b"HEAD" + body + b"1234"
    view = memoryview(frame)[4 : 4 + len(body)]
    fast = _compiled(view, "chat")
    assert fast is not None and _fields(fast) == _fields(parse_openai_msgspec(body, "chat"))  # type: ignore[arg-type]
    # a body cut inside a number that the frame continues with digits: not read as a longer number
    cut = b'{"choices":[{"logprobs":{"token_logprobs":[-0.5'
    assert scan is not None and scan(memoryview(cut + b"123]}}]}")[: len(cut)]) is None
    assert scan(memoryview(b'{"choices":[],"prompt_token_ids":[12' + b"34]}")[:33]) is None


def test_a_landing_writes_the_same_lake_with_and_without_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data.write_segments(tmp_path / "cap", 300, data.shape("small"), per_segment=100, seed=9, run_id="r")
    data.write_segments(tmp_path / "cap", 6, data.shape("large"), per_segment=3, seed=10, run_id="r")
    with_it = land(tmp_path / "cap", tmp_path / "lake_c")
    monkeypatch.setattr(openai_fast, "_openai_scan", None)
    without = land(tmp_path / "cap", tmp_path / "lake_py")
    assert with_it.calls == without.calls == 306 and with_it.rejects == without.rejects

    def table(lake: Path) -> Any:
        files = sorted(p for p in lake.rglob("*.parquet") if "model_calls" in p.parts)
        t = pa.concat_tables([pq.ParquetFile(f).read() for f in files])
        return t.sort_by([("call_id", "ascending"), ("choice_index", "ascending")])

    a, b = table(tmp_path / "lake_c"), table(tmp_path / "lake_py")
    assert a.num_rows == b.num_rows >= 306
    assert a.equals(b)
    # and it lands what the generic parser would: a body the compiled reader took is fine to msgspec too
    assert parse_openai_fast(_production_bodies(1, "small", 12)[0], "chat") is not None


_SANITIZED_RUN = """
import random, sys
sys.path.insert(0, sys.argv[1])
import _openai_scan as sanitized
import tests.lake.test_openai_scan as t
from clawpipe.lake import openai_fast
openai_fast._openai_scan = sanitized
t.scan = sanitized.scan
t.test_agrees_on_edge_shapes_of_the_plain_body()
t.test_broken_bodies_are_left_to_msgspec_or_read_alike()
t.test_views_are_read_in_place_and_never_past_their_end()
for body in t._production_bodies(20, "small", 1) + t._production_bodies(2, "large", 2):
    for k in range(0, len(body), 11):  # every cut as a buffer of its own size, as a view, as a bytearray
        sanitized.scan(body[:k]); sanitized.scan(memoryview(body)[:k]); sanitized.scan(bytearray(body[:k]))
print("clean")
"""


def test_the_reader_reads_no_byte_outside_its_buffers(tmp_path: Path) -> None:
    """The same bodies (broken ones among them) through a build with AddressSanitizer and UBSan: an
    out-of-bounds read, a use after free or undefined behaviour fails the run."""
    import subprocess
    import sysconfig

    src = Path(openai_fast.__file__).with_name("_openai_scan.c")
    so = tmp_path / ("_openai_scan" + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-shared", "-fPIC"]
    subprocess.run(["cc", *flags, f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(so)], check=True)
    runtimes = [
        subprocess.run(["cc", f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout.strip()
        for lib in ("libasan.so", "libubsan.so")
    ]
    assert all(Path(r).is_file() for r in runtimes), f"the sanitizer runtimes are missing: {runtimes}"
    env = {
        **os.environ,
        "LD_PRELOAD": " ".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
        "PYTHONMALLOC": "malloc",  # Python's buffers from malloc, so that the sanitizer sees their bounds
    }
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", _SANITIZED_RUN, str(tmp_path)], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("clean"), run.stderr[-3000:]
