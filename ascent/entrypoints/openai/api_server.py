"""The OpenAI-compatible HTTP server (``ascent serve``): FastAPI routes over one in-process ``AsyncLLM``."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import ascent
from ascent.args import EngineArgs
from ascent.core.async_llm import AsyncLLM
from ascent.default_model import DEFAULT_MODEL_NAME
from ascent.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from ascent.entrypoints.openai.serving_chat import OpenAIServingChat
from ascent.entrypoints.openai.serving_completion import OpenAIServingCompletion
from ascent.entrypoints.openai.serving_tokens import FrontendOptions, OpenAIServingTokenization
from ascent.tokenizer import load_chat_template

logger = logging.getLogger(__name__)

DEFAULT_TRACE_DIR = "./profiles"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _ASGIEndpoint:
    """Wraps an ASGI callable so a plain ``Route`` serves it at an exact path (``/metrics``, no redirect)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_names: list[str], chat_template: str | None,
              metrics_app: ASGIApp | None = None, trace_dir: str = DEFAULT_TRACE_DIR,
              options: FrontendOptions | None = None, api_keys: list[str] | None = None,
              allowed_origins: list[str] | None = None, root_path: str = "") -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_names`` (the first one is the default).

    ``chat_template`` (file or template string) replaces the model's template; a bad value raises ValueError.
    ``metrics_app`` is served at ``/metrics``; when None, ``ascent.metrics.prometheus.make_metrics_app`` builds one
    if that module is importable. ``trace_dir`` is where ``/start_profile`` writes traces. ``api_keys``: the
    ``/v1`` routes need ``Authorization: Bearer <key>`` (vLLM's 401 otherwise); ``allowed_origins``: CORS origins
    (default every origin, as vLLM).
    """
    chat_template = load_chat_template(chat_template) if chat_template is not None else None
    app = FastAPI(title="ascent OpenAI-compatible server", version=ascent.__version__, root_path=root_path)
    app.state.completion = OpenAIServingCompletion(engine, served_model_names, chat_template, options)
    app.state.chat = OpenAIServingChat(engine, served_model_names, chat_template, options)
    app.state.tokens = OpenAIServingTokenization(engine, served_model_names, chat_template, options)
    app.state.trace_dir = trace_dir
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_methods=["*"],
                       allow_headers=["*"])
    if api_keys:
        _add_api_key_check(app, api_keys, root_path)
    _add_error_handlers(app)
    _add_openai_routes(app)
    _add_service_routes(app, engine, served_model_names)
    metrics_app = metrics_app if metrics_app is not None else _default_metrics_app(engine, served_model_names[0])
    if metrics_app is not None:
        app.add_route("/metrics", _ASGIEndpoint(metrics_app), methods=["GET"])
    return app


def _default_metrics_app(engine: AsyncLLM, model_name: str) -> ASGIApp | None:
    try:
        from ascent.metrics.prometheus import make_metrics_app
    except ImportError:
        logger.warning("prometheus metrics unavailable: /metrics is not served")
        return None
    return make_metrics_app(engine, model_name)


def to_response(result: Any) -> Response:
    """Map a handler result to HTTP: ErrorResponse -> its status, model -> JSON, generator -> SSE stream."""
    if isinstance(result, ErrorResponse):
        return JSONResponse(result.model_dump(), status_code=result.status_code)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    if isinstance(result, AsyncGenerator):
        return StreamingResponse(result, media_type="text/event-stream")
    return Response(status_code=499)  # the client disconnected; nobody reads this


def error_json(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None) -> JSONResponse:
    return to_response(ErrorResponse.create(message, status, param=param))


def _add_api_key_check(app: FastAPI, api_keys: list[str], root_path: str) -> None:
    """``--api-key``: every ``/v1`` route needs ``Authorization: Bearer <one of the keys>`` (vLLM's middleware:
    other routes and CORS preflights pass)."""
    expected = [f"Bearer {key}".encode() for key in api_keys]

    @app.middleware("http")
    async def _authenticate(request: Request, call_next: Any) -> Response:
        if request.method == "OPTIONS" or not request.url.path.startswith(f"{root_path}/v1"):
            return await call_next(request)
        given = request.headers.get("Authorization", "").encode()
        if not any(secrets.compare_digest(given, key) for key in expected):
            return JSONResponse({"error": "Unauthorized"}, status_code=HTTPStatus.UNAUTHORIZED)
        return await call_next(request)


async def _require_json(raw_request: Request) -> None:
    """vLLM's ``validate_json_request``: request bodies must be JSON (415 otherwise, not a confusing 400)."""
    media_type = raw_request.headers.get("content-type", "").lower().split(";")[0].strip()
    if media_type != "application/json":
        raise HTTPException(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                            "Unsupported Media Type: Only 'application/json' is allowed")


def _invalid_param(exc: RequestValidationError) -> str | None:
    """The request field the first validation error is about (None for whole-request checks and bad JSON)."""
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return None
        fields = [str(x) for x in err.get("loc", ()) if x != "body"]
        if fields:
            return fields[0]
    return None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"Invalid JSON in the request body: {detail}".rstrip(": "))
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(_validation_message(exc), param=_invalid_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(str(exc.detail), HTTPStatus(exc.status_code))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return error_json(str(exc))


def _add_openai_routes(app: FastAPI) -> None:
    json_only = [Depends(_require_json)]

    @app.post("/v1/completions", dependencies=json_only)
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return to_response(await app.state.completion.create_completion(request, raw_request))

    @app.post("/v1/chat/completions", dependencies=json_only)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return to_response(await app.state.chat.create_chat_completion(request, raw_request))

    @app.post("/tokenize", dependencies=json_only)
    async def tokenize(request: TokenizeRequest) -> Response:
        return to_response(app.state.tokens.tokenize(request))

    @app.post("/detokenize", dependencies=json_only)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return to_response(app.state.tokens.detokenize(request))


def _add_service_routes(app: FastAPI, engine: AsyncLLM, served_model_names: list[str]) -> None:
    model_config = engine.model_config

    @app.get("/health")
    async def health() -> Response:
        ready = engine.is_ready and not engine.errored
        return Response(status_code=HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # vLLM's SageMaker health route
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ascent.__version__})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=model_config.model, max_model_len=model_config.max_model_len)
                 for name in served_model_names]
        return to_response(ModelList(data=cards))

    @app.post("/start_profile")
    async def start_profile() -> JSONResponse:
        try:
            await engine.start_profile(app.state.trace_dir)
        except RuntimeError as exc:
            return error_json(str(exc))
        return JSONResponse({"status": "started", "trace_dir": app.state.trace_dir})

    @app.post("/stop_profile")
    async def stop_profile() -> JSONResponse:
        try:
            trace = await engine.stop_profile()
        except RuntimeError as exc:
            return error_json(str(exc))
        return JSONResponse({"status": "stopped", "trace": trace})


