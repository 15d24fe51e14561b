"""One choice of a request as the engine decodes it: its RNG, detokenizer and counts, how its next token is
sampled (see clawpipe.serving.sampler.Shaping), and the events its sampled ids become once their text settles."""

from __future__ import annotations

import collections
import random
from collections.abc import Collection
from dataclasses import dataclass, field

from clawpipe.serving.params import Request, TokenEvent
from clawpipe.serving.sampler import Shaping
from clawpipe.serving.text import Detokenizer

Top = list[tuple[int, float]] | None


@dataclass
class Row:
    """One choice in the running batch."""

    request: Request
    index: int
    rng: random.Random
    detok: Detokenizer
    n_generated: int = 0
    last_token: int = -1
    finish: str | None = None
    stop_id: int | None = None  # the stop_token_ids id that ended it
    # sampled (id, logprob, top) not yet handed out: their text may still turn out to be part of a stop string
    pending: collections.deque[tuple[int, float, Top]] = field(default_factory=collections.deque)
    counts: collections.Counter[int] = field(default_factory=collections.Counter)  # generated ids, when penalised
    seen: set[int] = field(default_factory=set)  # prompt and generated ids, under a repetition penalty

    def __post_init__(self) -> None:
        if self.request.params.repetition_penalty != 1.0:
            self.seen = set(self.request.prompt_ids)

    def shaping(self, stop_ids: Collection[int]) -> Shaping | None:
        """How the next token is sampled apart from temperature and top-p (None: not at all)."""
        p = self.request.params
        if not p.shaped:
            return None
        banned = None
        if self.n_generated < p.min_tokens:  # as vLLM: neither EOS nor a stop_token_ids id before min_tokens
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else stop_ids)]
        force = p.forced[self.n_generated] if self.n_generated < len(p.forced) else None
        return Shaping(
            force=force,
            counts=self.counts,
            seen=self.seen,
            presence=p.presence_penalty,
            frequency=p.frequency_penalty,
            repetition=p.repetition_penalty,
            banned=banned,
            top_k=p.top_k,
            min_p=p.min_p,
        )

    def record(self, token_id: int, logprob: float, top: Top) -> None:
        """Take one sampled id: into the text, the pending ids, and the counts penalties read."""
        self.last_token = token_id
        self.n_generated += 1
        self.detok.add(token_id)
        self.pending.append((token_id, logprob, top))
        p = self.request.params
        if p.presence_penalty or p.frequency_penalty:
            self.counts[token_id] += 1
        if p.repetition_penalty != 1.0:
            self.seen.add(token_id)

    @property
    def stopped_on(self) -> str | int | None:
        """The stop string, or the stop_token_ids id, that ended the row (vLLM's stop_reason)."""
        return self.detok.stopped_on if self.detok.stopped_on is not None else self.stop_id

    def events(self) -> list[TokenEvent]:
        """This step's events: one per sampled id whose text is now settled (the text rides on the last), and
        the end. Ids held back while their text may still be part of a stop string go out later, or, when the
        stop string does appear, never: the response's ids and logprobs decode to exactly its text."""
        self.detok.take(final=self.finish is not None)  # what it may show; `release` rounds that to whole ids
        count, piece = self.detok.release()
        out = []
        for k in range(count):
            tid, lp, top = self.pending.popleft()
            out.append(TokenEvent(self.index, tid, lp, piece if k == count - 1 else "", None, None, top))
        if self.finish is not None:
            self.pending.clear()  # sampled into a stop string: not part of the answer
            if out:
                out[-1].finish_reason, out[-1].stopped_on = self.finish, self.stopped_on
            else:
                out.append(TokenEvent(self.index, None, None, piece, self.finish, self.stopped_on))
        return out
