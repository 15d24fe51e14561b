"""The HTTP face of the engine: OpenAI Chat Completions, Completions and Responses, Anthropic Messages,
/v1/models, /health and POST /admin/reload, streamed (SSE) and not.

Every response carries what the proxy needs: `prompt_token_ids`, per-choice `token_ids`,
`logprobs.content` entries and `policy_version`. `start_server` runs it in-process on an ephemeral port (a
background thread); `start_server_process` runs it as a subprocess; `run_server` blocks (the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawpipe.errors import ServingError
from clawpipe.net import tcp_socket
from clawpipe.serving.anthropic_routes import MessagesRoutes
from clawpipe.serving.body import MAX_REQUEST_BYTES, json_body
from clawpipe.serving.completions_routes import CompletionsRoutes
from clawpipe.serving.engine import PREFILL_CHUNK, Engine, RequestError, ShuttingDown
from clawpipe.serving.openai_routes import ChatRoutes
from clawpipe.serving.responses_routes import ResponsesRoutes
from clawpipe.serving.routes import (
    ServeOptions,
    anthropic_error,
    default_reload_roots,
    error_for_path,
    openai_error,
)
from clawpipe.serving.splice import REQUEST_ROLLOUT, ROLLOUT_HEADER

log = logging.getLogger(__name__)

API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")


class App(ChatRoutes, CompletionsRoutes, ResponsesRoutes, MessagesRoutes):
    """Every route, bound to one engine."""


def create_app(engine: Engine, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app serving `engine`."""
    routes = App(engine, options or ServeOptions())
    app = FastAPI(title="clawpipe serve", docs_url=None, redoc_url=None, openapi_url=None)

    def endpoint(handler: Callable[[dict[str, Any]], Any], error: Callable[..., JSONResponse]) -> Callable[..., Any]:
        async def run(request: Request) -> Response:
            # the proxy names the call's rollout; the handler's task copies this context when it is created
            REQUEST_ROLLOUT.set(request.headers.get(ROLLOUT_HEADER) or None)
            try:
                body = await json_body(request, routes.options.max_request_bytes)
                return await _unless_disconnected(request, asyncio.ensure_future(handler(body)))
            except RequestError as exc:
                return error(str(exc), exc.status, param=exc.param, code=exc.code)
            except ShuttingDown as exc:
                return error(str(exc), 503, "api_error")
            except ServingError as exc:
                log.warning("request failed: %s", exc)
                return error(str(exc), 500, "api_error")

        return run

    app.add_api_route("/v1/chat/completions", endpoint(routes.chat, openai_error), methods=["POST"])
    app.add_api_route("/v1/completions", endpoint(routes.completions, openai_error), methods=["POST"])
    app.add_api_route("/v1/responses", endpoint(routes.responses, openai_error), methods=["POST"])
    app.add_api_route("/v1/messages", endpoint(routes.messages, anthropic_error), methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", endpoint(routes.count_tokens, anthropic_error), methods=["POST"])
    app.add_api_route("/admin/reload", routes.reload, methods=["POST"])

    def read(handler: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
        """A route that reads what the server keeps (no body): RequestError -> the OpenAI error it names."""

        async def run(request: Request) -> Response:
            try:
                return JSONResponse(handler(request))
            except RequestError as exc:
                return openai_error(str(exc), exc.status, param=exc.param, code=exc.code)

        return run

    def model_entry(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "clawpipe",
            "root": str(engine.model_dir),
            "max_model_len": engine.max_model_len,
            "policy_version": engine.policy_version,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_entry(name) for name in engine.served_names]}

    def one_model(request: Request) -> dict[str, Any]:
        name = request.path_params["model"]
        if name not in engine.served_names:
            raise RequestError(
                f"The model `{name}` does not exist: this server serves {', '.join(engine.served_names)}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model_entry(name)

    app.add_api_route("/v1/models/{model:path}", read(one_model), methods=["GET"])
    stored = "/v1/responses/{response_id}"
    app.add_api_route(
        stored,
        read(lambda r: routes.stored_response(r.path_params["response_id"], dict(r.query_params))),
        methods=["GET"],
    )
    app.add_api_route(stored, read(lambda r: routes.deleted_response(r.path_params["response_id"])), methods=["DELETE"])
    app.add_api_route(
        stored + "/input_items",
        read(lambda r: routes.stored_input_items(r.path_params["response_id"], dict(r.query_params))),
        methods=["GET"],
    )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = (
                f"no route {method} {path}: this server serves POST {', '.join(API_PATHS)}, GET /v1/models[/ID] "
                "and GET or DELETE /v1/responses/ID (GET .../input_items)"
            )
        elif exc.status_code == 405:
            message = (
                f"{method} is not allowed on {path}; use {exc.headers.get('Allow', 'POST') if exc.headers else 'POST'}"
            )
        else:
            message = str(exc.detail)
        response = error_for_path(path, message, exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return error_for_path(request.url.path, f"the request is not valid: {exc.errors()}", 400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "policy_version": engine.policy_version,
            "model": engine.served_name,
            **engine.load(),
            "stats": dict(engine.stats),
            "splice": dict(routes.turns.stats),  # completions kept, turns and ids carried into later prompts
        }

    return app


class _Server(uvicorn.Server):
    """uvicorn's server that stops the engine first on shutdown: running and queued requests then end at once
    with an error, instead of holding the graceful shutdown open until they would have finished."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await asyncio.to_thread(self.engine.close)
        await super().shutdown(sockets)


async def _unless_disconnected(request: Request, work: asyncio.Future[Response]) -> Response:
    """The handler's response, unless the client hangs up first: then the handler is cancelled, which frees its
    engine rows at the next step (a non-streamed request would otherwise run to max_tokens for nobody).
    Streams return at once here; their responses watch for the disconnect themselves."""
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    return Response(status_code=499)  # nobody reads it


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------- running it


@dataclass
class ServerHandle:
    """A running server: `.url` (http://127.0.0.1:PORT), `.engine` (in-process only), `.stop()`."""

    url: str
    admin_token: str
    engine: Engine | None = None
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    _process: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        if self.engine is not None:
            self.engine.close()
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _admin_token(token: str | None) -> str:
    if token:
        return token
    from clawpipe.config import get_settings

    return get_settings().admin()


def _open_engine(
    model_dir: str | Path, host: str, port: int, kwargs: dict[str, Any]
) -> tuple[Engine, ServeOptions, socket.socket]:
    """The engine, the route options (admin token resolved) and a socket bound to host:port, for one server.

    kwargs: Engine options plus ServeOptions (admin_token, default_max_tokens, max_tokens_cap, splice,
    max_request_mb, responses_kept, responses_kept_mb).
    """
    engine_kwargs = dict(kwargs)
    request_mb = engine_kwargs.pop("max_request_mb", None)
    opts = ServeOptions(
        admin_token=_admin_token(engine_kwargs.pop("admin_token", None)),
        default_max_tokens=engine_kwargs.pop("default_max_tokens", 256),
        max_tokens_cap=engine_kwargs.pop("max_tokens_cap", None),
        reload_roots=_reload_roots(engine_kwargs.pop("reload_roots", None)),
        responses_kept=engine_kwargs.pop("responses_kept", 1024),
        responses_kept_bytes=int(engine_kwargs.pop("responses_kept_mb", 256) * 2**20),
        splice=engine_kwargs.pop("splice", True),
        max_request_bytes=int(request_mb * 2**20) if request_mb else MAX_REQUEST_BYTES,
    )
    engine = Engine(model_dir, **engine_kwargs)
    return engine, opts, listen_socket(host, port)


def _reload_roots(roots: list[str | Path] | None) -> list[str]:
    """The reload allow-list: the roots passed, else CLAWPIPE_RELOAD_ROOTS, else the models and run checkpoints
    directories of the clawpipe home."""
    if roots:
        return [str(r) for r in roots]
    from clawpipe.config import get_settings

    configured = get_settings().reload_roots
    if configured:
        return [r for r in configured.split(os.pathsep) if r]
    return default_reload_roots()


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket bound to host:port (TCP_NODELAY on what it accepts: see clawpipe.net)."""
    sock = tcp_socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def start_server(model_dir: str | Path, *, port: int = 0, host: str = "127.0.0.1", **kwargs: Any) -> ServerHandle:
    """Start engine + HTTP server in this process on a background thread; returns when it accepts requests.

    kwargs: Engine options (device, max_batch, kv_budget_tokens, policy_version, served_name, ...) and
    ServeOptions (admin_token, default_max_tokens, max_tokens_cap, max_request_mb).
    """
    engine, opts, sock = _open_engine(model_dir, host, port, kwargs)
    config = uvicorn.Config(create_app(engine, opts), log_level="warning", lifespan="off", access_log=False)
    server = _Server(config, engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="clawpipe-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.close()
            raise ServingError("the serving engine did not start; see the log above")
        time.sleep(0.01)
    url = f"http://{host}:{sock.getsockname()[1]}"
    log.info("serving model=%s url=%s", engine.served_name, url)
    return ServerHandle(
        url=url, admin_token=_admin_token(opts.admin_token), engine=engine, _server=server, _thread=thread
    )


def start_server_process(
    model_dir: str | Path, *, port: int = 0, host: str = "127.0.0.1", timeout_s: float = 120, **kwargs: Any
) -> ServerHandle:
    """Start `clawpipe serve` as a subprocess (same options as start_server); returns when it accepts requests."""
    token = _admin_token(kwargs.pop("admin_token", None))
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready.json"
        cmd = [sys.executable, "-m", "clawpipe.serving.server", "--model", str(model_dir), "--host", host]
        cmd += ["--port", str(port), "--ready-file", str(ready)]
        for key, value in kwargs.items():
            for v in value if isinstance(value, list | tuple) else [value]:
                if v is not None:
                    cmd += [f"--{key.replace('_', '-')}", str(v)]
        env = {**os.environ, "CLAWPIPE_ADMIN_TOKEN": token}
        proc = subprocess.Popen(cmd, env=env)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise ServingError(f"`{' '.join(cmd)}` did not start (exit {proc.returncode}); see its log")
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
    return ServerHandle(url=url, admin_token=token, _process=proc)


def run_server(
    model_dir: str | Path,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    ready_file: str | Path | None = None,
    **kwargs: Any,
) -> None:
    """Serve until interrupted (the CLI's `clawpipe serve`); writes {"url": ...} to ready_file once listening."""
    engine, opts, sock = _open_engine(model_dir, host, port, kwargs)
    url = f"http://{host}:{sock.getsockname()[1]}"
    config = uvicorn.Config(create_app(engine, opts), log_level="warning", lifespan="off", access_log=False)
    server = _Server(config, engine)

    def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.01)
        if ready_file is not None:
            tmp = Path(f"{ready_file}.tmp")
            tmp.write_text(json.dumps({"url": url}))
            tmp.rename(ready_file)
        log.info("serving model=%s url=%s policy_version=%d", engine.served_name, url, engine.policy_version)

    threading.Thread(target=announce, name="clawpipe-serve-ready", daemon=True).start()
    try:
        server.run(sockets=[sock])  # uvicorn's own loop (uvloop where installed), as start_server uses
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    """`python -m clawpipe.serving.server` (used by start_server_process)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ready-file")
    p.add_argument("--served-name", action="append")
    p.add_argument("--device")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-budget-tokens", type=int, default=262144)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--policy-version", type=int, default=0)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-tokens-cap", type=int)
    p.add_argument("--prefix-cache-mb", type=float, default=256)
    p.add_argument("--prefill-chunk-tokens", type=int, default=PREFILL_CHUNK)
    p.add_argument("--max-prompt-tokens", type=int)
    p.add_argument("--max-request-mb", type=float, help="refuse request bodies over this size (413); default 32")
    p.add_argument("--reload-root", action="append", dest="reload_roots")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_server(
        a.model,
        port=a.port,
        host=a.host,
        ready_file=a.ready_file,
        served_name=a.served_name,
        device=a.device,
        max_batch=a.max_batch,
        kv_budget_tokens=a.kv_budget_tokens,
        max_model_len=a.max_model_len,
        policy_version=a.policy_version,
        default_max_tokens=a.default_max_tokens,
        max_tokens_cap=a.max_tokens_cap,
        prefix_cache_mb=a.prefix_cache_mb,
        prefill_chunk_tokens=a.prefill_chunk_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        max_request_mb=a.max_request_mb,
        reload_roots=a.reload_roots,
    )


if __name__ == "__main__":
    main()
