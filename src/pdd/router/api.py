"""The router's OpenAI-compatible HTTP API (FastAPI), in front of any ``Backend``.

``create_app(backend)`` serves /v1/completions, /v1/chat/completions (SSE streaming or not),
/v1/models, /tokenize, /detokenize, /version, /health and /metrics. This module only speaks HTTP: it validates, tokenizes, turns the
backend's token events into text (detokenize.py) and OpenAI bodies (openai_format.py) and closes the
backend's generator when the client leaves or a stop string ends the output early, which is how a request is cancelled everywhere.

Why one module: every route shares the same intake (auth, body limit, parsing, model check, tokenizing
off the event loop) held by ``_API``; the generation details already live beside it (streaming.py,
detokenize.py, openai_format.py), and what is left here is the HTTP surface read in one place.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Protocol, TypeVar, runtime_checkable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pdd.router.detokenize import IncrementalDetokenizer
from pdd.router.errors import APIError, from_validation_error, install_error_handlers, log
from pdd.router.openai_format import ChatFormatter, CompletionFormatter, Formatter, final_usage, sse_line
from pdd.router.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pdd.router.sse import RAW_SEND, SSEResponse
from pdd.router.streaming import BackendStream, ClientDisconnected, DeltaBuilder, text_deltas, watch_disconnect
from pdd.router.types import Generation, GenerationError, GenerationRequest, TokenEvent
from pdd.shared.protocol import SamplingSpec
from pdd.shared.tokenizer import render_messages

DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send temperature=0 for greedy
DISTRIBUTION = "pdd-serve"  # the installed package whose version /version reports

# Tokenizer calls run off the event loop, one at a time: HF fast tokenizers may reconfigure
# themselves inside encode (truncation/padding), which is not safe from several threads.
_TOKENIZE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdd-tokenize")

T = TypeVar("T", bound=BaseModel)

HTTP_RESPONSES = Counter("pdd:http_responses_total", "Router HTTP responses by route and status", ["route", "status"])
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version", "/health",
           "/metrics")
MAX_LOGGED_UNKNOWN = 256  # distinct unknown field names warned about per process (bounded: names come from clients)
_unknown_logged: set[str] = set()


def _note_unknown_fields(req: BaseModel, path: str) -> None:
    """Warn once per name about request fields neither OpenAI nor vLLM defines: accepted (as OpenAI
    does) but without effect, which the client may not expect."""
    for name in req.model_extra or ():
        if name not in _unknown_logged and len(_unknown_logged) < MAX_LOGGED_UNKNOWN:
            _unknown_logged.add(name)
            log.warning("unknown_request_field", field=name[:64], path=path)


@runtime_checkable
class Backend(Protocol):
    """What the HTTP layer needs from the orchestrator (router/orchestrator.py)."""

    model_name: str
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    max_context: int
    max_body_bytes: int
    api_keys: list[str]
    request_timeout_s: float  # optional; DEFAULT_REQUEST_TIMEOUT_S when absent
    registry: Any  # optional: the fleet registry (registry.py); /v1/models reports the dtypes it serves in

    def ready(self) -> bool: ...

    def health(self) -> dict: ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent] | Generation:
        """The request's token events: an async generator, or a ``Generation`` that fills its queue itself; either
        may raise GenerationError; closing it cancels the request."""
        ...


class _CountResponses:
    """Pure ASGI middleware counting responses (BaseHTTPMiddleware would wrap ``receive`` and
    interfere with disconnect detection). Routes outside the API collapse into one label."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in _ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

        async def counting_send(message: dict) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                HTTP_RESPONSES.labels(route=route, status=str(message["status"])).inc()

        await self.app(scope, receive, counting_send)


