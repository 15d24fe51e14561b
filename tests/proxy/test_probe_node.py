"""Node.js clients at the proxy (node's own fetch, which is undici, and its http module): calls in a row on
fetch's keep-alive connections, streamed and not, a stream aborted with an AbortController halfway, a body sent
chunked with a trailer, and a body given as a ReadableStream. Each call is captured exactly once, as the client
saw it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.proxy.conftest import ProxyHandle
from tests.support.upstream import ScriptedUpstream, say

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node (Node.js)")

SCRIPT = r"""
import http from 'node:http';
const base = process.argv[2];
const chat = (content, stream) => JSON.stringify({model: 'm', stream, messages: [{role: 'user', content}]});
const out = {};
const post = (content, stream, extra = {}) => fetch(`${base}/chat/completions`,
  {method: 'POST', headers: {'content-type': 'application/json'}, body: chat(content, stream), ...extra});

// three calls in a row, one streamed, on the connections fetch keeps alive
out.keepalive = [];
for (const [i, stream] of [[0, false], [1, true], [2, false]]) {
  const r = await post(`keep${i}`, stream);
  const text = await r.text();
  out.keepalive.push([r.status, stream ? text.includes('data: [DONE]') : JSON.parse(text).choices.length]);
}

// a stream aborted after its first bytes
{
  const ac = new AbortController();
  const r = await post('abort', true, {signal: ac.signal});
  const reader = r.body.getReader();
  let got = 0;
  try {
    for (;;) { const {done, value} = await reader.read(); if (done) break; got += value.length; ac.abort(); }
  } catch (e) { out.abort = [r.status, e.name, got > 0]; }
}

// a chunked body in two writes, with a trailer
out.trailer = await new Promise((resolve, reject) => {
  const u = new URL(`${base}/chat/completions`);
  const req = http.request({host: u.hostname, port: u.port, path: u.pathname, method: 'POST',
    headers: {'content-type': 'application/json', 'trailer': 'x-checksum'}}, (res) => {
      let text = ''; res.on('data', (c) => { text += c; });
      res.on('end', () => resolve([res.statusCode, JSON.parse(text).choices[0].message.content]));
    });
  req.on('error', reject);
  const body = chat('trailer', false);
  req.write(body.slice(0, 7)); req.write(body.slice(7)); req.addTrailers({'x-checksum': 'abc'}); req.end();
});

// a ReadableStream body (sent chunked)
{
  const body = chat('readable', false);
  const enc = new TextEncoder();
  const rs = new ReadableStream({start(c) {
    c.enqueue(enc.encode(body.slice(0, 5))); c.enqueue(enc.encode(body.slice(5))); c.close();
  }});
  const r = await post('', false, {body: rs, duplex: 'half'});
  out.readable = [r.status, JSON.parse(await r.text()).choices[0].message.content];
}
console.log(JSON.stringify(out));
"""


def _records_of(proxy: ProxyHandle, n: int) -> list[Any]:
    deadline = time.monotonic() + 10
    while len(proxy.records()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return proxy.records()


def test_node_fetch_and_http_clients_are_each_captured_once(make_proxy: Any, tmp_path: Path):
    upstream = ScriptedUpstream(default=say("word " * 40), chunk_delay_s=0.01).start()
    try:
        proxy = make_proxy([upstream.url])
        script = tmp_path / "client.mjs"
        script.write_text(SCRIPT)
        run = subprocess.run(
            ["node", str(script), proxy.openai_base("node")], capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["keepalive"] == [[200, 1], [200, True], [200, 1]]
        assert out["abort"] == [200, "AbortError", True]
        assert out["trailer"] == [200, "word " * 40]
        assert out["readable"] == [200, "word " * 40]
        records = _records_of(proxy, 6)
        contents = [json.loads(r.request)["messages"][0]["content"] for r in records]
        assert sorted(contents) == sorted(["keep0", "keep1", "keep2", "abort", "trailer", "readable"])
        status = {c: (r.header["status"], r.header["http_status"]) for c, r in zip(contents, records, strict=True)}
        assert status.pop("abort") == ("cancelled", 200)  # the stream's head had reached the client
        assert set(status.values()) == {("ok", 200)}
        body = {c: r.request for c, r in zip(contents, records, strict=True)}
        assert (
            body["trailer"]
            == json.dumps(
                {"model": "m", "stream": False, "messages": [{"role": "user", "content": "trailer"}]},
                separators=(",", ":"),
            ).encode()
        )  # the chunks joined, the trailer left out
        assert len(upstream.model_requests()) == 6
    finally:
        upstream.stop()
