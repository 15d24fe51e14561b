"""Shared parts of the HTTP routes: server options, per-choice accumulation (with tool-call holdback while
streaming), SSE framing, error bodies, and the steps every API takes (render, max_tokens, build_params, run, reload)."""

from __future__ import annotations

import asyncio
import fnmatch
import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clawpipe.apis.sse import sse_frame
from clawpipe.errors import ServingError
from clawpipe.serving import convert
from clawpipe.serving.body import MAX_REQUEST_BYTES, json_body
from clawpipe.serving.engine import Engine
from clawpipe.serving.params import RequestError, SamplingParams, ShuttingDown, TokenEvent, check_text_length
from clawpipe.serving.policy import TOOL_CALL_CLOSE
from clawpipe.serving.response_store import ResponseStore
from clawpipe.serving.splice import REQUEST_ROLLOUT, Ending, Prompt, TurnMemory, render_open
from clawpipe.serving.text import may_hold_tool_call, parse_tool_calls


@dataclass
class ServeOptions:
    """Server-level settings (the engine has its own)."""

    admin_token: str | None = None
    default_max_tokens: int = 256  # when a request names none
    max_tokens_cap: int | None = None  # clamp every request's max_tokens (CPU runs behind chatty harnesses)
    reload_roots: list[str] = field(default_factory=list)  # where /admin/reload may load from ('*': one level)
    responses_kept: int = 1024  # stored Responses kept for previous_response_id (most recent first)
    responses_kept_bytes: int = 256 * 2**20  # ... and their JSON size, all together
    splice: bool = True  # carry the sampled ids of a rollout's earlier turns into its next prompts
    splice_rollouts: int = 256  # rollouts whose completions are kept for that (least recently used dropped)
    splice_tokens: int = 131072  # sampled ids kept per rollout (oldest completions dropped)
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger bodies get a 413 before they are read whole


MAX_POLICY_VERSION = 2**31 - 1  # the lake's policy_version column is a 32-bit integer


def default_reload_roots() -> list[str]:
    """The models directory of the clawpipe home and every run's checkpoints directory."""
    from clawpipe.config import get_settings

    settings = get_settings()
    return [str(settings.models_dir), str(settings.runs_dir / "*" / "checkpoints")]


def under_root(path: Path, roots: list[str]) -> bool:
    """Whether `path` (already resolved) lies inside one of `roots`; a root's `*` part matches one name."""
    for root in roots:
        parts = Path(root).expanduser().parts
        fixed = next((i for i, p in enumerate(parts) if "*" in p), len(parts))
        base = Path(*parts[:fixed]).resolve()
        pattern = (*base.parts, *parts[fixed:])
        if len(path.parts) >= len(pattern) and all(
            fnmatch.fnmatchcase(got, want) for got, want in zip(path.parts, pattern, strict=False)
        ):
            return True
    return False


def checkpoint_path(raw: Any, roots: list[str]) -> tuple[Path | None, str, int]:
    """(the resolved checkpoint directory, "", 200), or (None, why not, HTTP status). Symlinks and '..' are
    resolved first, and each file inside must resolve under an allowed root too (no link to a file elsewhere)."""
    allowed = ", ".join(roots) or "(none configured)"
    if not isinstance(raw, str) or not raw:
        return None, "'path' must name a checkpoint directory", 400
    try:
        path = Path(raw).expanduser().resolve(strict=True)
    except (OSError, RuntimeError):
        return None, f"'path' must name a checkpoint directory that exists, got {raw!r}", 400
    if not path.is_dir():
        return None, f"'path' must name a checkpoint directory, got {raw!r}", 400
    outside = [p for p in [path, *(f.resolve() for f in path.iterdir())] if not under_root(p, roots)]
    if outside:
        return (
            None,
            f"reload may only load from {allowed}; {raw!r} resolves to {outside[0]}: save the checkpoint under one "
            "of them (or start the server with --reload-root)",
            403,
        )
    return path, "", 200


# ---------------------------------------------------------------- choice accumulation (shared by all APIs)


@dataclass
class Choice:
    """One choice as it streams: ids, logprobs, text, and the text held back because a tool call may start."""

    index: int
    tools: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when top_logprobs was asked
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    stopped_on: str | int | None = None
    shown: str = ""  # the content handed to the client so far (tool-call spans parsed out)

    def add(self, ev: TokenEvent) -> str:
        """Record one event; return the text that may be shown now."""
        if ev.token_id is not None:
            self.token_ids.append(ev.token_id)
            self.logprobs.append(float(ev.logprob or 0.0))
            self.tops.append(ev.top or [])
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finish_reason, self.stopped_on = ev.finish_reason, ev.stopped_on
            if not self.tools:
                return self._flush(len(self.text))
            return ""
        return self._flush(may_hold_tool_call(self.text) if self.tools else len(self.text))

    def _flush(self, end: int) -> str:
        end = max(end, self.emitted)
        piece, self.emitted = self.text[self.emitted : end], end
        self.shown += piece
        return piece

    def finish(self) -> tuple[str, list[Any]]:
        """At the end: (remaining content, parsed tool calls)."""
        if not self.tools:
            return self._flush(len(self.text)), []
        content, calls = parse_tool_calls(self.text[self.emitted :])
        self.emitted = len(self.text)
        self.shown += content
        return content, calls

    def full(self) -> tuple[str, list[Any]]:
        """Non-streamed: (content, tool calls) of the whole text."""
        if not self.tools:
            self.shown = self.text
            return self.text, []
        content, calls = parse_tool_calls(self.text)
        self.shown = content
        return content, calls


