"""The default policy: a byte-level BPE tokenizer and a Qwen2-style model built locally, with no download.

`init_policy(dir, size, seed)` trains the tokenizer on a small built-in corpus (words, digits, JSON and
tool-call text), builds a randomly initialised Qwen2 model from config (`build_qwen2`, also what tests and
benches build their models with) and saves both with save_pretrained.
`load_tokenizer` uses PreTrainedTokenizerFast.from_pretrained (never AutoTokenizer: on a qwen2 config it
swaps in Qwen's pre-tokenizer and changes ids). `compute_logprobs` is the teacher-forced
reference the engine's sampled logprobs must match.

Chat template (ChatML): ``<|im_start|>role\\n...<|im_end|>\\n``; tools listed in the system turn inside
``<tools>...</tools>``; assistant tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
tool results as a ``tool`` turn; eos = ``<|im_end|>``.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

from clawpipe.errors import ServingError
from clawpipe.modelbuild import MODEL_BUILD
from clawpipe.serving.folder import check_model_folder
from clawpipe.serving.sampler import GREEDY_BELOW

log = logging.getLogger(__name__)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
VOCAB_SIZE = 512


# Sizes (build_qwen2's shape arguments): tiny ~0.19M parameters, small ~3.4M, medium ~26M (GPU tests).
# Context is long because real harnesses send 40-80 KB prompts.
class Qwen2Shape(TypedDict):
    """The shape arguments of :func:`build_qwen2`."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SIZES: dict[str, Qwen2Shape] = {
    "tiny": {"hidden": 64, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2},
    "small": {"hidden": 256, "intermediate": 768, "layers": 4, "heads": 8, "kv_heads": 4},
    # ~26M, head_dim 64: attention kernels of GPU engines (vLLM) need head sizes like 64/128
    "medium": {"hidden": 512, "intermediate": 1536, "layers": 8, "heads": 8, "kv_heads": 4},
}
MAX_POSITIONS = 131072

CHAT_TEMPLATE = (
    "{% macro render_content(content) %}"
    "{% if content is none %}"
    "{% elif content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part is string %}{{ part }}{% elif part.text is defined %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages and messages[0].role in ['system', 'developer'] %}"
    "{{ render_content(messages[0].content) }}\n\n"
    "{% endif %}"
    "# Tools\n\nYou may call functions. Signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\n\nCall one as <tool_call>{"name": <name>, "arguments": <args-json-object>}</tool_call>'
    "<|im_end|>\n"
    "{% set start = 1 if (messages and messages[0].role in ['system', 'developer']) else 0 %}"
    "{% else %}{% set start = 0 %}{% endif %}"
    "{% for message in messages[start:] %}"
    "<|im_start|>{{ message.role }}\n{{ render_content(message.content) }}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "{% for tc in message.tool_calls %}"
    "{% set fn = tc.function if tc.function is defined else tc %}"
    '<tool_call>{"name": {{ fn.name | tojson }}, "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORD_TEXT = (
    "the a an and or not yes no is are was be to of in on at for with from by as it this that guess "
    "number higher lower correct answer result value file files read write edit list run shell command "
    "output error done task test tests pass fail python code function def return print import user "
    "assistant system tool tools call calls name arguments content role message json text data hello "
    "world please thanks ok sure here there what which how why when where who think let me add sub mul "
    "div sum total count first second third next last calc compute equals plus minus times path dir cd "
    "ls cat echo grep sed mkdir rm cp mv touch true false null none int str float list dict "
)
_WORDS = _WORD_TEXT.split()


_PROSE = """\
You are an interactive agent that helps users with software engineering tasks. Use the instructions below and the
tools available to you to assist the user. When the user asks you to do something, you should first read the
relevant files, then make the smallest change that solves the problem, and finally run the tests to check that
your change works. If you are not sure what the user wants, ask a short question before you start. Do not make up
information about the code, the project or the environment: look it up with the tools you have.
IMPORTANT: Keep your responses short, since they will be displayed in a command line interface. Answer the
question directly, without an introduction or a conclusion. Only use emojis if the user explicitly asks for it.
When you run a command that changes the system, explain what it does and why you are running it. Never commit
changes unless the user asks you to. Prefer editing existing files to creating new ones.
# Tool usage policy
- When doing a file search, prefer to use the search tool in order to reduce context usage.
- You have the capability to call multiple tools in a single response. When multiple independent pieces of
information are requested, batch your tool calls together for optimal performance.
- The user will primarily request you to perform software engineering tasks: solving bugs, adding new
functionality, refactoring code, explaining code, and more.
# Environment
Working directory: /home/user/project. Is the directory a git repository: yes. Platform: linux. Today's date is
in the future. The model you are talking to is a small policy trained with reinforcement learning.
Here is some useful information about the environment you are running in. The sandbox has no network access.
Read the file, edit the file, write the file, list the directory, search for a pattern, run the command.
The function returns the number of items in the list. This is a test of the system and the answer is correct.
Please think step by step. What is the result? Let me check the output of the command first.
Usage: python main.py [--help] [--verbose] [--output FILE] INPUT
Error: file not found. Traceback (most recent call last): File "main.py", line 12, in <module>
"""