class _API:
    """Route handlers bound to one backend."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.created = int(time.time())
        self._keys = [k.encode() for k in (getattr(backend, "api_keys", None) or [])]

    # ---- request intake -------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
        # Compare against every key (no early exit) so timing says nothing about which key matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        if not ok:
            raise APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = int(self.backend.max_body_bytes)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        body = bytearray()
        try:
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        except ClientDisconnect:  # the connection ended before the body did: nobody to answer, no error
            raise _Gone() from None
        return bytes(body)

    @staticmethod
    def parse(model: type[T], body: bytes) -> T:
        if not body.strip():
            raise APIError(400, "request body is empty; expected a JSON object", code="invalid_json")
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.backend.model_name}'.", code="model_not_found", param="model")

    async def _in_pool(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, fn)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.backend.tokenizer)
        # min/max in C: a 64K-id prompt in ~1 ms; the schema leaves the range to this check (pydantic's per-item
        # bounds on a 64K-id union took ~4 ms more)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise APIError(400, f"'{param}': token ids must be in [0, {vocab})", param=param)

    async def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list):
            self.check_token_ids(prompt, "prompt")
            return list(prompt)
        tok = self.backend.tokenizer
        ids = await self._in_pool(lambda: list(tok.encode(prompt, add_special_tokens=add_special_tokens)))
        if not ids:
            raise APIError(400, "'prompt': must not be empty", param="prompt")
        return ids

    async def tokenize_chat(self, req: ChatCompletionRequest | TokenizeChatRequest,
                            add_special_tokens: bool = False) -> list[int]:
        tok = self.backend.tokenizer
        messages = req.template_messages()

        def render() -> list[int]:
            return render_messages(tok, messages, add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message,
                                   add_special_tokens=add_special_tokens, template_kwargs=req.chat_template_kwargs)

        try:
            return await self._in_pool(render)
        except Exception as exc:  # noqa: BLE001 - template errors (jinja raise_exception) are the client's
            raise APIError(400, f"'messages': the chat template rejected them: {type(exc).__name__}: "
                                f"{str(exc)[:300]}", param="messages") from None

    def generation_request(self, prefix: str, prompt_ids: list[int],
                           req: CompletionRequest | ChatCompletionRequest) -> GenerationRequest:
        max_context = int(self.backend.max_context)
        if max_context <= 0:  # no serving instance has announced itself yet
            raise APIError(503, "no serving instance is available yet; retry shortly", code="service_unavailable")
        room = max_context - len(prompt_ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        if room <= 0 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, you "
                                f"requested {len(prompt_ids) + max(max_tokens, 1)} tokens ({len(prompt_ids)} in "
                                f"the prompt, {max(max_tokens, 1)} for the completion). Please reduce the length "
                                "of the prompt or max_tokens.", code="context_length_exceeded",
                           param="max_tokens" if req.max_tokens is not None and room > 0 else "prompt")
        if req.min_tokens is not None and req.min_tokens > max_tokens:
            raise APIError(400, f"'min_tokens': must be at most max_tokens ({max_tokens}), got {req.min_tokens}",
                           param="min_tokens")
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=top_k,
            seed=secrets.randbits(63) if req.seed is None else req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            **req.sampling_fields(),
        )
        timeout = float(getattr(self.backend, "request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S))
        return GenerationRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_ids=prompt_ids,
            sampling=sampling,
            deadline_unix=time.time() + timeout,
            forced_pipeline=req.pdd.pipeline if req.pdd else None,
            forced_handoff=req.pdd.handoff if req.pdd else None,
            return_token_ids=bool(req.pdd and req.pdd.return_token_ids),
        )

    # ---- generation -----------------------------------------------------------------------
    async def respond(self, request: Request, greq: GenerationRequest,
                      req: CompletionRequest | ChatCompletionRequest, fmt: Formatter) -> Response:
        """Start the backend, wait for its first event (so early errors get a real status), then
        answer with one JSON body or an SSE stream (sse.py: written from the producer's callback)."""
        detok = IncrementalDetokenizer(self.backend.tokenizer, greq.prompt_ids, req.stop_list(),
                                       include_stop=req.include_stop_str_in_output,
                                       skip_special_tokens=req.skip_special_tokens,
                                       stop_token_ids=greq.sampling.stop_token_ids,
                                       min_tokens=greq.sampling.min_tokens)
        fmt.use_logprobs(self.backend.tokenizer, greq.sampling.logprobs)
        try:
            agen = self.backend.generate(greq)
        except GenerationError as exc:  # a backend may refuse before returning its generator
            raise APIError.from_generation_error(exc) from None
        stream = BackendStream(agen, greq.request_id, greq.deadline_unix)
        watcher = asyncio.create_task(watch_disconnect(request.receive, stream))
        builder = DeltaBuilder(detok, greq.sampling.max_tokens)
        deltas = text_deltas(stream, builder)

        async def finish() -> None:
            with anyio.CancelScope(shield=True):  # cleanup must not be cut short by cancellation
                watcher.cancel()
                await deltas.aclose()
                await stream.close()

        try:
            first = await deltas.__anext__()
        except BaseException as exc:
            await finish()
            raise self._as_api_error(exc, greq) from None

        if req.stream:
            return SSEResponse(stream, builder, fmt, first, len(greq.prompt_ids), close=finish,
                               on_error=lambda exc: sse_line(self._as_api_error(exc, greq).body()))  # type: ignore
        try:
            parts = [first.text]
            fmt.note(first)
            last = first
            while last.finish_reason is None:
                last = await deltas.__anext__()
                parts.append(last.text)
                fmt.note(last)
        except BaseException as exc:
            raise self._as_api_error(exc, greq) from None
        finally:
            await finish()
        usage = final_usage(len(greq.prompt_ids), last.completion_tokens, last.info)
        return JSONResponse(fmt.full("".join(parts), last.finish_reason or "stop", usage, last.info))

    @staticmethod
    def _as_api_error(exc: BaseException, greq: GenerationRequest) -> APIError | BaseException:
        """The HTTP error for a failed generation; cancellation passes through unchanged."""
        if isinstance(exc, ClientDisconnected):
            log.info("client_disconnected", request_id=greq.request_id)
            return _Gone()
        if isinstance(exc, GenerationError):
            log.info("generation_error", request_id=greq.request_id, status=exc.http_status, code=exc.code)
            return APIError.from_generation_error(exc)
        if isinstance(exc, Exception):
            log.error("backend_error", request_id=greq.request_id, error_type=type(exc).__name__)
            return APIError(500, "internal error while generating", code="internal_error")
        return exc


def _has_key(body: bytes, key: str) -> bool:
    """Whether the body is a JSON object with ``key`` (which request shape /tokenize got)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False  # parse() reports it
    return isinstance(obj, dict) and key in obj


class _Gone(APIError):
    """The client left; the answer goes nowhere (499, nginx's 'client closed request')."""

    def __init__(self) -> None:
        super().__init__(499, "client closed request", code="client_closed_request")


class _App(FastAPI):
    """FastAPI that keeps the server's own ``send`` in the scope (``RAW_SEND``): a stream's SSE events between its
    start and its end go there directly (sse.py), past the middleware, which read only the start and the end."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(backend: Backend) -> FastAPI:
    """The OpenAI-compatible app for ``backend`` (see ``Backend``).

    Per-request serving metrics (TTFT, ITL, E2E, tokens) are the orchestrator's; this layer only
    counts HTTP responses by route and status (``pdd:http_responses_total``), 4xx rejections included.
    """
    api = _API(backend)
    app = _App(title="PDD router", summary="OpenAI-compatible API of the PDD router",
                  docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(_CountResponses)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        api.check_auth(request)
        req = api.parse(CompletionRequest, await api.read_body(request))
        _note_unknown_fields(req, "/v1/completions")
        api.check_model(req.model)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        prompt_ids = await api.tokenize_prompt(req.prompt, add_special)  # type: ignore[arg-type]
        greq = api.generation_request("cmpl", prompt_ids, req)
        fmt = CompletionFormatter(greq.request_id, backend.model_name, req.include_usage(),
                                  len(prompt_ids) if req.continuous_usage() else None)
        return await api.respond(request, greq, req, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        api.check_auth(request)
        req = api.parse(ChatCompletionRequest, await api.read_body(request))
        _note_unknown_fields(req, "/v1/chat/completions")
        api.check_model(req.model)
        prompt_ids = await api.tokenize_chat(req, bool(req.add_special_tokens))
        greq = api.generation_request("chatcmpl", prompt_ids, req)
        fmt = ChatFormatter(greq.request_id, backend.model_name, req.include_usage(),
                            len(prompt_ids) if req.continuous_usage() else None)
        return await api.respond(request, greq, req, fmt)

    def model_card() -> dict[str, Any]:
        card = {"id": backend.model_name, "object": "model", "created": api.created, "owned_by": "pdd",
                "max_model_len": int(backend.max_context)}
        registry = getattr(backend, "registry", None)
        if registry is not None:  # {"dtype": .., "kv_dtype": ..} as the engine instances announce them
            card["pdd"] = registry.serving_dtypes()
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        api.check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        api.check_auth(request)
        api.check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt, or messages rendered as /v1/chat/completions renders them."""
        api.check_auth(request)
        body = await api.read_body(request)
        chat = _has_key(body, "messages")
        req = api.parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        api.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await api.tokenize_chat(req, req.add_special_tokens)
        else:
            tok = backend.tokenizer
            ids = await api._in_pool(lambda: list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)))
        strs = await api._in_pool(lambda: backend.tokenizer.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": int(backend.max_context), "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: token ids back to text (special tokens kept, as vLLM does)."""
        api.check_auth(request)
        req = api.parse(DetokenizeRequest, await api.read_body(request))
        api.check_model(req.model)
        api.check_token_ids(req.tokens, "tokens")
        text = await api._in_pool(lambda: backend.tokenizer.decode(req.tokens))
        return {"prompt": text}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version(DISTRIBUTION)}

    @app.get("/health")
    async def health() -> JSONResponse:
        if backend.ready():
            return JSONResponse({"status": "ok", **backend.health()})
        return JSONResponse({"status": "unavailable", **backend.health()}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