sse = sse_frame  # the route modules frame their stream events with the one SSE writer of clawpipe.apis


ANTHROPIC_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
}


def error_body(
    message: str, kind: str, anthropic: bool, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An error object in the shape the API's SDK reads (as a response body, or a stream's last event)."""
    if anthropic:
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error(
    message: str,
    status: int = 400,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, False, param, code), status_code=status)


def anthropic_error(
    message: str,
    status: int = 400,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """Anthropic's error body; its error types follow the status (404 not_found_error, ...), not `kind`."""
    kind = ANTHROPIC_KINDS.get(status, kind)
    return JSONResponse(error_body(message, kind, True), status_code=status)


def error_for_path(path: str, message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the shape of the API the path belongs to (Anthropic under /v1/messages, else OpenAI)."""
    error = anthropic_error if path.startswith("/v1/messages") else openai_error
    return error(message, status, kind)


class Routes:
    """State and steps shared by the API route mixins; one instance serves one engine."""

    def __init__(self, engine: Engine, options: ServeOptions) -> None:
        self.engine = engine
        self.options = options
        self.responses_store = ResponseStore(options.responses_kept, options.responses_kept_bytes)
        self.turns = TurnMemory(options.splice_rollouts, options.splice_tokens)

    # ------------------------------------------------------------ shared steps

    def model_name(self, body: dict[str, Any]) -> str:
        """The model the request names, when this server serves it (none named: the first served name); else a
        404 like vLLM's, so that a harness naming a model this server does not serve fails here as it would there."""
        name = body.get("model")
        if name is None:
            return self.engine.served_name
        if name not in self.engine.served_names:
            names = ", ".join(self.engine.served_names)
            raise RequestError(
                f"The model `{name}` does not exist: this server serves {names}; send one of them as 'model'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return str(name)

    async def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ending: Ending = "generate"
    ) -> Prompt:
        """The prompt ids of chat messages, rendered off the event loop: tokenizing a long conversation takes
        about a second per megabyte, and every other request's stream would stall behind it."""
        return await asyncio.to_thread(self._render, messages, tools, ending)  # the thread runs in this context

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ending: Ending) -> Prompt:
        """The prompt ids of chat messages, ending as `ending` says (see clawpipe.serving.splice.Ending);
        assistant turns this engine generated for the request's rollout, as they were answered, carry the ids
        it sampled for them (see clawpipe.serving.splice)."""
        # user, system and tool text is rendered as sent (assistant turns may be trimmed by the template), and so
        # is an open final turn's prefill, encoded on its own: a huge one is refused before it is tokenized
        chars = sum(len(m["content"]) for m in messages if m["role"] != "assistant")
        if ending == "continue":
            chars += len(str(messages[-1]["content"]))
        self.check_text(chars)
        template_tools: Any = tools or None
        rollout = REQUEST_ROLLOUT.get() if self.options.splice else None
        tok = self.engine.tokenizer
        if tok.chat_template is None:  # transformers would raise; say where a template goes instead
            raise RequestError(
                f"the served model ({self.engine.model_dir}) has no chat template, so chat messages cannot be "
                "rendered: add chat_template.jinja (or chat_template in tokenizer_config.json) to the model folder, "
                "or send raw prompts to /v1/completions"
            )
        try:
            found = self.turns.find(rollout, messages) if rollout else {}
            if found or ending == "continue":
                # an open final turn always takes this path: its body is encoded on its own (see render_open)
                got = render_open(tok, messages, template_tools, found, set(self.engine.stop_ids), ending)
                if got is not None:
                    if got.spliced:
                        self.turns.count(got.spliced_turns, got.spliced)
                    got.rollout = rollout
                    return got
            ids: Any = tok.apply_chat_template(
                messages,
                tools=template_tools,
                tokenize=True,
                add_generation_prompt=ending == "generate",
                continue_final_message=ending == "continue",
                return_dict=False,
            )
        except Exception as exc:
            raise RequestError(f"the messages cannot be rendered through the chat template: {exc}") from exc
        prefill = str(messages[-1]["content"]) if ending == "continue" else None
        return Prompt([int(t) for t in ids], 0, rollout, prefill)

    def check_text(self, chars: int) -> None:
        """RequestError when prompt text this long cannot fit, checked before it is tokenized."""
        engine = self.engine
        check_text_length(
            chars, engine.table.longest_piece, context=engine.max_model_len, prompt_limit=engine.max_prompt_tokens
        )

    def keep_turn(self, prompt: list[int], choice: Choice, calls: list[Any]) -> None:
        """Remember a finished choice of a rollout's request, as the client was shown it, for its next turns."""
        rollout = getattr(prompt, "rollout", None)
        if rollout and self.options.splice and choice.finish_reason is not None:
            # a continued turn goes back to the client's history whole: prefill and completion as one turn
            turn = prompt.turn(choice.shown, choice.token_ids) if isinstance(prompt, Prompt) else None
            if turn is not None:
                self.turns.remember(rollout, turn[0], calls, turn[1])

    def max_tokens(self, requested: int | None, n_prompt: int) -> int:
        if requested is None:
            requested = max(1, min(self.options.default_max_tokens, self.engine.max_model_len - n_prompt))
        if self.options.max_tokens_cap is not None:
            requested = min(requested, self.options.max_tokens_cap)
        return requested

    def build_params(
        self,
        body: dict[str, Any],
        prompt: list[int],
        max_tokens: int | None,
        stop: list[str],
        n: int | None = 1,
        top_logprobs: int = 0,
        forced: str | None = None,
    ) -> SamplingParams:
        """The request's sampling parameters, capped and checked against the engine together with its prompt;
        `forced`: text the answer must begin with (see convert.forced_call)."""
        params = convert.sampling(
            body,
            self.max_tokens(max_tokens, len(prompt)),
            self.options.default_max_tokens,
            stop,
            1 if n is None else n,
            top_logprobs,
        )
        if forced:
            params.forced = self.forced_ids(forced)
        self.engine.check(prompt, params)
        return params

    def forced_ids(self, text: str) -> list[int]:
        """The ids a forced call opening is given as: those a whole call starting with it encodes to, as far as
        they lie inside it. Encoded alone, its end could split where the call's own encoding merges across
        (`": ` and `{` ...), and the policy would continue from ids it never saw there."""
        tok = self.engine.tokenizer
        ids = tok.encode(text + '{"x": 1}}' + TOOL_CALL_CLOSE, add_special_tokens=False)
        keep: list[int] = []
        for t in ids:
            if not text.startswith(str(tok.decode([*keep, t], skip_special_tokens=False))):
                break
            keep.append(t)
        return keep

    def lp_entries(self, choice: Choice, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        return self.engine.table.logprob_entries(
            choice.token_ids[start:end], choice.logprobs[start:end], choice.tops[start:end]
        )

    async def run(self, prompt_ids: list[int], params: SamplingParams, tools: bool) -> tuple[int, list[Choice]]:
        choices = [Choice(i, tools) for i in range(params.n)]
        version = self.engine.policy_version
        async for item in self.engine.stream(prompt_ids, params):
            if isinstance(item, tuple):
                version = item[1]
                continue
            for ev in item:
                choices[ev.index].add(ev)
        return version, choices

    @staticmethod
    def usage(n_prompt: int, choices: list[Choice]) -> dict[str, int]:
        n_out = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    # ------------------------------------------------------------ plumbing

    @staticmethod
    def sse_response(gen: AsyncIterator[bytes], anthropic: bool = False) -> StreamingResponse:
        return StreamingResponse(
            _ending_in_error(gen, anthropic), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def reload(self, request: Request) -> Response:
        token = self.options.admin_token
        auth = request.headers.get("authorization", "")
        # constant time: the comparison must not tell a caller how much of a guess was right
        if not token or not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
            return openai_error(
                "admin token missing or wrong: send Authorization: Bearer <admin token>", 401, "auth_error"
            )
        try:
            body = await json_body(request, self.options.max_request_bytes)
        except RequestError as exc:
            return openai_error(str(exc), exc.status)
        version = body.get("policy_version")
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_POLICY_VERSION
        ):
            return openai_error(f"'policy_version' must be an integer in [0, {MAX_POLICY_VERSION}], got {version!r}")
        path, why, status = checkpoint_path(body.get("path"), self.options.reload_roots)
        if path is None:
            return openai_error(why, status, "permission_error" if status == 403 else "invalid_request_error")
        try:
            new_version = await self.engine.reload(path, version)
        except RequestError as exc:
            return openai_error(str(exc), exc.status)
        except ShuttingDown as exc:  # the weights were not swapped in: retry against a running server
            return openai_error(str(exc), 503, "api_error")
        except ServingError as exc:
            return openai_error(str(exc))
        return JSONResponse({"status": "ok", "policy_version": new_version, "path": str(path)})


async def _ending_in_error(gen: AsyncIterator[bytes], anthropic: bool) -> AsyncIterator[bytes]:
    """The stream, closed by an error event when the engine fails part-way (shutdown, an engine error), so the
    client is told why it ended rather than seeing a cut connection."""
    try:
        async for chunk in gen:
            yield chunk
    except ServingError as exc:
        yield sse(error_body(str(exc), "api_error", anthropic), "error" if anthropic else None)
