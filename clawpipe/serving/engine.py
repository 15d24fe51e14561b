"""The batching engine: one worker thread runs a hand-written KV-cache decode loop over every admitted sequence.

Requests arrive from asyncio (`Engine.stream`), wait in a FIFO queue, and are admitted whole (all n choices)
while the batch stays within `max_batch` rows and the KV token budget. The budget bounds the padded cache:
rows x max(prompt + max_tokens) <= kv_budget_tokens, so memory never exceeds it; requests queue instead.

Per step: new requests with short prompts are prefilled (grouped by prompt length, so no padding and no mask in
prefill); a long prompt (more than `prefill_chunk_tokens` to compute) is prefilled in chunks, at most that many
tokens per step, so the running rows take a decode step between its chunks instead of waiting for the whole
prompt. Prefilled caches are left-padded into the running batch, then one decode step runs for every row with
position_ids = number of real tokens so far and a 2D mask over the padding. Sampling uses softmax(raw_logits / T)
with top-p, one RNG per choice (seeded from the request's seed + choice index); the reported logprob is
log_softmax(raw_logits / T)[sampled] (T = 0: argmax, scored under T = 1). A row stops at EOS (included in its
ids), a stop string, or max_tokens, and nothing after that is computed for it. Ids go out with their text only:
an id whose text may still be the start of a stop string waits, and the ids whose text reaches into a stop
string are left out, so every response's ids and logprobs decode to exactly its text.

The parts: params.py (requests, their checks and events), prefill.py (prompts -> KV, chunked), kv.py (the
batch's KV buffers and padding mask), hf_cache.py (the only code touching transformers' cache classes),
sampler.py, prefix_cache.py. This file schedules: admission, the step loop, rows, events, reload.

Reload: `Engine.reload` loads new weights off-thread, then the worker stops admitting, lets the running batch
finish, swaps the model and bumps `policy_version`; queued requests then run on the new weights.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
import secrets
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import torch

from clawpipe.errors import ServingError
from clawpipe.serving import policy
from clawpipe.serving.hf_cache import KV
from clawpipe.serving.kv import BatchKV
from clawpipe.serving.params import (
    SHUTTING_DOWN,
    Request,
    RequestError,
    SamplingParams,
    ShuttingDown,
    TokenEvent,
    check_request,
)
from clawpipe.serving.prefill import Prefilled, Prefiller
from clawpipe.serving.prefix_cache import PrefixCache
from clawpipe.serving.rows import Row
from clawpipe.serving.sampler import sample
from clawpipe.serving.text import Detokenizer, TokenTable

__all__ = ["Engine", "RequestError", "SamplingParams", "ShuttingDown", "TokenEvent", "generate"]

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # default prompt tokens computed per engine step (attention memory ~ chunk x context)
MAX_PROMPT_TOKENS = 65536  # default prompt limit (below the model's context when that is smaller)


class Engine:
    """A transformers causal LM behind a dynamic batcher. Thread-safe `submit`; one worker thread computes."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_batch: int = 64,
        kv_budget_tokens: int = 262144,
        max_model_len: int | None = None,
        policy_version: int = 0,
        served_name: str | list[str] | None = None,
        prefix_cache_mb: float = 256,
        prefill_chunk_tokens: int = PREFILL_CHUNK,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = policy.load_tokenizer(model_dir)
        self.model = policy.load_model(model_dir, device, dtype)
        policy.check_tokenizer_fits(self.tokenizer, self.model.config.vocab_size, model_dir)
        if self.tokenizer.chat_template is None:
            log.warning("%s has no chat template: chat requests get a 400, /v1/completions works", model_dir)
        self.device = next(self.model.parameters()).device
        self.dtype = dtype
        self.max_batch = max(1, max_batch)
        self.kv_budget_tokens = kv_budget_tokens
        cfg_len = int(getattr(self.model.config, "max_position_embeddings", 4096) or 4096)
        self.max_model_len = min(max_model_len or cfg_len, cfg_len)
        self.max_prompt_tokens = min(max_prompt_tokens or MAX_PROMPT_TOKENS, self.max_model_len - 1)
        self.policy_version = policy_version
        names = [served_name] if isinstance(served_name, str) else list(served_name or [])
        self.served_names = list(dict.fromkeys(names)) or [self.model_dir.name]  # the model names clients may send
        self.served_name = self.served_names[0]
        self.table = TokenTable(self.tokenizer)
        self.stop_ids = self._stop_ids()
        self.hidden_ids = set(self.stop_ids)
        self._waiting: collections.deque[Request] = collections.deque()
        self._rows: list[Row] = []
        self._kv = BatchKV()  # the rows' KV, in buffers with room for their coming tokens
        self._pending_reload: tuple[Any, int, asyncio.Future[int], asyncio.AbstractEventLoop] | None = None
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self.stats = {
            "steps": 0,
            "tokens": 0,
            "requests": 0,
            "max_rows": 0,
            "prefix_hit_tokens": 0,
            "prefill_chunks": 0,
        }
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20 // self.kv_bytes_per_token()))
        self._prefilling = Prefiller(self.prefix_cache, prefill_chunk_tokens, self.stats)  # admitted, not computed
        self._thread = threading.Thread(target=self._run, name="clawpipe-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (any thread / asyncio)

    def _stop_ids(self) -> list[int]:
        ids: set[int] = set()
        eos = self.model.generation_config.eos_token_id
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None:
                ids.add(int(e))
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        end = self.tokenizer.convert_tokens_to_ids(policy.ENDOFTEXT)
        if isinstance(end, int) and end != self.tokenizer.unk_token_id:
            ids.add(end)
        return sorted(ids)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        item = next(self.model.parameters()).element_size()
        return int(cfg.num_hidden_layers * 2 * kv_heads * head_dim * item)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError when the request can never be served (context, max_tokens, budget, values)."""
        check_request(
            prompt_ids,
            params,
            context=self.max_model_len,
            prompt_limit=self.max_prompt_tokens,
            kv_budget=self.kv_budget_tokens,
            vocab=self.model.config.vocab_size,
        )

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncGenerator[Any, None]:
        """Yield ('version', int) once admitted, then lists of TokenEvent, until every choice has finished."""
        self.check(prompt_ids, params)
        loop = asyncio.get_running_loop()
        req = Request(prompt_ids=list(prompt_ids), params=params, loop=loop, queue=asyncio.Queue())
        with self._cond:
            if self._stopping:
                raise ShuttingDown(SHUTTING_DOWN)
            self._waiting.append(req)
            self._cond.notify()
        done = 0
        try:
            while done < params.n:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, tuple):
                    yield item
                    continue
                done += sum(1 for ev in item if ev.finish_reason is not None)
                yield item
        finally:
            req.cancelled = True

    async def reload(self, path: str | Path, policy_version: int | None = None) -> int:
        """Load weights from `path`, swap them in once the running batch has drained; returns the new version."""
        model = await asyncio.to_thread(policy.load_model, path, self.device, self.dtype)
        if model.config.vocab_size != self.model.config.vocab_size:
            raise RequestError(
                f"the checkpoint in {path} has vocab_size {model.config.vocab_size}, the served policy "
                f"{self.model.config.vocab_size}: reload needs the same tokenizer; restart the server for a new one"
            )
        positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        if positions and positions < self.max_model_len:  # learned positions past the table index out of range
            raise RequestError(
                f"the checkpoint in {path} has max_position_embeddings {positions}, below the served context "
                f"{self.max_model_len}: requests that fit the context would fail; restart the server to serve it"
            )
        await asyncio.to_thread(self._warn_other_tokenizer, Path(path))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        version = self.policy_version + 1 if policy_version is None else int(policy_version)
        with self._cond:
            if self._pending_reload is not None:
                raise RequestError("a reload is already in progress; retry when it has finished", status=409)
            self._pending_reload = (model, version, fut, loop)
            self._cond.notify()
        new_version = await fut
        self.model_dir = Path(path)
        return new_version

    def _warn_other_tokenizer(self, path: Path) -> None:
        """Log when a checkpoint carries a tokenizer other than the served one: the engine keeps its tokenizer
        across a reload, so weights trained on other ids would be served prompts they were never trained on.
        Logged, not refused: a policy rebuilt from scratch under another seed is published the same way."""
        if not (path / "tokenizer.json").is_file():
            return
        theirs = policy.load_tokenizer(path)
        if theirs.get_vocab() != self.tokenizer.get_vocab():
            log.warning(
                "the tokenizer in %s differs from the served one (%d vs %d ids, or other pieces); the engine keeps "
                "the served tokenizer: restart the server to serve the checkpoint with its own",
                path, len(theirs), len(self.tokenizer),
            )  # fmt: skip

    def close(self) -> None:
        """Stop the worker thread (running requests get an error)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def load(self) -> dict[str, int]:
        """Current queue depth, running rows and reserved KV tokens."""
        with self._cond:
            return {
                "waiting": len(self._waiting),
                "prefilling": len(self._prefilling),
                "running": len(self._rows),
                "kv_tokens": self._footprint(self._rows),
            }

    # ------------------------------------------------------------------ worker thread

    def _footprint(self, rows: list[Row], extra: Request | None = None) -> int:
        reserves = [r.request.reserve for r in rows]
        n = len(rows)
        if extra is not None:
            reserves.append(extra.reserve)
            n += extra.params.n
        return n * max(reserves, default=0)

    def _admit(self) -> list[Request]:
        """Pop requests from the queue head while they fit (strict FIFO: no overtaking, no starvation)."""
        admitted = self._prefilling.requests()  # they hold their place in the budgets
        held = len(admitted)
        rows = list(self._rows)
        while self._waiting and self._pending_reload is None:
            req = self._waiting[0]
            if req.cancelled:
                self._waiting.popleft()
                continue
            n_rows = len(rows) + sum(r.params.n for r in admitted)
            fits_batch = n_rows == 0 or n_rows + req.params.n <= self.max_batch
            reserves = [r.request.reserve for r in rows] + [r.reserve for r in admitted] + [req.reserve]
            fits_kv = (n_rows + req.params.n) * max(reserves) <= self.kv_budget_tokens
            if not (fits_batch and fits_kv):
                break
            admitted.append(self._waiting.popleft())
        return admitted[held:]

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (
                        self._stopping or self._rows or self._waiting or self._prefilling or self._pending_reload
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    if self._pending_reload is not None and not self._rows and not self._prefilling:
                        self._swap_model()
                    new = self._admit()
                try:
                    if new:
                        self._join(self._prefilling.start(self.model, new))
                    if self._prefilling:
                        self._join(self._prefilling.step(self.model))
                    if self._rows:
                        self._decode()
                except Exception as exc:  # a bug or OOM: fail the affected requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(exc, new)
                self._flush()
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
            reload, self._pending_reload = self._pending_reload, None
        if reload is not None:
            with contextlib.suppress(RuntimeError):  # its loop may have closed
                reload[3].call_soon_threadsafe(_reject, reload[2], ShuttingDown(SHUTTING_DOWN))
        self._fail_all(ShuttingDown(SHUTTING_DOWN), waiting)
        self._flush()

    def _post(self, req: Request, item: Any) -> None:
        self._outbox.setdefault(req.loop, []).append((req.queue, item))

    def _flush(self) -> None:
        """Deliver this step's events: one wake-up per event loop, not one per request."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed: its requests are gone
                pass

    def _swap_model(self) -> None:
        assert self._pending_reload is not None
        model, version, fut, loop = self._pending_reload
        self._pending_reload = None
        self.model = model
        self.policy_version = version
        self._reset_batch()
        self.prefix_cache.clear()  # cached KV came from the old weights
        loop.call_soon_threadsafe(_resolve, fut, version)
        log.info("policy reloaded policy_version=%d", version)

    def _fail_all(self, exc: BaseException, new: list[Request]) -> None:
        reqs = {id(r.request): r.request for r in self._rows}
        for req in [*new, *self._prefilling.requests()]:
            reqs[id(req)] = req
        self._prefilling.clear()
        self._reset_batch()
        err = exc if isinstance(exc, ServingError) else ServingError(f"engine error: {exc}")
        for req in reqs.values():
            self._post(req, err)

    def _new_rows(self, req: Request) -> list[Row]:
        req.policy_version = self.policy_version
        self._post(req, ("version", self.policy_version))
        self.stats["requests"] += 1
        rows = []
        for i in range(req.params.n):
            seed = req.params.seed + i if req.params.seed is not None else secrets.randbits(63)
            lazy = not req.params.stream and not req.params.stop
            hidden = self.hidden_ids | set(req.params.stop_token_ids) if req.params.stop_token_ids else self.hidden_ids
            detok = Detokenizer(
                self.tokenizer, list(req.params.stop), hidden, lazy=lazy, byte_pieces=self.table.byte_pieces
            )
            rows.append(Row(request=req, index=i, rng=random.Random(seed), detok=detok))
        return rows

    def _join(self, prefilled: list[Prefilled]) -> None:
        """Prefilled requests join the batch (with their first tokens); those finished at once leave it."""
        for reqs, layers, logits in prefilled:
            self._admit_rows(reqs, layers, logits)
        self._drop_finished()

    def _admit_rows(self, group: list[Request], layers: list[KV], logits: torch.Tensor) -> None:
        """Expand one prefilled row per request to its n rows, merge them into the batch, sample first tokens."""
        counts = [req.params.n for req in group]
        rows = [row for req in group for row in self._new_rows(req)]
        if any(c != 1 for c in counts):
            idx = torch.repeat_interleave(
                torch.arange(len(group), device=self.device), torch.tensor(counts, device=self.device)
            )
            layers = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers]
            logits = logits.index_select(0, idx)
        mask = torch.ones((len(rows), layers[0][0].shape[2]), dtype=torch.long, device=self.device)
        self._rows = self._rows + rows
        self._kv.add(layers, mask, *self._room())
        self._sample(rows, logits)

    def _room(self) -> tuple[int, int]:
        """(tokens the rows may still generate, the longest row reservation): how far the KV buffers reach."""
        room = max(r.request.params.max_tokens - r.n_generated for r in self._rows)
        return room, max(r.request.reserve for r in self._rows)

    def _reset_batch(self) -> None:
        self._rows = []
        self._kv.clear()

    def _decode(self) -> None:
        b = len(self._rows)
        self.stats["max_rows"] = max(self.stats["max_rows"], b)
        tokens = torch.tensor([[r.last_token] for r in self._rows], device=self.device)  # (B, 1)
        positions, mask, cache = self._kv.step()
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats["steps"] += 1
        self._sample(self._rows, out.logits[:, -1, :])
        self._drop_finished()

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Sample one token per row (see clawpipe.serving.sampler); emit events per request."""
        params = [r.request.params for r in rows]
        got = sample(
            logits,
            [p.temperature for p in params],
            [p.top_p for p in params],
            [r.rng.random() for r in rows],
            [p.top_logprobs for p in params],
            [r.shaping(self.stop_ids) for r in rows],
        )
        events: dict[int, tuple[Request, list[list[TokenEvent]]]] = {}
        for row, tid, lp, top in zip(rows, got.ids, got.logprobs, got.tops, strict=True):
            row.record(tid, lp, top)
            self.stats["tokens"] += 1
            if (tid in self.stop_ids and not row.request.params.ignore_eos) or row.detok.stopped_on is not None:
                row.finish = "stop"
            elif tid in row.request.params.stop_token_ids:
                row.finish, row.stop_id = "stop", tid
            elif row.n_generated >= row.request.params.max_tokens:
                row.finish = "length"
            events.setdefault(id(row.request), (row.request, []))[1].append(row.events())
        for req, per_row in events.values():
            # round k holds each row's k-th event: a chunk never carries two deltas of one choice
            if all(len(evs) <= 1 for evs in per_row):  # the common case: at most one id per row this step
                first = [evs[0] for evs in per_row if evs]
                rounds = [first] if first else []
            else:
                rounds = [[ev for ev in evs if ev is not None] for evs in itertools.zip_longest(*per_row)]
            req.finished += sum(1 for evs in per_row for ev in evs if ev.finish_reason is not None)
            if req.params.stream:
                for evs in rounds:
                    self._post(req, evs)
            else:  # one wake-up per request instead of one per token: the consumer only needs the result
                req.held.extend(ev for evs in rounds for ev in evs)
                if req.finished == req.params.n:
                    self._post(req, req.held)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish is None and not r.request.cancelled]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._reset_batch()
            return
        self._rows = [self._rows[i] for i in keep]
        self._kv.keep(keep, *self._room())


def _resolve(fut: asyncio.Future[int], value: int) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future[int], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _deliver(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


async def generate(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> tuple[int, list[dict[str, Any]]]:
    """Run a request to completion: (policy_version, per choice {token_ids, logprobs, text, finish_reason})."""
    choices: list[dict[str, Any]] = [
        {"token_ids": [], "logprobs": [], "text": "", "finish_reason": None, "stopped_on": None}
        for _ in range(params.n)
    ]
    version = engine.policy_version
    t0 = time.monotonic()
    async for item in engine.stream(prompt_ids, params):
        if isinstance(item, tuple):
            version = item[1]
            continue
        for ev in item:
            c = choices[ev.index]
            if ev.token_id is not None:
                c["token_ids"].append(ev.token_id)
                c["logprobs"].append(ev.logprob)
            c["text"] += ev.text
            if ev.finish_reason is not None:
                c["finish_reason"] = ev.finish_reason
                c["stopped_on"] = ev.stopped_on
    log.debug("generated n=%d in %.3fs", params.n, time.monotonic() - t0)
    return version, choices
