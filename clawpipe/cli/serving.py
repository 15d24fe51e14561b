"""CLI of the serving room: `clawpipe model init` and `clawpipe serve` (local engine or vLLM)."""

from __future__ import annotations

from pathlib import Path

import typer

model_app = typer.Typer(help="Build and inspect policies.", no_args_is_help=True)


@model_app.command("init")
def model_init(
    dir: Path = typer.Argument(..., help="Directory to write the policy into (created)."),
    size: str = typer.Option("tiny", "--size", help="tiny (~0.2M params) or small (~3.4M)."),
    seed: int = typer.Option(0, "--seed", help="Seed: the same seed gives the same weights and tokenizer."),
) -> None:
    """Build the default policy (byte-level BPE tokenizer + Qwen2 model from config), no download."""
    from clawpipe.serving.policy import init_policy

    out = init_policy(dir, size=size, seed=seed)
    typer.echo(f"policy written to {out}")


@model_app.command("publish")
def model_publish(
    dir: Path = typer.Argument(..., help="Checkpoint directory (save_pretrained) to serve."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Base URL of the running server."),
    policy_version: int = typer.Option(..., "--policy-version", help="Version the server reports from now on."),
    engine: str = typer.Option("local", "--engine", help="local (POST /admin/reload) or vllm."),
    served_dir: Path | None = typer.Option(None, "--served-dir", help="vllm: the directory vLLM was started on."),
) -> None:
    """Load a new checkpoint into a running server (in-flight requests finish on the old weights first)."""
    if engine == "vllm":
        from clawpipe.serving.vllm import reload_vllm_weights

        if served_dir is None:
            raise typer.BadParameter("--served-dir is required with --engine vllm")
        reload_vllm_weights(url, dir, served_dir)
        typer.echo(f"vLLM at {url} reloaded weights from {dir}")
        return
    import httpx

    from clawpipe.config import get_settings
    from clawpipe.errors import ServingError
    from clawpipe.serving.client import request_reload

    try:
        answer = request_reload(url, dir.resolve(), policy_version, get_settings().admin())
    except httpx.TransportError as exc:
        raise ServingError(
            f"nothing answers at {url} ({exc}); start the server first (clawpipe serve --model DIR) or pass --url"
        ) from None
    typer.echo(f"serving {answer['path']} as policy_version {answer['policy_version']}")


def serve(
    model: str = typer.Option(
        ..., "--model", help="Model directory, or a Hugging Face id (vLLM; local engine: only if cached)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on (0: any free port)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    engine: str = typer.Option("local", "--engine", help="local (transformers, batching) or vllm (GPU)."),
    served_name: list[str] = typer.Option(
        [],
        "--served-name",
        help="Model name clients send (repeatable; default: the model folder's name); others get 404.",
    ),
    max_batch: int = typer.Option(64, "--max-batch", help="Most sequences decoded together (1 = no batching)."),
    kv_budget_tokens: int = typer.Option(
        262144, "--kv-budget-tokens", help="KV cache bound in tokens (rows x longest reservation); requests queue."
    ),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context limit (default: the model's)."),
    policy_version: int = typer.Option(0, "--policy-version", help="Version reported until the first reload."),
    default_max_tokens: int = typer.Option(256, "--default-max-tokens", help="max_tokens when a request has none."),
    max_tokens_cap: int | None = typer.Option(
        None, "--max-tokens-cap", help="Clamp every request's max_tokens (CPU runs behind chatty harnesses)."
    ),
    prefix_cache_mb: float = typer.Option(
        256, "--prefix-cache-mb", help="Memory for KV of recent long prompts, reused by later prompts (0: off)."
    ),
    prefill_chunk_tokens: int = typer.Option(
        512,
        "--prefill-chunk-tokens",
        help="Prompt tokens computed per engine step: longer prompts are prefilled in chunks, with decode steps of "
        "running requests between them.",
    ),
    max_prompt_tokens: int | None = typer.Option(
        None,
        "--max-prompt-tokens",
        help="Longest prompt a request may send (400 past it; default: the context, up to 65536 tokens).",
    ),
    max_request_mb: float = typer.Option(
        32, "--max-request-mb", min=0.001, help="Largest request body in MiB (a 413 past it, before it is read)."
    ),
    responses_kept_mb: float = typer.Option(
        256,
        "--responses-kept-mb",
        min=0,
        help="Memory for stored Responses (previous_response_id), besides the last 1024 of them.",
    ),
    reload_root: list[Path] = typer.Option(
        [],
        "--reload-root",
        help="Directory /admin/reload may load checkpoints from (repeatable; '*' matches one folder). Default: "
        "CLAWPIPE_RELOAD_ROOTS, else <home>/models and <home>/runs/*/checkpoints.",
    ),
    splice: bool = typer.Option(
        True,
        "--splice/--no-splice",
        help="Carry a rollout's own sampled ids into its next prompt where the harness sent the turn back "
        "unchanged (the rollout is named by the capture proxy's header).",
    ),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    tool_parser: str = typer.Option("hermes", "--tool-parser", help="vLLM tool-call parser."),
    dry_run: bool = typer.Option(False, "--dry-run", help="vllm: print the command instead of running it."),
) -> None:
    """Serve a policy over the OpenAI and Anthropic APIs, with token ids and logprobs where a request asks."""
    if engine == "vllm":
        from clawpipe.serving.vllm import VllmOptions, build_vllm_command, start_vllm

        opts = VllmOptions(
            model=model,
            served_name=list(served_name) or None,
            host=host,
            port=port,
            tool_parser=tool_parser,
            max_model_len=max_model_len,
            max_num_seqs=max_batch,
        )
        if dry_run:
            cmd, env = build_vllm_command(opts)
            typer.echo(" ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd))
            return
        raise typer.Exit(start_vllm(opts).wait())
    if engine != "local":
        raise typer.BadParameter("--engine must be local or vllm")
    from clawpipe.config import prepare_environment

    prepare_environment()  # offline: a model id that is not cached fails at once instead of retrying downloads
    _check_model_folder(model)
    from clawpipe.serving.server import run_server

    run_server(
        model,
        port=port,
        host=host,
        served_name=list(served_name) or None,
        device=device,
        max_batch=max_batch,
        kv_budget_tokens=kv_budget_tokens,
        max_model_len=max_model_len,
        policy_version=policy_version,
        default_max_tokens=default_max_tokens,
        max_tokens_cap=max_tokens_cap,
        prefix_cache_mb=prefix_cache_mb,
        prefill_chunk_tokens=prefill_chunk_tokens,
        max_prompt_tokens=max_prompt_tokens,
        max_request_mb=max_request_mb,
        responses_kept_mb=responses_kept_mb,
        reload_roots=list(reload_root) or None,
        splice=splice,
    )


def _check_model_folder(model: str) -> None:
    """A ``--model`` written as a path (absolute, relative with ./ or ../, ~, or more than one /) must be a
    folder: otherwise the loader takes it for a Hugging Face id and refuses it as one."""
    from clawpipe.errors import ConfigError

    path = Path(model).expanduser()
    if path.is_dir() or not (model.startswith(("/", ".", "~")) or model.count("/") > 1):
        return
    what = "a file, not a folder" if path.exists() else "no such folder"
    raise ConfigError(
        f"--model {model}: {what}; give a saved transformers model folder (one holding config.json), e.g. one "
        "built by `clawpipe model init`"
    )


def register(app: typer.Typer) -> None:
    """Add `model` and `serve` to the clawpipe CLI."""
    app.add_typer(model_app, name="model")
    app.command("serve")(serve)
