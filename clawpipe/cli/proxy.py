"""``clawpipe proxy``: run the capture proxy in front of one or more policy servers."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("proxy")
    def proxy(
        upstream: list[str] = typer.Option(
            ...,
            "--upstream",
            help="Policy server base URL (repeat for replicas: balanced by load, sticky per rollout).",
        ),
        port: int = typer.Option(8400, "--port", min=0, max=65535, help="Port to listen on (0 picks a free one)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
        capture_dir: Path | None = typer.Option(
            None, "--capture-dir", help="Where segments go; default <CLAWPIPE_HOME>/captures."
        ),
        tokenizer: Path | None = typer.Option(
            None, "--tokenizer", help="Model dir with tokenizer.json + chat template, to retokenize id-less calls."
        ),
        policy_version: int = typer.Option(
            0, "--policy-version", min=0, max=2**31 - 1, help="Version stamped on calls until changed."
        ),
        max_body_mb: float = typer.Option(32.0, "--max-body-mb", help="Larger request bodies get 413."),
        max_buffered_mb: float = typer.Option(
            128.0, "--max-buffered-mb", help="Request bodies still being received, all together; past it 503."
        ),
        max_response_mb: float = typer.Option(
            256.0, "--max-response-mb", help="Larger upstream responses end the call as an upstream error."
        ),
        max_connections: int = typer.Option(4096, "--max-connections", help="Open client connections; more get 503."),
        max_upstream_conns: int = typer.Option(
            256, "--max-upstream-conns", help="Connections per upstream; more calls wait in line for one."
        ),
        header_timeout: float = typer.Option(
            30.0, "--header-timeout", help="Seconds for a request head to arrive (and the longest pause in a body)."
        ),
        idle_timeout: float = typer.Option(
            120.0, "--idle-timeout", help="Close keep-alive connections idle this long."
        ),
        upstream_timeout: float = typer.Option(600.0, "--upstream-timeout", help="Seconds of upstream silence -> 504."),
        replica_backoff: float = typer.Option(
            5.0, "--replica-backoff", help="Seconds a failed upstream is skipped (doubles while it keeps failing)."
        ),
        segment_mb: float = typer.Option(64.0, "--segment-mb", help="Rotate segments at this size."),
        segment_age: float = typer.Option(300.0, "--segment-age", help="Rotate segments at this age (s)."),
        fsync: bool = typer.Option(
            True, "--fsync/--no-fsync", help="fsync each commit before answering (off: faster, not crash-safe)."
        ),
        ready_file: Path | None = typer.Option(None, "--ready-file", help="Write the proxy URL here once listening."),
    ) -> None:
        """Forward OpenAI/Anthropic calls to the upstream and capture each one, attributed to its rollout."""
        from clawpipe.config import get_settings
        from clawpipe.proxy import ProxyConfig, run_proxy

        numbers = {
            "--max-body-mb": max_body_mb,
            "--max-buffered-mb": max_buffered_mb,
            "--max-response-mb": max_response_mb,
            "--max-connections": max_connections,
            "--max-upstream-conns": max_upstream_conns,
            "--header-timeout": header_timeout,
            "--idle-timeout": idle_timeout,
            "--upstream-timeout": upstream_timeout,
            "--replica-backoff": replica_backoff,
            "--segment-mb": segment_mb,
            "--segment-age": segment_age,
        }
        for flag, value in numbers.items():  # named by flag here (the settings' own check names their fields)
            if not value > 0 or value == float("inf"):  # NaN fails `> 0` too
                raise typer.BadParameter(f"{flag} {value}: give a finite number above 0")
        settings = get_settings()
        cfg = ProxyConfig(
            upstreams=upstream,
            capture_dir=capture_dir or settings.captures_dir,
            host=host,
            port=port,
            tokenizer_dir=tokenizer,
            policy_version=policy_version,
            max_body_bytes=int(max_body_mb * (1 << 20)),
            max_buffered_bytes=int(max_buffered_mb * (1 << 20)),
            max_response_bytes=int(max_response_mb * (1 << 20)),
            max_connections=max_connections,
            max_upstream_conns=max_upstream_conns,
            header_timeout_s=header_timeout,
            idle_timeout_s=idle_timeout,
            upstream_timeout_s=upstream_timeout,
            replica_backoff_s=replica_backoff,
            segment_max_bytes=int(segment_mb * (1 << 20)),
            segment_max_age_s=segment_age,
            fsync=fsync,
            ready_file=ready_file,
        )
        run_proxy(cfg)
