"""``megapipe serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (megapipe.inference.responses), /tokenize,
/detokenize, /health (and /ping), /version, /metrics, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter:
each LoRA adapter the engine holds is a model of its own in /v1/models, chosen per request by ``model``
(megapipe.inference.lora).
Safe by default: binds 127.0.0.1; an API key (when set) guards every route but /health and /ping; bodies, queue,
``n`` and ``max_tokens`` are bounded; every error has OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}`` and a user's mistake is never a 500. A client that goes away aborts its request (its KV blocks are freed
at once);
SIGTERM stops accepting connections, lets in-flight requests finish for up to ``shutdown_timeout`` seconds (those
still running just before it are answered with a 503 ``shutting_down``), exits 0.
"""

from __future__ import annotations

import asyncio
import codecs
import contextvars
import hmac
import json
import logging
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from megapipe import __version__
from megapipe.data.chat_template import ChatTemplateError, load_chat_template, split_harmony
from megapipe.data.images import (
    ImageError,
    ImageLimits,
    ImageProcessor,
    expand_image_tokens,
    image_markers,
    open_image,
)
from megapipe.errors import DataError, MegapipeError
from megapipe.inference.async_engine import EngineDead, QueueFull, ShuttingDown, StreamingEngine
from megapipe.inference.detokenize import special_ids
from megapipe.inference.engine import RequestOutput, TextPrompt
from megapipe.inference.metrics import ServerMetrics
from megapipe.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from megapipe.inference.reasoning import reasoning_parser_for
from megapipe.inference.responses import ResponseBuilder, ResponsesRequest, usage_of
from megapipe.inference.sampling import ParamError, SamplingParams
from megapipe.inference.tool_calls import (
    FirstCall,
    NamedCall,
    Parser,
    RequiredCalls,
    ToolChoice,
    ToolStream,
    parser_for,
)

log = logging.getLogger("megapipe.serve")
MiB = 1 << 20
_LORA: contextvars.ContextVar = contextvars.ContextVar("lora", default=None)  # the adapter a request asked for
# vLLM's return_tokens_as_token_ids: the request's logprob tokens as "token_id:N" (ids that do not decode alone)
_AS_IDS: contextvars.ContextVar = contextvars.ContextVar("as_ids", default=False)


@dataclass
class ServerConfig:
    model_name: str
    model_path: str = ""
    api_key: Optional[str] = None
    max_queue: Optional[int] = 256
    max_body_bytes: int = 8 * MiB
    shutdown_timeout: float = 30.0
    disconnect_poll_s: float = 0.2
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    tool_call_parser: Optional[str] = None  # how tool_choice auto finds calls in the output (tool_calls.PARSERS)
    chat_template: Optional[str] = None  # --chat-template (None: the tokenizer's own)
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation config (protocol.generation_defaults)
    allowed_origins: list = field(default_factory=list)  # CORS: origins browsers may call from (none: no CORS)
    reasoning_parser: Optional[str] = None  # where reasoning_content comes from (reasoning.PARSERS)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def error_body(message: str, type_: str, param: Optional[str] = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_from(e: ValidationError) -> tuple[Optional[str], str]:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    return param, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"


def _refusal(header: str, key: str) -> Optional[str]:
    """Why an Authorization header does not carry ``key`` (None when it does); the scheme is case-insensitive
    (RFC 7235)."""
    if not header:
        return "no API key was given"
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return f"the Authorization scheme is {scheme[:20]!r}, not Bearer"
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        return "the API key is wrong"
    return None


class Guard:
    """The API key (every route but /health) and the body size limit, checked before any route runs. A plain ASGI
    middleware: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) passes every streamed chunk through a
    memory stream and its own task group, a third of the front end's CPU time at 64 concurrent streams."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send) -> None:
        refused = self.refusal(scope["path"], Headers(scope=scope)) if scope["type"] == "http" else None
        if refused is not None:
            await refused.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers) -> Optional[APIError]:
        cfg = self.config
        if cfg.api_key is not None and path not in ("/health", "/ping"):
            why = _refusal(headers.get("authorization", ""), cfg.api_key)
            if why is not None:
                return APIError(401, f"Unauthorized: {why} (send 'Authorization: Bearer KEY')",
                                "invalid_request_error", None, "invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            return APIError(413, f"the request body ({int(length)} bytes) exceeds the limit of {cfg.max_body_bytes} "
                                 f"bytes", param=None, code="request_too_large")
        return None


MAX_BODY_DEPTH = 512  # levels of [ and { a request body may nest (a JSON schema needs a few dozen at most)


def _nesting(data) -> int:
    """How many levels of lists and objects ``data`` nests, counted without recursion. Left to the recursion limit,
    where a deep body fails depended on how deep the server's own stack was (990 levels passed on one machine)."""
    deepest, stack = 0, [(data, 1)] if isinstance(data, (list, dict)) else []
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return deepest


def _too_deep() -> APIError:
    return APIError(400, f"the request body is nested too deeply (more than {MAX_BODY_DEPTH} levels of [ and {{)",
                    code="invalid_json")


def _check_text(data) -> None:
    """Refuse a string that is not Unicode text: a lone UTF-16 surrogate such as "\\ud800" is legal JSON."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request body holds a lone UTF-16 surrogate (\\u{ord(e.object[e.start]):04x}): "
                            f"strings must be Unicode text", code="invalid_json") from None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _counts(prompt: int, completion: int) -> dict:
    """OpenAI's usage counts."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _TextOffsets:
    """Where each token's text starts in a completion, in characters of the tokens' bytes read as UTF-8: a token that
    holds part of a character starts where that character does (its decoded text alone is U+FFFD)."""

    def __init__(self):
        self.pos = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, raw: bytes) -> int:
        at = self.pos
        self.pos += len(self._utf8.decode(raw))
        return at