_CODE = """\
import json
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    \"\"\"Read the input file and print the total.\"\"\"
    path = Path(argv[0]) if argv else Path("input.txt")
    total = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        value = int(line.split(",")[1])
        total += value
    print(f"total={total}")
    return 0


class Counter:
    def __init__(self, name: str, start: int = 0) -> None:
        self.name = name
        self.count = start

    def add(self, n: int = 1) -> None:
        self.count += n


if __name__ == "__main__":
    raise SystemExit(main())
$ ls -la && cat README.md | grep -n "test" && python -m pytest -q tests/
$ git status && git diff --stat && echo "done" > out.txt && mkdir -p src && cd src
"""


def build_corpus(seed: int = 0) -> list[str]:
    """The built-in tokenizer training corpus: words, numbers, arithmetic, JSON and ChatML tool-call text."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(500):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ""]))
    for _ in range(500):
        a, b = rng.randint(0, 1000), rng.randint(0, 1000)
        lines.append(f"{a} + {b} = {a + b}. My guess is {rng.randint(0, 100)}. Answer: {rng.randint(0, 9999)}")
    for _ in range(300):
        name = rng.choice(["shell", "read_file", "write_file", "guess", "calc", "exec_command", "Bash"])
        args = {
            rng.choice(["command", "path", "number", "expr", "cmd"]): rng.choice([*_WORDS, str(rng.randint(0, 99))])
        }
        call = json.dumps({"name": name, "arguments": args})
        lines.append(f"{IM_START}assistant\n{TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE}{IM_END}\n")
        lines.append(f"{IM_START}tool\n{json.dumps({'output': rng.choice(_WORDS), 'exit_code': 0})}{IM_END}\n")
        lines.append(
            json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": " ".join(rng.choice(_WORDS) for _ in range(5)),
                        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                    },
                }
            )
        )
    for _ in range(300):
        lines.append(f"{IM_START}user\n{' '.join(rng.choice(_WORDS) for _ in range(6))}{IM_END}\n")
    # prose, code and shell like what real harnesses send (system prompts, tool schemas, file contents)
    sentences = [x.strip() for x in _PROSE.replace("\n", " ").split(". ") if x.strip()]
    for _ in range(150):
        rng.shuffle(sentences)
        lines.append(". ".join(sentences))
    code_lines = _CODE.splitlines()
    for _ in range(100):
        start = rng.randrange(len(code_lines))
        lines.append("\n".join(code_lines[start:] + code_lines[:start]))
    return lines


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE (vocab 512) and wrap it with the chat template and special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=[IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
    )


def init_policy(dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build tokenizer + randomly initialised Qwen2 model (deterministic for `seed`) and save them in `dir`."""
    if size not in SIZES:
        raise ServingError(f"unknown policy size {size!r}: use one of {sorted(SIZES)}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    eos_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    pad_id = int(tokenizer.convert_tokens_to_ids(ENDOFTEXT))  # type: ignore[arg-type]
    model = build_qwen2(
        **SIZES[size], vocab=len(tokenizer), seed=seed, bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("policy initialised dir=%s size=%s seed=%d params=%d", out, size, seed, n_params)
    return out


def build_qwen2(
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_positions: int = MAX_POSITIONS,
    tie_embeddings: bool = False,
    seed: int | None = 0,
    attn: str = "sdpa",
    **config: Any,
) -> PreTrainedModel:
    """A randomly initialised Qwen2-shaped causal LM in float32, the same weights for the same ``seed``
    (None: leave torch's generator as it is). ``config``: further Qwen2Config fields (token ids)."""
    if seed is not None:
        torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        **config,
    )
    with MODEL_BUILD:  # transformers swaps process-wide state while it builds (clawpipe/modelbuild.py)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model


def load_tokenizer(dir: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer exactly (PreTrainedTokenizerFast, never AutoTokenizer).

    `dir` is a model directory, or a Hugging Face id already in the local cache (no download here).
    """
    path = Path(dir)
    if path.is_dir() and not (path / "tokenizer.json").exists():
        others = sorted(f.name for f in path.glob("tokenizer*") if f.name != "tokenizer_config.json")
        hint = (
            f" (it has {', '.join(others)}; clawpipe loads fast tokenizers only: write tokenizer.json with "
            "transformers, AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            if others
            else ""
        )
        raise ServingError(
            f"no tokenizer.json in {path}{hint}: pass a model directory with one, or run `clawpipe model init "
            f"{path}` for a new policy"
        )
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(dir), padding_side="left")
    except (OSError, ValueError) as exc:
        raise ServingError(f"cannot load a tokenizer from {dir}: {exc}") from exc


def check_tokenizer_fits(tokenizer: PreTrainedTokenizerFast, vocab_size: int, dir: str | Path) -> None:
    """Refuse a tokenizer with ids the model has no embedding row for (more ids than config.json's vocab_size):
    a prompt holding one would be refused at every request, or index past the embedding. A model with more rows
    than the tokenizer has ids (padding rows, as many published models have) is fine."""
    size = len(tokenizer)
    if size > vocab_size:
        raise ServingError(
            f"the tokenizer in {dir} has {size} ids but the model embeds only vocab_size {vocab_size} (id "
            f"{vocab_size}, {tokenizer.convert_ids_to_tokens(vocab_size)!r}, has no row): not served; resize "
            "the model's embeddings to the tokenizer (model.resize_token_embeddings) or use the tokenizer it was "
            "trained with"
        )


def default_device() -> torch.device:
    """CUDA where present, else CPU (with torch threads from settings, 1 by default)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    dir: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Load a causal LM for inference (eval mode, sdpa attention) on `device` in `dtype`."""
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cpu":
        from clawpipe.config import get_settings

        torch.set_num_threads(get_settings().torch_threads)
    dtype = dtype or default_dtype(dev)
    # transformers swaps process-wide state while it builds: one build at a time (clawpipe/modelbuild.py)
    with MODEL_BUILD:
        if Path(dir).is_dir():  # a folder is checked against its config before any weight is allocated
            check_model_folder(dir, dtype, dev)
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(dir), dtype=dtype, attn_implementation="sdpa", output_loading_info=True
            )
        except Exception as exc:  # OSError, ValueError, safetensors' own error for a truncated or corrupt file, ...
            raise ServingError(
                f"cannot load a causal LM from {dir}: {type(exc).__name__}: {exc}; check that the checkpoint was "
                "completely written (config.json and model.safetensors)"
            ) from exc
    model, info = loaded
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers filled them with random values: serving them would sample noise
        raise ServingError(
            f"the weights in {dir} lack {len(missing)} tensors the model needs ({', '.join(missing[:3])}); not "
            "loaded: the folder is incomplete or its weights belong to another model"
        )
    # a diverged training step publishes NaN weights: served, every logprob would be NaN (invalid JSON, 500s)
    bad = next((name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())), None)
    if bad is not None:
        raise ServingError(
            f"the checkpoint in {dir} has non-finite weights (NaN or inf) in {bad}; not loaded: publish a "
            "checkpoint from before training diverged"
        )
    return model.to(dev).eval()  # type: ignore[arg-type]


@torch.no_grad()
def compute_logprobs(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    temperature: float = 1.0,
) -> list[float]:
    """Teacher-forced log p(completion_ids[i] | prompt + completion[:i]) under softmax(raw_logits / T).

    T = 0 (greedy, as is any T below GREEDY_BELOW) is scored under T = 1, as the engine reports it.
    """
    if not completion_ids:
        return []
    temp = temperature if temperature >= GREEDY_BELOW else 1.0
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=device)  # (1, P+C)
    logits = model(input_ids=ids).logits[0].float()  # (P+C, V)
    n_prompt = len(prompt_ids)
    pred = logits[n_prompt - 1 : -1] / temp  # (C, V): position t predicts token t+1
    logp = torch.log_softmax(pred, dim=-1)
    target = torch.tensor(list(completion_ids), device=device)
    return logp.gather(1, target[:, None])[:, 0].tolist()


def describe(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Special-token ids of a policy tokenizer (used by the engine and tests)."""
    return {
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "im_start_id": tokenizer.convert_tokens_to_ids(IM_START),
        "tool_call_open_id": tokenizer.convert_tokens_to_ids(TOOL_CALL_OPEN),
        "tool_call_close_id": tokenizer.convert_tokens_to_ids(TOOL_CALL_CLOSE),
    }


def imprint_policy(
    src: str | Path,
    dst: str | Path,
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    max_steps: int = 2000,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """Overfit a policy until greedy decoding reproduces each (prompt_ids, completion_ids) example exactly.

    A scripted policy for tests and demos (e.g. one that answers a given conversation with a tool call):
    the weights are trained, not the decoding, so every engine path runs unchanged. Raises ServingError
    when max_steps are not enough.
    """
    torch.manual_seed(seed)
    model = load_model(src, "cpu", torch.float32).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    batch = [(list(p), list(c)) for p, c in examples]
    for step in range(max_steps):
        loss_sum = torch.zeros(())
        exact = True
        for prompt, completion in batch:
            ids = torch.tensor([prompt + completion])  # (1, P+C)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # (C, V)
            target = torch.tensor(completion)
            loss_sum = loss_sum + torch.nn.functional.cross_entropy(logits, target)
            exact = exact and bool((logits.argmax(-1) == target).all())
        if exact and step > 0:
            break
        opt.zero_grad()
        loss_sum.backward()
        opt.step()
    else:
        raise ServingError(f"imprint did not converge in {max_steps} steps; raise max_steps or shorten the examples")
    out = Path(dst)
    model.eval().save_pretrained(out)
    load_tokenizer(src).save_pretrained(out)
    log.info("imprinted policy dst=%s examples=%d steps=%d", out, len(batch), step)
    return out
