"""``megapipe serve`` on a reward model (``posttrain rm``): vLLM's ``/pooling`` route, one scalar reward per input.

Why ``/pooling`` and not ``/score``: vLLM's ``/score`` is the cross-encoder API (``text_1`` against ``text_2``,
for rerankers); a reward model is served by vLLM through ``/pooling`` (its reward task), which takes the inputs
whole and returns each one's pooled output. The request: ``{"model", "input": str | [str] | [int] | [[int]]}``
(text tokenised as is, token ids scored as given) or ``{"model", "messages": [...]}`` (a conversation ending with
the assistant's answer, rendered as the reward model's training pairs were). The response, vLLM's:
``{"id", "object": "list", "created", "model", "data": [{"index", "object": "pooling", "data": [reward]}],
"usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0}}``. Also /health, /version and /v1/models;
the generation routes answer 404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import Response

from megapipe.data.chat_template import ChatTemplateError
from megapipe.errors import DataError
from megapipe.inference.protocol import ChatMessage, _Body
from megapipe.inference.sampling import ParamError
from megapipe.inference.server import APIError, OpenAIServer, ServerConfig, serve_app


class PoolingRequest(_Body):
    model: Optional[str] = None
    input: Optional[Union[str, list[str], list[int], list[list[int]]]] = None
    messages: Optional[list[ChatMessage]] = None


class PoolingServer(OpenAIServer):
    """``scorer``: megapipe.posttrain.reward_model.RewardModel."""

    def __init__(self, scorer, config: ServerConfig, on_ready=None):
        self.scorer, self.config, self.on_ready = scorer, config, on_ready
        self.loras: dict[str, str] = {}  # no adapters on a reward model
        self.tokenizer = scorer.tokenizer
        self.max_model_len = scorer.model.cfg.max_position_embeddings
        self.created = int(time.time())
        self.lock = asyncio.Lock()
        self.app = self._build()

    def _routes(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/version")(self.version)
        app.get("/v1/models")(self.models)
        app.post("/pooling")(self.pooling)

    async def health(self):
        return Response(status_code=200)

    def _sequences(self, body: PoolingRequest) -> list[list[int]]:
        if (body.input is None) == (body.messages is None):
            raise APIError(400, "give exactly one of input or messages", param="input")
        if body.messages is not None:
            try:
                return [self.scorer.encode_messages([m.as_template_input() for m in body.messages]).tolist()]
            except (ChatTemplateError, DataError) as e:
                raise APIError(400, str(e), param="messages") from None
            except ParamError as e:
                raise APIError(400, str(e), param=e.param) from None
        items = body.input
        if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
            items = [items]
        if not items:
            raise APIError(400, "input is empty", param="input")
        seqs = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in items]
        vocab = self.scorer.model.cfg.vocab_size
        for i, s in enumerate(seqs):
            if not s:
                raise APIError(400, f"input {i} has no token", param="input")
            if len(s) > self.max_model_len:
                raise APIError(400, f"input {i} has {len(s)} tokens, more than the model's {self.max_model_len}",
                               param="input")
            bad = next((t for t in s if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"input {i}: token id {bad} is outside the vocabulary [0, {vocab})",
                               param="input")
        return seqs

    async def pooling(self, request: Request):
        body = await self._body(request, PoolingRequest)
        self._check_model(body.model)
        seqs = self._sequences(body)
        async with self.lock:  # one forward at a time, off the event loop
            scores = await asyncio.to_thread(self.scorer.score_ids, seqs)
        tokens = sum(map(len, seqs))
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.config.model_name,
                "data": [{"index": i, "object": "pooling", "data": [s]} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def run_pooling_server(scorer, config: ServerConfig, sock, log_level: str = "warning", on_ready=None) -> None:
    serve_app(PoolingServer(scorer, config, on_ready).app, config, sock, log_level, lambda: None)
