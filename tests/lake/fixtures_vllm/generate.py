"""Build the vLLM wire-format fixtures in this folder from vLLM 0.33.0's own response classes.

Not a test and not run by the suite: vLLM is not a dependency. To regenerate (see README.md here)::

    pip install --no-deps --target /tmp/vllm033 vllm==0.33.0
    pip install --no-deps --target /tmp/vllmdeps cbor2 pyzmq openai-harmony pybase64 py-cpuinfo
    PYTHONPATH=/tmp/vllm033:/tmp/vllmdeps .venv/bin/python tests/lake/fixtures_vllm/generate.py

Each fixture is serialised the way vLLM 0.33.0's servers do it (``model_dump_json()`` for a whole response,
``model_dump_json(exclude_unset=True)`` per stream chunk, the final usage chunk with ``exclude_none=True``,
then ``data: [DONE]``), and carries the ids and logprobs a reader must find in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import vllm
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo

HERE = Path(__file__).resolve().parent
MODEL = "Qwen/Qwen3-0.6B"
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198, 151644, 77091, 198]
PIECES = [
    ("The", 785, -0.0123),
    (" answer", 4226, -0.4021),
    (" is", 374, -0.0009),
    (" 4", 220, -1.25),
    (".", 13, -0.031),
]
PIECES_B = [("Four", 26972, -2.5), (".", 13, -0.2)]


def _usage(n_prompt: int, n_gen: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_gen, total_tokens=n_prompt + n_gen)


def _completion_logprobs(pieces: list[tuple[str, int, float]]) -> CompletionLogProbs:
    offsets, pos = [], 0
    for text, _, _ in pieces:
        offsets.append(pos)
        pos += len(text)
    return CompletionLogProbs(
        text_offset=offsets,
        token_logprobs=[lp for _, _, lp in pieces],
        tokens=[t for t, _, _ in pieces],
        top_logprobs=[{t: lp} for t, _, lp in pieces],
    )


def _chat_logprobs(pieces: list[tuple[str, int, float]]) -> ChatCompletionLogProbs:
    return ChatCompletionLogProbs(
        content=[
            ChatCompletionLogProbsContent(
                token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[ChatCompletionLogProb(token=t, logprob=lp)]
            )
            for t, _, lp in pieces
        ]
    )


def _expected(*choices: list[tuple[str, int, float]], finish: str = "stop") -> dict[str, Any]:
    return {
        "prompt_token_ids": PROMPT,
        "choices": [
            {"token_ids": [i for _, i, _ in c], "logprobs": [lp for _, _, lp in c], "finish_reason": finish}
            for c in choices
        ],
    }


def completions(stream: bool, n: int) -> tuple[bytes, dict[str, Any]]:
    choices = [PIECES, PIECES_B][:n]
    if not stream:
        resp = CompletionResponse(
            id="cmpl-fx",
            created=1764547200,
            model=MODEL,
            choices=[
                CompletionResponseChoice(
                    index=k,
                    text="".join(t for t, _, _ in c),
                    logprobs=_completion_logprobs(c),
                    finish_reason="stop",
                    token_ids=[i for _, i, _ in c],
                    prompt_token_ids=PROMPT,
                )
                for k, c in enumerate(choices)
            ],
            usage=_usage(len(PROMPT) * n, sum(map(len, choices))),
        )
        return resp.model_dump_json().encode(), _expected(*choices)
    lines = []
    for k, c in enumerate(choices):
        for j, piece in enumerate(c):
            last = j == len(c) - 1
            chunk = CompletionStreamResponse(
                id="cmpl-fx",
                object="text_completion",
                created=1764547200,
                model=MODEL,
                choices=[
                    CompletionResponseStreamChoice(
                        index=k,
                        text=piece[0],
                        logprobs=_completion_logprobs([piece]),
                        finish_reason="stop" if last else None,
                        stop_reason=None,
                        prompt_token_ids=PROMPT if j == 0 else None,  # the first chunk of each prompt
                        token_ids=[piece[1]],
                    )
                ],
                kv_transfer_params=None,
            )
            lines.append(f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n")
    usage = CompletionStreamResponse(
        id="cmpl-fx", created=1764547200, model=MODEL, choices=[], usage=_usage(len(PROMPT) * n, sum(map(len, choices)))
    )
    lines.append(f"data: {usage.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n")
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode(), _expected(*choices)


def chat(stream: bool, n: int) -> tuple[bytes, dict[str, Any]]:
    choices = [PIECES, PIECES_B][:n]
    if not stream:
        resp = ChatCompletionResponse(
            id="chatcmpl-fx",
            created=1764547200,
            model=MODEL,
            choices=[
                ChatCompletionResponseChoice(
                    index=k,
                    message=ChatMessage(role="assistant", content="".join(t for t, _, _ in c)),
                    logprobs=_chat_logprobs(c),
                    finish_reason="stop",
                    token_ids=[i for _, i, _ in c],
                )
                for k, c in enumerate(choices)
            ],
            usage=_usage(len(PROMPT), sum(map(len, choices))),
            prompt_token_ids=PROMPT,
        )
        return resp.model_dump_json().encode(), _expected(*choices)
    lines = []
    for k in range(n):  # the first chunk of each choice: the role, and (on the first ever) the prompt ids
        first = ChatCompletionStreamResponse(
            id="chatcmpl-fx",
            object="chat.completion.chunk",
            created=1764547200,
            model=MODEL,
            choices=[
                ChatCompletionResponseStreamChoice(
                    index=k, delta=DeltaMessage(role="assistant", content=""), logprobs=None, finish_reason=None
                )
            ],
            prompt_token_ids=PROMPT if k == 0 else None,
        )
        lines.append(f"data: {first.model_dump_json(exclude_unset=True, exclude_none=not first.choices)}\n\n")
    for k, c in enumerate(choices):
        for j, piece in enumerate(c):
            chunk = ChatCompletionStreamResponse(
                id="chatcmpl-fx",
                object="chat.completion.chunk",
                created=1764547200,
                model=MODEL,
                choices=[
                    ChatCompletionResponseStreamChoice(
                        index=k,
                        delta=DeltaMessage(content=piece[0]),
                        logprobs=_chat_logprobs([piece]),
                        finish_reason="stop" if j == len(c) - 1 else None,
                        token_ids=[piece[1]],
                    )
                ],
            )
            lines.append(f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices)}\n\n")
    usage = ChatCompletionStreamResponse(
        id="chatcmpl-fx",
        object="chat.completion.chunk",
        created=1764547200,
        model=MODEL,
        choices=[],
        usage=_usage(len(PROMPT), sum(map(len, choices))),
    )
    lines.append(f"data: {usage.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n")
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode(), _expected(*choices)


def stream_error() -> tuple[bytes, dict[str, Any]]:
    """A completions stream cut by an engine error: vLLM sends its ErrorResponse as a data event, then [DONE]."""
    body, _ = completions(True, 1)
    head = body.split(b"\n\n")[:2]
    err = ErrorResponse(error=ErrorInfo(message="Internal server error", type="InternalServerError", code=500))
    tail = f"data: {json.dumps(err.model_dump())}\n\ndata: [DONE]\n\n".encode()
    expected = {"status": "upstream_error", "error": "Internal server error", "prompt_token_ids": PROMPT}
    return b"\n\n".join(head) + b"\n\n" + tail, expected


def main() -> None:
    cases = {
        "completions": ("completions", False, completions(False, 1)),
        "completions_n2": ("completions", False, completions(False, 2)),
        "completions_stream": ("completions", True, completions(True, 1)),
        "completions_stream_n2": ("completions", True, completions(True, 2)),
        "chat": ("chat", False, chat(False, 1)),
        "chat_n2": ("chat", False, chat(False, 2)),
        "chat_stream": ("chat", True, chat(True, 1)),
        "chat_stream_n2": ("chat", True, chat(True, 2)),
        "completions_stream_error": ("completions", True, stream_error()),
    }
    for name, (api, stream, (body, expected)) in cases.items():
        doc = {
            "generated_by": f"vllm {vllm.__version__} protocol classes via tests/lake/fixtures_vllm/generate.py",
            "api": api,
            "stream": stream,
            "body": body.decode(),
            "expected": expected,
        }
        (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print("wrote", name)


if __name__ == "__main__":
    main()