_UNAVAILABLE = (QueueFull, ShuttingDown, EngineDead)


def _unavailable(e: BaseException) -> APIError:
    """The 503 for an engine that cannot take or finish a request, its code naming why."""
    code = {QueueFull: "queue_full", ShuttingDown: "shutting_down"}.get(type(e), "engine_dead")
    return APIError(503, str(e), "server_error", code=code)


def _renamed(e: ParamError, names: dict) -> APIError:
    """A 400 for ``e`` under the name the request used (max_completion_tokens for max_tokens, ...)."""
    param = names.get(e.param, e.param)
    message = str(e)
    if param != e.param and message.startswith(e.param):
        message = param + message[len(e.param):]
    return APIError(400, message, param=param)


# the chat request's names of a Responses request's fields, for its errors
RESPONSES_NAMES = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens"}


@dataclass
class _ChatTurn:
    prompt: Any
    images: Any
    params: SamplingParams
    tools: ToolChoice
    thinks: bool  # the reply may hold reasoning (no grammar shapes it)
    echo: str  # vLLM's echo: the last (assistant) message's content, which the reply continues


class OpenAIServer:
    def __init__(self, engine: StreamingEngine, config: ServerConfig, on_ready=None):
        self.engine, self.config, self.on_ready = engine, config, on_ready
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.chat_template, self.no_chat_template = self._load_chat_template()
        self.loras = dict(engine.loras)  # name -> path; changed only by the two routes below
        self.image_text, self.image_processor = self._image_inputs()
        self.tool_parser = parser_for(config.tool_call_parser)
        self.reasoning = reasoning_parser_for(config.reasoning_parser)
        self.metrics = ServerMetrics(engine.stats, config.model_name, engine.max_model_len, engine.cache_info)
        engine.on_output = self.metrics.observe
        self.created = int(time.time())
        self.app = self._build()

    # ----------------------------------------------------------------------------------------------- plumbing

    def _build(self) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_app):
            if self.on_ready is not None:
                self.on_ready()
            yield

        app = FastAPI(title="megapipe", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=lifespan)
        cfg = self.config

        app.add_middleware(Guard, config=cfg)
        if cfg.allowed_origins:  # outside the key check: a browser's preflight carries no key
            from fastapi.middleware.cors import CORSMiddleware

            app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=["*"],
                               allow_headers=["*"])

        @app.exception_handler(APIError)
        async def api_error(_request, exc: APIError):
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc: StarletteHTTPException):
            if exc.status_code == 404:
                msg = f"there is no route {request.method} {request.url.path}"
            elif exc.status_code == 405:
                msg = f"{request.method} is not allowed on {request.url.path}"
            else:
                msg = str(exc.detail)
            return APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None).response()

        @app.exception_handler(Exception)
        async def internal(_request, exc: Exception):
            log.error("internal error: %r", exc, exc_info=exc)
            return APIError(500, "internal server error", "server_error").response()

        self._routes(app)
        return app

    def _routes(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.api_route("/ping", methods=["GET", "POST"])(self.health)  # vLLM's (SageMaker's) name for it
        app.get("/version")(self.version)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)

    async def _body(self, request: Request, model_cls):
        limit = self.config.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:  # json.loads recurses: a body thousands of levels deep fails there, before _parse counts its levels
            return self._parse(b"".join(chunks), model_cls)
        except RecursionError:
            raise _too_deep() from None

    @staticmethod
    def _parse(raw: bytes, model_cls):
        try:
            data = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        if _nesting(data) > MAX_BODY_DEPTH:
            raise _too_deep()
        _check_text(data)
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            param, msg = _param_from(e)
            raise APIError(400, msg, param=param) from None

    def _check_model(self, name: Optional[str]) -> None:
        """The base model or one of the LoRA adapters (which this request then runs with)."""
        if name is not None and name != self.config.model_name and name not in self.loras:
            served = ", ".join(f"`{n}`" for n in [self.config.model_name, *self.loras])
            raise APIError(404, f"The model `{name}` does not exist (this server serves {served})",
                           param="model", code="model_not_found")
        _LORA.set(name if name in self.loras else None)

    def _model_name(self) -> str:
        return _LORA.get() or self.config.model_name

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return self.tokenizer

    def _logprob_token(self, token: int) -> str:
        """A token as logprobs name it: its text, or "token_id:N" where the request asked for ids."""
        return f"token_id:{token}" if _AS_IDS.get() else self._token_text(token)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"

    def _token_bytes(self, token: int) -> bytes:
        """The token's own bytes (part of a UTF-8 character where its text shows U+FFFD)."""
        raw = getattr(self.tokenizer, "token_bytes", None)
        return raw(token) if raw is not None else self._token_text(token).encode("utf-8")

    @staticmethod
    def _request_id(request: Request, body) -> str:
        """vLLM's: the X-Request-Id header, else the body's request_id, else a fresh one (the response's id is it
        after cmpl- or chatcmpl-; the X-Request-Id header that goes back is it alone)."""
        return request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex

    async def _stream(self, prompt, params, images=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them; closing the stream aborts an unfinished request. A client
        that leaves closes it: a streamed response's (StreamingResponse cancels its body when the client
        disconnects, or its next write fails), a whole one's through _until_done's poll."""
        outputs = self.engine.generate(prompt, params, lora=_LORA.get(), images=images)
        try:
            async for out in outputs:
                if out.finished:  # max_tokens as in force: cut to the context's room, that room where unset
                    room = self.max_model_len - len(out.prompt_token_ids)
                    self.metrics.observe_params(params.n, min(params.max_tokens or room, room))
                yield out
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        except _UNAVAILABLE as e:
            raise _unavailable(e) from None
        finally:
            await outputs.aclose()  # an unfinished request is aborted, its blocks freed

    async def _final(self, prompt, params, images=None) -> RequestOutput:
        last = None
        async for out in self._stream(prompt, params, images):
            last = out
        return last

    def _admissible(self, count: int) -> None:
        """A streamed response's status goes out before its first output: a full queue or a stopped engine is a 503
        now, not an error event after a 200."""
        try:
            self.engine.check_admission(count)
        except _UNAVAILABLE as e:
            raise _unavailable(e) from None

    @staticmethod
    async def _started(outputs: AsyncIterator, params) -> AsyncIterator:
        """A constrained stream's outputs, the first one (or the request's error) awaited before the response starts:
        an engine core process compiles the grammar when the request reaches it, and a compile that fails there is
        then a 400 as it is without streaming, not an error event after a 200. The first event waits for that output
        anyway, so the time to first token is the same; an unconstrained stream starts at once."""
        if params.structured is None:
            return outputs
        try:
            first = [await outputs.__anext__()]
        except StopAsyncIteration:
            first = []
        except BaseException:
            await outputs.aclose()  # cancelled while waiting: abort the request
            raise

        async def replay():
            try:
                for item in first:
                    yield item
                async for item in outputs:
                    yield item
            finally:
                await outputs.aclose()

        return replay()

    async def _until_done(self, request: Request, coros: list) -> list:
        """Run the coroutines; cancel them (aborting their requests) if the client disconnects first."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=self.config.disconnect_poll_s,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t for t in done if not t.cancelled() and t.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()  # the others are cancelled below (their requests aborted)
                if not pending:
                    return [t.result() for t in tasks]
                if await request.is_disconnected():
                    # answered to nobody; an exception of its own would be logged as the server's failure
                    raise APIError(499, "the client closed the connection before the response",
                                   code="client_closed")
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    async def _validate_all(self, prompts, params, names: Optional[dict] = None) -> None:
        """Check every prompt before any runs, so an error never leaves a half-served request behind; ``names``: the
        request's own names of the parameters (max_completion_tokens for max_tokens, ...)."""
        for p in prompts:
            _, ids = self.engine.encode(p)
            try:
                self.engine.check_request(ids, params)
            except ParamError as e:
                raise _renamed(e, names or {}) from None

    async def _structured(self, body, params, tools: Optional[ToolChoice] = None) -> None:
        """Set params.structured from the request (a forced tool choice's grammar included), compiled before the
        request is queued (on the grammar worker thread; cached), so a bad schema is a 400 and the engine thread
        only looks the grammar up; with an engine core process, parsed here and compiled there."""
        try:
            constraint = body.constraint()
            forced = tools.constraint() if tools is not None else None
            if forced is not None and constraint is not None:
                raise ParamError("tool_choice", f"tool_choice {tools.mode} and {constraint.param} exclude each other")
            constraint = forced or constraint
            if constraint is not None:
                self._need_tokenizer()
                await asyncio.wrap_future(self.engine.grammars.submit(constraint))
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        params.structured = constraint

    def _logprobs_block(self, token_ids, lps, offsets: "_TextOffsets", k: int, prompt_entries=None) -> dict:
        """The completions API's logprobs: each token, its logprob, its top ``k`` alternatives and itself (OpenAI's
        and vLLM's: up to k + 1 entries), and where its text starts (``offsets`` carries on from the last block)."""
        tokens, token_lps, tops, starts = [], [], [], []
        for tok, entry in list(zip(*prompt_entries, strict=True) if prompt_entries else []) + list(
                zip(token_ids, lps or [], strict=False)):
            text = self._logprob_token(tok)
            tokens.append(text)
            starts.append(offsets.take(self._token_bytes(tok)))
            if entry is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(entry[0])
                top = {self._logprob_token(t): v for t, v in entry[1][:k]}
                tops.append({**top, text: entry[0]})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": starts}

    def _prompt_logprobs(self, entries) -> list:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} for the token itself and its top alternatives."""
        def item(lp, rank, token):
            return {"logprob": lp, "rank": rank, "decoded_token": self._token_text(token)}

        out = []
        for token, entry in zip(*entries, strict=True):
            if entry is None:
                out.append(None)
                continue
            lp, alts, rank = entry
            found = {str(t): item(v, r, t) for r, (t, v) in enumerate(alts, 1)}
            found.setdefault(str(token), item(lp, rank, token))
            out.append(found)
        return out

    # ----------------------------------------------------------------------------------------------- routes

    async def health(self):
        if not self.engine.alive:
            return APIError(503, "the engine stopped", "server_error").response()
        return Response(status_code=200)

    async def version(self):
        return {"version": __version__}

    async def prometheus(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        def card(name, root, parent):
            return {"id": name, "object": "model", "created": self.created, "owned_by": "megapipe", "root": root,
                    "parent": parent, "max_model_len": self.max_model_len}

        return {"object": "list", "data": [card(self.config.model_name, self.config.model_path, None)] + [
            card(name, path, self.config.model_name) for name, path in self.loras.items()]}

    async def load_lora_adapter(self, request: Request):
        """vLLM's shape: {"lora_name", "lora_path"} (a peft adapter directory or a megapipe LoRA run)."""
        from megapipe.checkpoint.hf.peft import read_adapters

        body = await self._body(request, LoadLoRARequest)
        name = body.lora_name
        if name == self.config.model_name or (name in self.loras and not body.load_inplace):
            raise APIError(400, f"a model named `{name}` is already served (load_inplace: true replaces an "
                                f"adapter's weights)", param="lora_name")
        if not self.engine.config.max_loras:
            raise APIError(400, "this server serves no LoRA adapters: start it with --max-loras >= 1 or "
                                "--lora-modules", param="lora_name")
        try:  # reading the files does not touch the engine: off the event loop, beside the engine
            read = await asyncio.to_thread(read_adapters, body.lora_path, self.engine.model_config)
            await self.engine.utility("add_lora", name, body.lora_path, *read, name in self.loras)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineDead as e:
            raise _unavailable(e) from None
        except (MegapipeError, OSError, ValueError, KeyError) as e:  # KeyError: an adapter_config.json without "r"
            raise APIError(400, f"cannot load LoRA adapter `{name}` from {body.lora_path}: {e}",
                           param="lora_path") from None
        self.loras[name] = body.lora_path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request):
        """vLLM's shape: {"lora_name"}."""
        body = await self._body(request, UnloadLoRARequest)
        name = body.lora_name
        if name not in self.loras:
            raise APIError(404, f"no LoRA adapter `{name}` is loaded", param="lora_name", code="model_not_found")
        try:
            await self.engine.utility("remove_lora", name)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineDead as e:
            raise _unavailable(e) from None
        del self.loras[name]
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    async def tokenize(self, request: Request):
        body = await self._body(request, TokenizeRequest)
        self._check_model(body.model)
        tok = self._need_tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None and any(m.image_urls() for m in body.messages):
            raise APIError(400, "/tokenize takes messages of text only (image parts are not counted here)",
                           param="messages")
        text = body.prompt if body.prompt is not None else self._render(
            body.messages, body.add_generation_prompt, None, body.continue_final_message, body.chat_template_kwargs)
        specials = body.add_special_tokens if body.add_special_tokens is not None else body.prompt is not None
        ids = tok.encode(text, specials)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    async def detokenize(self, request: Request):
        body = await self._body(request, DetokenizeRequest)
        self._check_model(body.model)
        tok = self._need_tokenizer()
        bad = next((t for t in body.tokens if not 0 <= t < self.engine.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.engine.vocab_size})",
                           param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    def _load_chat_template(self):
        """(the tokenizer's chat template, None) or (None, why chat requests are refused)."""
        path = getattr(self.tokenizer, "path", None)
        choice = self.config.chat_template
        try:
            template = load_chat_template(path, choice) if path is not None else None
        except DataError as e:  # several templates and no default, or an unreadable one: completions still work
            if choice is not None:
                raise  # a template the server was told to use (serve checks it before anything loads)
            return None, str(e)
        if template is None:
            return None, "this model's tokenizer has no chat template: use /v1/completions"
        return template, None

    def _image_inputs(self) -> tuple[Optional[str], Optional[ImageProcessor]]:
        """(the text of one image's markers, the image processor) of a vision-language model; (None, None) else."""
        text = image_markers(self.engine.model_config, self.tokenizer)
        return (text, ImageProcessor.from_dir(self.tokenizer.path)) if text is not None else (None, None)

    def _keep(self, body) -> Optional[int]:
        """vLLM's truncate_prompt_tokens checked: how many of a prompt's last tokens to keep (-1: --max-model-len)."""
        keep, limit = body.truncate_prompt_tokens, self.max_model_len
        if keep is None:
            return None
        if not (keep == -1 or 1 <= keep <= limit):
            raise APIError(400, f"truncate_prompt_tokens = {keep!r} must be -1 (--max-model-len) or within [1, "
                                f"{limit}]", param="truncate_prompt_tokens")
        return limit if keep == -1 else keep

    def _text_prompt(self, text: str, add_special_tokens: bool, keep: Optional[int] = None):
        """The prompt to run for a text: the text itself, or its ids with the tokenizer's special tokens around them
        (a BOS) where the request wants them, cut to its last ``keep`` tokens, specials included, as a Hugging Face
        tokenizer truncating from the left cuts (the text then decoded from what is left)."""
        before, after = self.tokenizer.added_tokens if add_special_tokens else ([], [])
        if keep is None and not (before or after):
            return text
        ids = self.tokenizer.encode(text)
        if keep is not None and len(ids) + len(before) + len(after) > keep:
            room = max(keep - len(before) - len(after), 0)
            ids = ids[len(ids) - room:] if room else []
            text = self.tokenizer.decode(ids)
        return TextPrompt(text, before + ids + after)

    def _with_images(self, text: str, urls: list[str], add_special_tokens: bool) -> tuple[list[int], object]:
        """The rendered prompt's tokens, each image's placeholder repeated for its patches, and its images."""
        pil = []
        for i, url in enumerate(urls):
            try:
                pil.append(open_image(url, self.config.image_limits))
            except ImageError as e:
                raise APIError(400, f"image {i + 1} of the request: {e}", param="messages") from None
        try:
            pixels, grids = self.image_processor(pil)
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        counts = [self.image_processor.token_count(g) for g in grids]
        try:
            ids = expand_image_tokens(self.tokenizer.encode(text, add_special_tokens),
                                      self.engine.model_config.image_token_id, counts)
            return ids, self.engine.prompt_images(ids, pixels, grids)
        except ImageError as e:
            raise APIError(400, str(e), param="messages") from None
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _render(self, messages, add_generation_prompt: bool = True, tools: Optional[list] = None,
                continue_final_message: bool = False, variables: Optional[dict] = None) -> str:
        if self.chat_template is None:
            raise APIError(400, self.no_chat_template, param="messages")
        try:
            return self.chat_template.render([m.as_template_input(self.image_text) for m in messages], tools=tools or None,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, variables=variables)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _usage(self, outs: list[RequestOutput]) -> dict:
        usage = _counts(sum(len(o.prompt_token_ids) for o in outs), sum(o.num_generated_tokens for o in outs))
        cached = sum(o.num_cached_tokens for o in outs)
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    # ----------------------------------------------------------------------------------------------- completions

    def _completion_prompts(self, body: CompletionRequest) -> list:
        p = body.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        limit = self.config.max_queue
        if limit is not None and len(prompts) > limit:
            raise APIError(400, f"this request holds {len(prompts)} prompts; this server queues at most {limit} "
                                f"requests (--max-queue): send fewer prompts per request", param="prompt")
        if any(isinstance(x, str) for x in prompts):
            self._need_tokenizer()
        keep = self._keep(body)
        return [self._text_prompt(x, body.add_special_tokens, keep) if isinstance(x, str) else
                (x if keep is None else x[-keep:]) for x in prompts]

    async def completions(self, request: Request):
        body = await self._body(request, CompletionRequest)
        self._check_model(body.model)
        _AS_IDS.set(body.return_tokens_as_token_ids)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        prompts = self._completion_prompts(body)
        echo_only = body.echo and body.max_tokens == 0  # scoring a text (log-likelihood): nothing is generated
        lp = body.logprobs
        # the prompt's logprobs: echo's with logprobs, prompt_logprobs' (vLLM's), the larger count serves both
        wanted = [k for k in (lp if body.echo else None, body.prompt_logprobs) if k is not None]
        try:
            params = body.sampling_params(1 if echo_only else body.max_tokens, lp, max(wanted) if wanted else None,
                                          self.config.sampling_defaults)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        if echo_only:
            params.temperature = 0.0
        await self._structured(body, params)
        await self._validate_all(prompts, params)
        base, created = self._request_id(request, body), int(time.time())
        rid, headers = f"cmpl-{base}", {"X-Request-Id": base}
        if body.stream:
            self._admissible(len(prompts))
            outputs = await self._started(self._merged(prompts, params), params)
            return StreamingResponse(self._stream_completion(body, outputs, rid, created, echo_only),
                                     media_type="text/event-stream", headers=headers)
        outs = await self._until_done(request, [self._final(p, params) for p in prompts])
        choices = []
        for i, out in enumerate(outs):
            prompt_text = out.prompt if out.prompt is not None else (
                self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else "")
            for c in out.outputs:
                text, ids, lps = c.text, c.token_ids, c.logprobs
                if echo_only:
                    text, ids, lps = "", [], []
                logprobs = None
                if lp is not None:
                    prompt_entries = (out.prompt_token_ids, out.prompt_logprobs) if body.echo else None
                    logprobs = self._logprobs_block(ids, lps, _TextOffsets(), lp, prompt_entries)
                choice = {"index": i * body.n + c.index, "text": (prompt_text if body.echo else "") + text,
                          "logprobs": logprobs, "finish_reason": "length" if echo_only else c.finish_reason,
                          "stop_reason": c.stop_reason}
                if body.return_token_ids:
                    choice |= {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(ids)}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(self._top(out, body.prompt_logprobs))
                choices.append(choice)
        usage = self._usage(outs)
        if echo_only:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self._model_name(),
                             "choices": choices, "usage": usage}, headers=headers)

    @staticmethod
    def _top(out: RequestOutput, k: int) -> tuple[list, list]:
        """The prompt's tokens and logprob entries with (at most) k alternatives each."""
        return out.prompt_token_ids, [e if e is None else (e[0], e[1][:k], *e[2:]) for e in out.prompt_logprobs]

    async def _merged(self, prompts, params):
        """(prompt index, output) from all prompts' streams as they come."""
        if len(prompts) == 1:  # the common case: no task and queue in between
            stream = self._stream(prompts[0], params)
            try:
                async for out in stream:
                    yield 0, out
            finally:
                await stream.aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, p):
            try:
                async for out in self._stream(p, params):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
        live = len(tasks)
        try:
            while live:
                i, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _stream_completion(self, body, outputs, rid, created, echo_only):
        name, n, k = self._model_name(), body.n, body.logprobs
        sent_text: dict[int, int] = {}
        sent_ids: dict[int, int] = {}
        offsets: dict[int, _TextOffsets] = {}
        ended: set[int] = set()  # the choices whose finish_reason was sent: nothing follows it
        finals: dict[int, RequestOutput] = {}
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        running_usage = include_usage and options.continuous_usage_stats
        with_ids: set[int] = set()  # return_token_ids: the choices whose prompt ids were sent

        def chunk(index, text, out, c, logprobs=None, finish=None, ids=()):
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": c.stop_reason if finish == "stop" else None}
            if body.return_token_ids:  # vLLM's: each chunk's new ids, the prompt's with a choice's first chunk
                choice["token_ids"] = list(ids)
                if index not in with_ids:
                    with_ids.add(index)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            event = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [choice]}
            if running_usage:  # vLLM's continuous_usage_stats: this choice's counts so far
                event["usage"] = _counts(len(out.prompt_token_ids), len(c.token_ids) if not echo_only else 0)
            return _sse(event)

        try:
            async for i, out in outputs:
                for c in out.outputs:
                    key = i * n + c.index
                    if key in ended:
                        continue
                    if key not in sent_text:
                        sent_text[key] = sent_ids[key] = 0
                        offsets[key] = _TextOffsets()
                        if body.echo:
                            prompt_text = out.prompt if out.prompt is not None else self.tokenizer.decode(
                                out.prompt_token_ids)
                            lps = None
                            if k is not None:
                                lps = self._logprobs_block([], [], offsets[key], k,
                                                           (out.prompt_token_ids, out.prompt_logprobs))
                            yield chunk(key, prompt_text, out, c, lps)
                    if echo_only:
                        if c.finish_reason is not None:
                            ended.add(key)
                            yield chunk(key, "", out, c, None, "length")
                        continue
                    delta = c.text[sent_text[key]:]
                    new_ids = c.token_ids[sent_ids[key]:]
                    finish = c.finish_reason if c.finish_reason != "abort" else None
                    if delta or new_ids or finish:
                        lps = None
                        if k is not None:
                            lps = self._logprobs_block(new_ids, (c.logprobs or [])[sent_ids[key]:], offsets[key], k)
                        yield chunk(key, delta, out, c, lps, finish, new_ids)
                    if finish:
                        ended.add(key)
                    sent_text[key], sent_ids[key] = len(c.text), len(c.token_ids)
                if out.finished:
                    finals[i] = out
            if include_usage:
                usage = self._usage(list(finals.values()))
                if echo_only:
                    usage["completion_tokens"], usage["total_tokens"] = 0, usage["prompt_tokens"]
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [],
                            "usage": usage})
        except APIError as e:
            yield _sse(error_body(e.message, e.type, e.param, e.code))
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------------------------------------------- chat

    async def _chat_turn(self, body: ChatCompletionRequest, names: Optional[dict] = None) -> _ChatTurn:
        """A chat request checked and made ready to run: its prompt (and images), its sampling parameters (its
        grammar compiled), its tools; shared by /v1/chat/completions and /v1/responses (``names``: the request's
        own names of the parameters, for its errors)."""
        self._check_model(body.model)
        _AS_IDS.set(body.return_tokens_as_token_ids)
        try:
            tools = ToolChoice.parse(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        if tools.mode == "auto" and self.tool_parser is None:
            raise APIError(400, "tool_choice auto (the default with tools) needs the server started with "
                                "--tool-call-parser (hermes, llama3_json or openai); or name a function or say "
                                "required", param="tool_choice")
        self._need_tokenizer()
        text = self._render(body.messages, body.add_generation_prompt, body.tools, body.continue_final_message,
                            body.chat_template_kwargs)
        urls = [url for m in body.messages for url in m.image_urls()]
        specials = body.add_special_tokens
        if urls and body.truncate_prompt_tokens is not None:
            raise APIError(400, "truncate_prompt_tokens cannot cut a prompt with images (their tokens would be cut)",
                           param="truncate_prompt_tokens")
        prompt, images = (await asyncio.to_thread(self._with_images, text, urls, specials)) if urls else (
            self._text_prompt(text, specials, self._keep(body)), None)
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens" if body.max_completion_tokens
                 is not None else "max_tokens", **(names or {})}
        try:
            params = body.sampling_params(max_tokens, (top or 0) if body.logprobs else None,
                                          defaults=self.config.sampling_defaults)
        except ParamError as e:
            raise _renamed(e, names) from None
        await self._structured(body, params, tools)
        # harmony: the channel markers split the reply; a tool-call parser that reads special tokens needs them
        if self.chat_template.has_channels or (tools.mode == "auto" and self.tool_parser.needs_special_tokens):
            params.skip_special_tokens = False
        await self._validate_all([prompt], params, names)
        last = body.messages[-1]  # echo (vLLM's): a reply to an assistant's message starts with that message
        echo = last.as_template_input()["content"] if body.echo and last.role == "assistant" else ""
        thinks = params.structured is None  # a grammar's output has no reasoning in it
        return _ChatTurn(prompt, images, params, tools, thinks, echo)

    async def chat_completions(self, request: Request):
        body = await self._body(request, ChatCompletionRequest)
        turn = await self._chat_turn(body)
        prompt, images, params = turn.prompt, turn.images, turn.params
        tools, thinks, echo = turn.tools, turn.thinks, turn.echo
        base, created = self._request_id(request, body), int(time.time())
        rid, headers = f"chatcmpl-{base}", {"X-Request-Id": base}
        if body.stream:
            self._admissible(1)
            outputs = await self._started(self._stream(prompt, params, images), params)
            return StreamingResponse(self._stream_chat(body, outputs, rid, created, tools, echo, thinks),
                                     media_type="text/event-stream", headers=headers)
        (out,) = await self._until_done(request, [self._final(prompt, params, images)])
        choices = []
        for c in out.outputs:
            reply = self._reply(c.text, True, thinks)
            message, finish = {"role": self._reply_role(body), **reply}, c.finish_reason
            if "reasoning_content" in reply and not reply["content"]:
                message["content"] = None  # all thinking (vLLM's too)
            parser = self._calls_parser(tools)
            if parser is not None:
                content, calls = parser.split(self._tool_text(c.text, reply), True)
                message = {**message, "content": content or None}
                if calls:
                    message["tool_calls"] = [call.as_dict() for call in calls]
                finish = tools.finish_reason(finish, bool(calls))
            if echo:
                message["content"] = echo + (message["content"] or "")
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs) if body.logprobs else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
            if body.return_token_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        response = {"id": rid, "object": "chat.completion", "created": created, "model": self._model_name(),
                    "choices": choices, "usage": self._usage([out])}
        if body.return_token_ids:
            response["prompt_token_ids"] = list(out.prompt_token_ids)
        if body.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs(self._top(out, body.prompt_logprobs))
        return JSONResponse(response, headers=headers)

    @staticmethod
    def _reply_role(body) -> str:
        """vLLM's: the assistant's, or without a generation prompt the last message's (the output continues it)."""
        return "assistant" if body.add_generation_prompt else body.messages[-1].role

    def _reply(self, text: str, final: bool = True, thinks: bool = True) -> dict:
        """A chat reply's content and its reasoning_content where it has some: harmony's final and analysis
        channels, or what --reasoning-parser finds (unless the output is a grammar's, ``thinks`` False); while
        streaming, not ``final``, a marker's first characters held back."""
        if self.chat_template.has_channels:
            content, reasoning = split_harmony(text, final)
        elif self.reasoning is not None and thinks:
            reasoning, content = self.reasoning.split(text, final)
        else:
            return {"content": text}
        return {"content": content} if reasoning is None else {"content": content, "reasoning_content": reasoning}

    def _tool_text(self, text: str, reply: dict) -> str:
        """What the tool-call parser reads: harmony's whole reply (its calls are messages of their own), else the
        content after any reasoning."""
        return text if self.chat_template.has_channels else reply["content"]

    def _calls_parser(self, tools: ToolChoice) -> Optional[Parser]:
        """What finds one choice's tool calls (a fresh one per choice), None when the request has no tool calls."""
        if tools.mode == "named":
            return NamedCall(tools.name)
        if tools.mode == "required":
            return RequiredCalls()
        if tools.mode != "auto":
            return None
        return self.tool_parser if tools.parallel else FirstCall(self.tool_parser)

    def _chat_logprobs(self, token_ids, lps) -> dict:
        def entry(t, v):
            return {"token": self._logprob_token(t), "logprob": v, "bytes": list(self._token_bytes(t))}

        content = []
        for t, (v, alts) in zip(token_ids, lps or [], strict=False):
            item = entry(t, v)
            item["top_logprobs"] = [entry(a, w) for a, w in alts]
            content.append(item)
        return {"content": content}

    async def _stream_chat(self, body, outputs, rid, created, tools: ToolChoice, echo: str = "",
                           thinks: bool = True):
        name = self._model_name()
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        running_usage = include_usage and options.continuous_usage_stats
        sent_text: dict[int, dict] = {}  # per choice: how much of each reply field was sent
        sent_ids: dict[int, int] = {}
        calls: dict[int, ToolStream] = {}
        ended: set[int] = set()  # the choices whose finish_reason was sent: nothing follows it
        last, role = None, self._reply_role(body)

        def chunk(index, delta, logprobs=None, finish=None, ids=None, stop_reason=None):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": stop_reason}
            event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                     "choices": [choice]}
            if body.return_token_ids:  # vLLM's: the prompt's ids with the first chunk, each chunk's new ids
                if not sent_ids:  # the first chunk of all (a choice's role chunk is made before sent_ids has it)
                    event["prompt_token_ids"] = list(last.prompt_token_ids)
                if ids is not None:
                    choice["token_ids"] = list(ids)
            if running_usage:  # vLLM's continuous_usage_stats: this choice's counts so far (none in its role chunk)
                done = len(last.outputs[index].token_ids) if index < len(last.outputs) and "role" not in delta else 0
                event["usage"] = _counts(len(last.prompt_token_ids), done)
            return _sse(event)

        try:
            async for out in outputs:
                last = out
                for c in out.outputs:
                    if c.index in ended:
                        continue
                    if c.index not in sent_text:
                        first = chunk(c.index, {"role": role, "content": ""})  # before sent_ids has it: see chunk
                        sent_text[c.index], sent_ids[c.index] = {}, 0
                        parser = self._calls_parser(tools)
                        if parser is not None:
                            calls[c.index] = ToolStream(parser)
                        yield first
                        if echo:
                            yield chunk(c.index, {"content": echo})
                    sent, finish = sent_text[c.index], c.finish_reason
                    reply = self._reply(c.text, finish is not None, thinks)
                    tool_text = self._tool_text(c.text, reply)
                    if c.index in calls:  # the parser splits text from calls; the reasoning stays beside
                        reply.pop("content")
                    delta = {k: v[sent.get(k, 0):] for k, v in reply.items() if v[sent.get(k, 0):]}
                    if c.index in calls:
                        stream = calls[c.index]
                        content, deltas = stream.update(tool_text, finish is not None)
                        if content:
                            delta["content"] = content
                        if deltas:
                            delta["tool_calls"] = deltas
                        finish = tools.finish_reason(finish, stream.called)
                    new_ids = c.token_ids[sent_ids[c.index]:]
                    lps = None
                    if body.logprobs and new_ids:
                        lps = self._chat_logprobs(new_ids, (c.logprobs or [])[sent_ids[c.index]:])
                    if delta or lps or (new_ids and body.return_token_ids):
                        yield chunk(c.index, delta or {"content": ""}, lps, None, new_ids)
                    if finish is not None and finish != "abort":
                        ended.add(c.index)
                        yield chunk(c.index, {}, None, finish, None, c.stop_reason if finish == "stop" else None)
                    sent.update((k, len(v)) for k, v in reply.items())
                    sent_ids[c.index] = len(c.token_ids)
            if include_usage and last is not None:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": self._usage([last])})
        except APIError as e:
            yield _sse(error_body(e.message, e.type, e.param, e.code))
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------------------------------------------- responses

    async def responses(self, request: Request):
        """OpenAI's Responses API on the chat path (megapipe.inference.responses)."""
        body = await self._body(request, ResponsesRequest)
        try:
            chat = body.chat_request()
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValidationError as e:
            param, message = _param_from(e)
            raise APIError(400, message, param=RESPONSES_NAMES.get(param, param)) from None
        try:
            turn = await self._chat_turn(chat, {"max_tokens": "max_output_tokens"})
        except APIError as e:  # under the Responses request's own names
            e.param = RESPONSES_NAMES.get((e.param or "").split(".")[0], e.param)
            raise
        base = self._request_id(request, body)
        build = ResponseBuilder(body, self._model_name(), f"resp_{base}", turn.params)
        headers = {"X-Request-Id": base}
        parser = self._calls_parser(turn.tools)
        calls = ToolStream(parser) if parser is not None else None
        if body.stream:
            self._admissible(1)
            outputs = await self._started(self._stream(turn.prompt, turn.params, turn.images), turn.params)
            return StreamingResponse(self._stream_response(build, outputs, turn, calls),
                                     media_type="text/event-stream", headers=headers)
        (out,) = await self._until_done(request, [self._final(turn.prompt, turn.params, turn.images)])
        self._response_events(build, out, turn, calls)
        return JSONResponse(build.response, headers=headers)

    def _response_events(self, build: ResponseBuilder, out: RequestOutput, turn: _ChatTurn,
                         calls: Optional[ToolStream]) -> list[dict]:
        """The events one output of the engine makes (the last ones with the response whole when it finished);
        ``calls``: the response's tool-call stream (None without tool calls)."""
        c = out.outputs[0]
        final = c.finish_reason is not None
        parts = self._reply(c.text, final, turn.thinks)
        reasoning, content, deltas = parts.get("reasoning_content") or "", parts["content"], []
        if calls is not None:
            deltas = calls.update(self._tool_text(c.text, parts), final)[1]
            content = calls.content
        events = build.update(reasoning, content, deltas)
        if final:
            thought = self._reasoning_tokens(c.token_ids, reasoning, turn)
            n, cached, info = len(out.prompt_token_ids), out.num_cached_tokens, self.engine.cache_info
            block = int(info.get("block_size", 0)) if info.get("enable_prefix_caching") == "True" else 0
            written = max(0, n // block * block - cached) if block else 0  # the prompt's full blocks, now cached
            events += build.finish(c.finish_reason, usage_of(n, out.num_generated_tokens, cached, thought, written))
        return events

    def _reasoning_tokens(self, ids, reasoning: str, turn: _ChatTurn) -> int:
        """How many of an output's tokens its reasoning took: the fewest whose text holds all of it (its split while
        streaming, so a marker's first characters do not count as reasoning)."""
        if not reasoning:
            return 0
        skip = special_ids(self.tokenizer) if turn.params.skip_special_tokens else frozenset()

        def reasoning_of(k: int) -> str:
            text = self.tokenizer.decode([t for t in ids[:k] if t not in skip])
            return self._reply(text, False, turn.thinks).get("reasoning_content") or ""

        lo, hi = 1, len(ids)
        while lo < hi:  # what a prefix's split calls reasoning only grows with the prefix
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if len(reasoning_of(mid)) >= len(reasoning) else (mid + 1, hi)
        return lo

    async def _stream_response(self, build: ResponseBuilder, outputs, turn: _ChatTurn,
                               calls: Optional[ToolStream]):
        def sse(event: dict) -> str:  # the event's type on its own line too, as OpenAI and vLLM send it
            return f"event: {event['type']}\n{_sse(event)}"

        for event in build.start():
            yield sse(event)
        try:
            async for out in outputs:
                for event in self._response_events(build, out, turn, calls):
                    yield sse(event)
        except APIError as e:
            yield sse(build.error(e.message, e.code or e.type, e.param))



def make_app(engine: StreamingEngine, config: ServerConfig, on_ready=None) -> FastAPI:
    return OpenAIServer(engine, config, on_ready).app


def bind(host: str, port: int):
    """A listening socket on host:port (port 0: any free one), or one sentence on why not."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MegapipeError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(engine: StreamingEngine, config: ServerConfig, sock, log_level: str = "warning", on_ready=None) -> None:
    """Serve on ``sock`` until SIGTERM / SIGINT, then drain (up to config.shutdown_timeout) and stop the engine."""
    serve_app(make_app(engine, config, on_ready), config, sock, log_level, engine.shutdown,
              lambda: end_in_flight(engine, config))


def end_in_flight(engine: StreamingEngine, config: ServerConfig) -> None:
    """The drain time is running out: end the requests still in flight with a 503 ``shutting_down``."""
    ended = engine.end_all(ShuttingDown(
        f"the server shut down before this request finished (--shutdown-timeout {config.shutdown_timeout:g} s)"))
    if ended:
        log.warning("the drain time ran out: %d request(s) still in flight end with a 503", ended)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose drain ends in answers: ``out_of_time()`` runs shortly before the graceful-shutdown
    timeout, so the requests still in flight can be answered (a 503, or an error event and [DONE] on a stream)
    rather than cancelled mid-response by uvicorn, each with a traceback and a cut-off or empty reply."""

    def __init__(self, config: uvicorn.Config, out_of_time: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.out_of_time = out_of_time

    async def shutdown(self, sockets=None) -> None:
        timeout, timer = self.config.timeout_graceful_shutdown, None
        if self.out_of_time is not None and timeout is not None:
            answer_by = timeout - min(1.0, timeout / 4)  # time left to write the answers
            timer = asyncio.get_running_loop().call_later(answer_by, self.out_of_time)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def serve_app(app: FastAPI, config: ServerConfig, sock, log_level: str, on_stop,
              out_of_time: Optional[Callable[[], None]] = None) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM / SIGINT, drain (up to config.shutdown_timeout; ``out_of_time()``
    ends the requests still running just before it), then ``on_stop()``."""
    uv = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                        timeout_graceful_shutdown=config.shutdown_timeout)
    server = DrainingServer(uv, out_of_time)
    # uvicorn re-raises the stop signal once it has drained; with these handlers restored that ends in exit 0
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        on_stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