# ---------------------------------------------------------------------------------------------------- CLI
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``[MODEL] --host --port --served-model-name --chat-template --uvicorn-log-level --trace-dir`` + engine flags."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or .gguf file (same as --model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model argument)")
    server.add_argument("--chat-template", default=None, help="chat template file or string (overrides the model's)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--trace-dir", default=DEFAULT_TRACE_DIR, help="where /start_profile writes traces")
    _add_frontend_args(server)
    EngineArgs.add_cli_args(parser)
    return parser


def _add_frontend_args(server: Any) -> None:
    """vLLM's frontend flags (``vllm serve``): authentication, CORS, proxying, request logging, usage."""
    server.add_argument("--api-key", nargs="+", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY, else none)")
    server.add_argument("--allowed-origins", nargs="+", default=["*"], help="CORS origins (default: all)")
    server.add_argument("--root-path", default="", help="path prefix when served behind a path-routing proxy")
    server.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of host:port")
    server.add_argument("--response-role", default="assistant", help="role of replies after a generation prompt")
    server.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                        help="accepted for vLLM compatibility: string and OpenAI-part content both render as text")
    server.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="log every request's prompt and sampling params")
    server.add_argument("--disable-log-requests", action="store_true", help="(deprecated in vLLM) the default")
    server.add_argument("--max-log-len", type=int, default=None,
                        help="prompt characters / token ids logged per request (default: all)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every stream ends with a usage chunk, asked for or not")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log lines")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprob tokens as 'token_id:<id>' (tokens that are not valid UTF-8 stay identifiable)")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")


def frontend_options(args: argparse.Namespace) -> FrontendOptions:
    """The request-handling options of the ``ascent serve`` flags (ValueError naming a bad value)."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"max_log_len={args.max_log_len} is invalid: must be >= 0.")
    return FrontendOptions(response_role=args.response_role,
                           log_requests=args.enable_log_requests and not args.disable_log_requests,
                           max_log_len=args.max_log_len, force_include_usage=args.enable_force_include_usage,
                           prompt_tokens_details=args.enable_prompt_tokens_details,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def resolve_model_arg(args: argparse.Namespace) -> str | None:
    """The model from the positional argument or ``--model`` (ValueError when both disagree)."""
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"model given twice with different values: {tag!r} and --model {flag!r}.")
    return tag if tag is not None else flag


def run_server(args: argparse.Namespace) -> int:
    """Build the engine from the engine flags, serve until SIGINT/SIGTERM, then shut the engine down; returns 0."""
    import uvicorn

    args.model = resolve_model_arg(args)
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    options = frontend_options(args)
    api_keys = args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else None)
    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        app = build_app(engine, names, args.chat_template, trace_dir=args.trace_dir, options=options,
                        api_keys=api_keys, allowed_origins=args.allowed_origins, root_path=args.root_path)
        logger.info("froze %d start-up objects out of the garbage collector's reach", freeze_startup_heap())
        config = uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, root_path=args.root_path)
        _run_until_signal(uvicorn.Server(config))
    finally:
        engine.shutdown()
    return 0


def freeze_startup_heap() -> int:
    """vLLM's ``freeze_gc_heap``, for a server whose start-up is done: collect, then move every live object into the
    permanent generation, which collections skip. Serving then never walks the start-up heap (modules, model,
    tokenizer; a full collection over it took ~130 ms with SmolLM2), while objects made later are still collected.
    Collecting first keeps garbage from being frozen. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _run_until_signal(server: Any) -> None:
    """Run a ``uvicorn.Server``; it stops gracefully on SIGINT/SIGTERM.

    uvicorn re-raises the stopping signal once it is done; the handlers installed here absorb that re-raise so the
    caller can shut the engine down and return normally.
    """
    if threading.current_thread() is not threading.main_thread():
        server.run()
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda num, _frame: received.append(num)) for sig in _STOP_SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        logger.info("stopped by %s", signal.Signals(received[-1]).name)
