"""Request bodies that once gave HTTP 500, sent to every POST route: each is a 400 with a sentence (or a 503 for
more prompts than the queue takes), and the server keeps answering."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.inference.test_server import KEY, NAME

AUTH = {"Authorization": f"Bearer {KEY}"}
# each route's text field, where a request's strings reach the tokenizer
ROUTES = {"/v1/completions": '{"model": "%s", "prompt": %s}',
          "/v1/chat/completions": '{"model": "%s", "messages": [{"role": "user", "content": %s}]}',
          "/tokenize": '{"model": "%s", "prompt": %s}',
          "/detokenize": '{"model": "%s", "tokens": %s}'}


def bad_bodies() -> dict[str, list[tuple[str, bytes]]]:
    """route -> (what, body) of each bad body for it; the lone surrogate in the model name and in the text field."""
    out = {}
    for route, shape in ROUTES.items():
        bodies = [(f"nested {depth}", (shape % (NAME, "[" * depth + "]" * depth)).encode())
                  for depth in (200, 600, 990, 5000, 30_000)]  # under the 64 KiB body limit
        bodies.append(("nested objects", b'{"model": "tiny", "x": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001))
        bodies.append(("surrogate text", (shape % (NAME, '"abc\\ud800"')).encode()))
        bodies.append(("surrogate model", (shape % ("\\udfff", '"abc"')).encode()))
        out[route] = bodies
    return out


@pytest.mark.parametrize("route", list(ROUTES))
def test_bad_bodies_are_400_on_every_route(live, route):
    for what, body in bad_bodies()[route]:
        r = httpx.post(live.url + route, content=body, headers=AUTH | {"Content-Type": "application/json"})
        assert r.status_code == 400, (route, what, r.status_code, r.text[:200])
        message = r.json()["error"]["message"]
        if what.startswith("surrogate"):
            assert "lone UTF-16 surrogate" in message, (route, what, message)
        elif what != "nested 200":  # a shallow nest is simply the wrong type for the field
            assert "nested too deeply" in message, (route, what, message)
    assert httpx.post(live.url + "/tokenize", json={"prompt": "still here"}, headers=AUTH).status_code == 200


def test_more_prompts_than_the_queue_takes_is_400_naming_the_limit(live):
    r = httpx.post(live.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": NAME, "prompt": ["The quick"] * 3000, "max_tokens": 4})
    assert r.status_code == 400, r.text[:300]
    assert "3000 prompts; this server queues at most 256 requests (--max-queue)" in r.json()["error"]["message"]
    assert not live.engine.has_unfinished()


def _sleeper(cancelled: list):
    """A coroutine function that sleeps 30 s and notes in ``cancelled`` that it was cancelled."""
    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    return slow


def test_one_failing_prompt_fails_the_request_with_its_own_error():
    """A multi-prompt completion whose one prompt is refused (a full queue, a dead engine) answers with that error and
    cancels the others (their requests aborted), not asyncio's InvalidStateError from a result still pending."""
    from types import SimpleNamespace

    from megapipe.inference.server import APIError, OpenAIServer, ServerConfig

    cancelled = []
    slow = _sleeper(cancelled)

    async def refused():
        raise APIError(503, "the server's queue is full", "server_error", code="queue_full")

    server = SimpleNamespace(config=ServerConfig(NAME, disconnect_poll_s=0.01))
    with pytest.raises(APIError, match="queue is full"):
        asyncio.run(OpenAIServer._until_done(server, None, [slow(), refused(), slow()]))
    assert cancelled == [True, True]


def test_a_client_that_left_ends_its_request_quietly():
    """A whole (not streamed) response whose client disconnected: its tasks are cancelled (requests aborted) and the
    route ends in an APIError the handler answers to nobody, not in an exception uvicorn logs with a traceback."""
    from types import SimpleNamespace

    from megapipe.inference.server import APIError, OpenAIServer, ServerConfig

    cancelled = []
    slow = _sleeper(cancelled)

    async def gone():
        return True

    server = SimpleNamespace(config=ServerConfig(NAME, disconnect_poll_s=0.01))
    with pytest.raises(APIError) as e:
        asyncio.run(OpenAIServer._until_done(server, SimpleNamespace(is_disconnected=gone), [slow()]))
    assert e.value.status == 499 and e.value.code == "client_closed" and cancelled == [True]
