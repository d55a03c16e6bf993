"""megapipe serve through the official ``openai`` client against a real uvicorn server on a free localhost port:
every route, streaming, chat, each error status, the API key, disconnect aborts; SIGTERM drain in a subprocess."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.async_engine import AsyncEngine
from megapipe.inference.core_client import EngineCoreClient
from megapipe.inference.engine import EngineConfig
from megapipe.inference.engine_core import CoreSpec
from megapipe.inference.server import DrainingServer, ServerConfig, bind, end_in_flight, make_app

KEY = "sk-test-key"
NAME = "tiny"


class LiveServer:
    """uvicorn in a thread of this process, on a socket bound to a free port; the engine in a thread of this process,
    or (``engine_process``) in an engine-core process as serve runs it (then ``engine`` is the front end's client)."""

    def __init__(self, model_dir: Path, max_queue=256, body=64 * 1024, server_config=None, engine_process=False,
                 device="cpu", **engine_config):
        import uvicorn

        self.engine_process = engine_process
        if engine_process:
            spec = CoreSpec(str(model_dir), EngineConfig(**engine_config), device=device)
            self.engine = self.async_engine = EngineCoreClient(spec, max_queue)
        else:
            self.engine = LLMEngine.from_pretrained(model_dir, device=device, **engine_config)
            self.async_engine = AsyncEngine(self.engine, max_queue)
        config = ServerConfig(NAME, str(model_dir), api_key=KEY, max_queue=max_queue, max_body_bytes=body,
                              shutdown_timeout=5, **(server_config or {}))
        self.sock = bind("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.async_engine, config), log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def client(self, key=KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.async_engine.shutdown()


@pytest.fixture(scope="module")
def reference(hf_llama):
    """A second, synchronous engine on the same model: what the server must answer."""
    return LLMEngine.from_pretrained(hf_llama[0], device="cpu")


def test_models_health_version_tokenize(live):
    c = live.client()
    models = c.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == 128
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(live.url + "/health").status_code == 200  # no key needed
    assert httpx.get(live.url + "/ping").status_code == 200 and httpx.post(live.url + "/ping").status_code == 200
    assert httpx.get(live.url + "/version", headers=auth).json()["version"]
    toks = httpx.post(live.url + "/tokenize", json={"prompt": "The quick brown fox"}, headers=auth).json()
    assert toks["tokens"] == live.engine.tokenizer.encode("The quick brown fox") and toks["count"] == len(toks["tokens"])
    back = httpx.post(live.url + "/detokenize", json={"tokens": toks["tokens"]}, headers=auth).json()
    assert back == {"prompt": "The quick brown fox"}
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=auth).json()
    assert live.engine.tokenizer.decode(chat["tokens"]) == "user: hi\nassistant:"


def test_completions_match_the_engine(live, reference):
    c = live.client()
    prompts = ["The quick brown", "A stitch in"]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate(prompts, greedy)]
    r = c.completions.create(model=NAME, prompt=prompts, max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True})
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == want
    assert r.object == "text_completion" and r.usage.completion_tokens == 20
    assert r.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)
    ids = reference.tokenizer.encode(prompts[0])
    by_ids = c.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want[0]
    echo = c.completions.create(model=NAME, prompt=prompts[0], max_tokens=10, temperature=0, echo=True, logprobs=2,
                                extra_body={"ignore_eos": True})
    ch = echo.choices[0]
    assert ch.text == prompts[0] + want[0]
    assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == len(ids) + 10
    lp = ch.logprobs  # the top 2 and the token itself (OpenAI's and vLLM's: up to logprobs + 1)
    assert all(len(t) <= 3 and t[tok] == v for t, tok, v in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                  lp.token_logprobs[1:], strict=True))
    seeded = dict(model=NAME, prompt=prompts[0], max_tokens=12, temperature=1.0, n=3, seed=5)
    a, b = c.completions.create(**seeded), c.completions.create(**seeded)
    assert [x.text for x in a.choices] == [x.text for x in b.choices] and len({x.index for x in a.choices}) == 3


def test_echo_scoring_with_max_tokens_zero(live, reference):
    """What evaluation harnesses send to score a text: echo + logprobs + max_tokens 0 -> the prompt's logprobs."""
    c = live.client()
    text = "The quick brown fox jumps"
    r = c.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch = r.choices[0]
    ref = reference.generate([text], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert ch.text == text and r.usage.completion_tokens == 0
    assert ch.logprobs.token_logprobs[1:] == pytest.approx([lp for lp, *_ in ref.prompt_logprobs[1:]], abs=1e-5)


def test_streaming_completions_and_usage(live, reference):
    c = live.client()
    want = reference.generate(["The quick brown"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    chunks = list(c.completions.create(model=NAME, prompt="The quick brown", max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == want.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # a stop string: streamed text never shows a part of it, and ends where the non-streamed one does
    stop = want.outputs[0].text[5:8]
    plain = c.completions.create(model=NAME, prompt="The quick brown", max_tokens=16, temperature=0, stop=[stop])
    events = list(c.completions.create(model=NAME, prompt="The quick brown", max_tokens=16, temperature=0,
                                       stop=[stop], stream=True))
    streamed = "".join(ch.choices[0].text for ch in events)
    assert streamed == plain.choices[0].text == want.outputs[0].text[:want.outputs[0].text.find(stop)]
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].stop_reason == stop
    # vLLM's stop_reason on every chunk: the stop string on the last, null before
    assert [ch.choices[0].stop_reason for ch in events] == [None] * (len(events) - 1) + [stop]
    chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    stop = c.chat.completions.create(**chat).choices[0].message.content[4:7]
    events = list(c.chat.completions.create(**chat, stop=[stop], stream=True))
    assert [(ch.choices[0].finish_reason, ch.choices[0].model_extra["stop_reason"]) for ch in events][-1] == (
        "stop", stop)
    assert all(ch.choices[0].model_extra["stop_reason"] is None for ch in events[:-1])


def test_chat_multi_turn_and_streaming(live, reference):
    c = live.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": [{"type": "text",
                                                                                               "text": "Again?"}]}]
    rendered = "system: Be brief.\nuser: Hello\nassistant: Hi there.\nuser: Again?\nassistant:"
    want = reference.generate([rendered], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == want.outputs[0].text
    assert len(ch.logprobs.content) == 12 and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode(rendered))
    stream = list(c.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(s.choices[0].delta.content or "" for s in stream if s.choices) == want.outputs[0].text
    assert [s.choices[0].finish_reason for s in stream if s.choices][-1] == "length"
    assert stream[-1].usage.completion_tokens == 12


def test_error_statuses_have_openai_shape(live):
    c = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt="x", max_tokens=5, top_p=1.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt="x", max_tokens=5, n="two")
    assert e.value.body["param"] == "n"
    long = c.completions.create(model=NAME, prompt=[5] * 100, max_tokens=128, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 28 and long.choices[0].finish_reason == "length"  # cut to the context's room
    with pytest.raises(openai.BadRequestError, match="max_tokens = 129 cannot be greater than this model's maximum "
                                                     "context length, 128 tokens") as e:
        c.completions.create(model=NAME, prompt="x", max_tokens=129)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128 tokens. However, your request "
                                                     "has 128 input tokens") as e:
        c.completions.create(model=NAME, prompt=[5] * 128, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        live.client(key="wrong").completions.create(model=NAME, prompt="x")
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(live.url + "/v1/nope", headers=auth)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": "x" * 100_000}, headers=auth)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": NAME, "messages": []}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(live.url + "/v1/completions", json={"model": NAME, "prompt": [1, 10**7]}, headers=auth)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_api_key_guards_every_route_but_health(live):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/v1/responses"),
                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/metrics")):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            r = httpx.request(method, live.url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(live.url + "/health").status_code == 200
    # the scheme is case-insensitive (RFC 7235); another scheme is refused for what it is
    for scheme in ("bearer", "BEARER", "BeArEr"):
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    r = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401 and "scheme is 'Basic', not Bearer" in r.json()["error"]["message"]


def test_completions_max_tokens_null_is_the_default_16(live):
    """OpenAI's completions default, also when the field is sent as null (the openai client's max_tokens=None),
    not the rest of the context; chat's null stays unlimited, as in OpenAI and vLLM."""
    for body in ({"max_tokens": None}, {}):
        r = httpx.post(live.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": NAME, "prompt": "The", "temperature": 0, "ignore_eos": True, **body})
        assert r.json()["usage"]["completion_tokens"] == 16, body


def test_metrics_use_vllm_names_and_count(live, reference):
    counted = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_params_n_sum",
               "vllm:request_params_max_tokens_sum", "vllm:request_time_per_output_token_seconds_count",
               "vllm:iteration_tokens_total_sum", "vllm:request_prefill_kv_computed_tokens_sum",
               "vllm:request_num_preemptions_count", "vllm:request_num_preemptions_sum",
               "vllm:request_max_num_generation_tokens_sum",
               *(f"vllm:request_{phase}_time_seconds_count" for phase in ("queue", "prefill", "decode", "inference")))
    before = {name: live.metric(name) for name in counted}
    live.client().completions.create(model=NAME, prompt="The quick", max_tokens=7, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    prompt = len(reference.tokenizer.encode("The quick"))
    added = {name: live.metric(name) - before[name] for name in counted}
    # n = 2 computes the prompt for each sequence (a prompt under a block shares no cached block), as vLLM's two
    # child requests count it twice
    assert added == {"vllm:generation_tokens_total": 14, "vllm:prompt_tokens_total": 2 * prompt,
                     "vllm:request_params_n_sum": 2, "vllm:request_params_max_tokens_sum": 7,
                     "vllm:request_time_per_output_token_seconds_count": 1,
                     "vllm:iteration_tokens_total_sum": 2 * prompt + 12,  # the prompts, then 6 decodes of 2
                     "vllm:request_prefill_kv_computed_tokens_sum": prompt, "vllm:request_num_preemptions_count": 1,
                     "vllm:request_num_preemptions_sum": 0, "vllm:request_max_num_generation_tokens_sum": 7,
                     **{f"vllm:request_{phase}_time_seconds_count": 1
                        for phase in ("queue", "prefill", "decode", "inference")}}, added
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert live.metric(name) == live.metric(name), name  # present (not NaN)
    assert live.metric("vllm:time_to_first_token_seconds_count") >= 1
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for reason in ("capacity", "deferred"):
        assert f'vllm:num_requests_waiting_by_reason{{model_name="{NAME}",reason="{reason}"}} 0.0' in text
    info = dict(re.findall(r'(\w+)="([^"]*)"', re.search(r"^vllm:cache_config_info\{(.*)\} 1\.0$", text, re.M)[1]))
    assert set(info) == {"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                         "num_gpu_blocks", "num_gpu_blocks_override", "num_cpu_blocks", "engine"}
    assert (info["cache_dtype"], info["enable_prefix_caching"]) == ("auto", "True")
    assert int(info["block_size"]) * int(info["num_gpu_blocks"]) >= live.client().models.list().data[0].max_model_len
    by_source = {m[0]: float(m[1]) for m in re.findall(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"\} '
                                                       r'(\S+)$', text, re.M)}
    assert sum(by_source.values()) == live.metric("vllm:prompt_tokens_total") and by_source["local_compute"] > 0
    assert by_source["local_cache_hit"] == live.metric("vllm:prefix_cache_hits_total")


def test_max_tokens_metric_is_what_is_in_force(live):
    """vllm:request_params_max_tokens observes the max_tokens a request ran under, as vLLM's: a chat without one
    the context's room after its prompt."""
    before = live.metric("vllm:request_params_max_tokens_sum")
    r = live.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                              temperature=0)
    room = live.client().models.list().data[0].max_model_len - r.usage.prompt_tokens
    assert live.metric("vllm:request_params_max_tokens_sum") - before == room


def test_prompt_token_counters_count_each_prompt_once_as_vllm_does(tiny_engine_factory):
    """vllm:prompt_tokens counts each prompt once, its prefix-cache hits included (vllm:prompt_tokens_cached counts
    those alone) and its recomputation after a preemption not; the engine's own prompt_tokens are what it computed."""
    from megapipe.inference.metrics import ServerMetrics

    engine = tiny_engine_factory(block_size=16, num_blocks=7, max_num_seqs=2, max_model_len=96)
    registry = ServerMetrics(engine.stats, "m", engine.max_model_len).registry

    def value(name):
        return registry.get_sample_value(name, {"model_name": "m"})

    prompt = list(range(5, 45))  # 40 tokens: two full blocks and a part
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # 32 of them cached
    assert (value("vllm:prompt_tokens_total"), value("vllm:prompt_tokens_cached_total")) == (80, 32)
    assert engine.stats()["prompt_tokens"] == 48
    # two at once outgrow the 7 blocks: one is preempted and its prompt computed again, counted once
    outs = engine.generate([list(range(100, 140)), list(range(200, 240))],
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert engine.stats()["preemptions"] > 0 and engine.stats()["prompt_tokens"] > 48 + 80
    # each request's own count (vllm:request_num_preemptions)
    assert sum(o.metrics["num_preemptions"] for o in outs) == engine.stats()["preemptions"]
    assert value("vllm:prompt_tokens_total") == 160


def test_dropped_streams_abort_and_free_their_blocks(live, tmp_path):
    """100 streams of up to 1000 tokens dropped after their first chunk: all are aborted, the engine empties, a
    fresh request completes promptly. On a model of 1100 positions of its own: the tiny model runs 100 tokens of
    100 streams in a fraction of a second, which a client starved by a busy machine can take to leave."""
    from tests.helpers.hf_tiny import make_hf_dir

    server = LiveServer(make_hf_dir(tmp_path / "long", "llama", max_position_embeddings=1100)[0],
                        engine_process=live.engine_process)
    try:
        _drop_streams(server, streams=100, max_tokens=1000)
    finally:
        server.stop()


def _drop_streams(live, streams: int, max_tokens: int) -> None:
    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 1.0}
    ended_before = _ended_counts(live)

    async def drop_one(client: httpx.AsyncClient):
        async with client.stream("POST", live.url + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return json.loads(line[6:])  # leave mid-stream: the connection is closed

    async def main():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*[drop_one(client) for _ in range(streams)])

    firsts = asyncio.run(main())
    assert len(firsts) == streams
    deadline = time.time() + 15
    while time.time() < deadline and _busy(live.async_engine.stats()):
        time.sleep(0.05)
    assert not _busy(live.async_engine.stats())
    assert live.metric("vllm:kv_cache_usage_perc") == 0 and live.metric("vllm:num_requests_running") == 0
    # the core's stats arrive before the outputs of the same step reach the metrics: wait until all are counted
    while time.time() < deadline and sum(_ended_counts(live).values()) - sum(ended_before.values()) < streams:
        time.sleep(0.05)
    ended = {k: v - ended_before.get(k, 0.0) for k, v in _ended_counts(live).items() if v != ended_before.get(k)}
    assert ended == {"abort": streams}, ended
    start = time.time()
    r = live.client().completions.create(model=NAME, prompt="fresh", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and time.time() - start < 10


def _busy(stats: dict) -> bool:
    return bool(stats["running"] or stats["waiting"] or stats["kv_cache_usage"])


def _ended_counts(live) -> dict[str, float]:
    """vllm:request_success_total by finished_reason (stop, length and abort are there from the start, at 0)."""
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    found = dict(re.findall(r'^vllm:request_success_total{[^}]*finished_reason="(\w+)"[^}]*} (\S+)$', text, re.M))
    assert {"stop", "length", "abort"} <= set(found), found
    return {reason: float(count) for reason, count in found.items() if float(count)}


def test_a_sample_a_stop_string_ends_stops_decoding(live, reference):
    """n = 2 where a stop string ends sample 0 within its first tokens and sample 1 runs 100: the engine stops
    decoding sample 0 at once (a few tokens late at most through an engine core process, whose front end matches stop
    strings and aborts that sample alone; its blocks are freed while sample 1 runs), and the outputs equal the
    engine's."""
    params = SamplingParams(max_tokens=100, temperature=1.0, seed=11, n=2, ignore_eos=True)
    a, b = reference.generate(["Hello"], replace(params))[0].outputs
    early = live.engine.tokenizer.decode(a.token_ids[:4])
    stop = next(early[i:i + k] for k in range(2, len(early) + 1) for i in range(len(early) - k + 1)
                if early[i:i + k].strip() and early[i:i + k] not in b.text)
    params.stop = [stop]
    (want,) = reference.generate(["Hello"], replace(params))
    kept = len(want.outputs[0].token_ids)
    assert want.outputs[0].finish_reason == "stop" and kept <= 4 and want.outputs[1].finish_reason == "length"

    async def stream():
        before, running = live.async_engine.stats().get("generation_tokens", 0), []
        async for out in live.async_engine.generate("Hello", replace(params)):
            if out.outputs[0].finish_reason is not None and not out.finished:
                running.append(live.async_engine.stats()["running"])
        return out, live.async_engine.stats().get("generation_tokens", 0) - before, running

    got, decoded, running = asyncio.run(stream())
    assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got.outputs] == [
        (c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in want.outputs]
    assert got.num_generated_tokens == want.num_generated_tokens == 100 + kept
    late = decoded - (100 + kept)  # sample 0's tokens the engine decoded past its stop string (100 - kept if never cut)
    assert 0 <= late <= 20, (decoded, kept)
    # sample 1 ran alone once sample 0's sequence finished (not necessarily at its last output: through a core
    # process the stats can already say 0 there, the core having finished sample 1 before the front end read it)
    assert 1 in running, running


def test_full_queue_is_503(hf_llama):
    server = LiveServer(hf_llama[0], max_queue=1, max_num_seqs=1)
    try:
        c = server.client()
        errors, results = [], []

        def one():
            try:
                results.append(c.completions.create(model=NAME, prompt="The", max_tokens=100, temperature=0,
                                                    extra_body={"ignore_eos": True}))
            except openai.APIStatusError as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors and all(e.status_code == 503 for e in errors)
        assert errors[0].body["code"] == "queue_full" and results
        rejected = server.metric("vllm:admission_rejections_total")  # reason max_num_queued_reqs, the first series
        assert rejected >= len(errors)
        # a stream is refused the same way, before its 200: the queue is as full as it is (one waiting)
        server.async_engine.num_waiting = lambda: 1
        for body in ({"prompt": "The"}, {"prompt": ["a"]}):
            r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": NAME, "max_tokens": 2, "stream": True, **body})
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert server.metric("vllm:admission_rejections_total") == rejected + 2
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------- CLI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests_and_exits_0(hf_llama, tmp_path):
    port = free_port()
    env = dict(os.environ, MEGAPIPE_API_KEY=KEY, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "megapipe.cli", "serve", str(hf_llama[0]), "--port", str(port),
                             "--served-model-name", NAME, "--shutdown-timeout", "20",
                             "--device", "cpu", "--gpu-memory-utilization", "0.8"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line, lines = "", []
        deadline = time.time() + 300  # a loaded CI machine can take long to import torch and load
        while "ready on" not in line and time.time() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
            lines.append(line)
        assert "ready on http://127.0.0.1:%d" % port in line
        # a vLLM GPU flag on this CPU: said, not refused (vLLM's CPU backend ignores it too)
        assert any("--gpu-memory-utilization does not apply on a CPU" in x for x in lines), lines
        core = int(re.search(r"engine core pid (\d+)", line).group(1))  # serve's default: the engine in a process
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        stream = c.completions.create(model=NAME, prompt="The", max_tokens=120, temperature=1.0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the in-flight request still finishes
        chunks = [first] + rest
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 120
        assert proc.wait(120) == 0
        with pytest.raises(ProcessLookupError):  # the engine core stopped with it
            os.kill(core, 0)
        with pytest.raises(httpx.ConnectError):  # nothing listens any more
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_requests_still_running_when_the_drain_time_runs_out_are_answered(hf_llama):
    """A stop whose drain time runs out answers what is still running just before the deadline: a stream gets an
    error event with code shutting_down and [DONE], a whole response a 503, their requests are aborted, and uvicorn
    has nothing left to cancel (which would cut the stream off and give the whole request no answer)."""
    import uvicorn

    engine = LLMEngine.from_pretrained(hf_llama[0], device="cpu")
    step = engine.step
    engine.step = lambda: (time.sleep(0.05), step())[1]  # 100 tokens take 5 s: far past the drain time
    async_engine = AsyncEngine(engine, 16)
    config = ServerConfig(NAME, str(hf_llama[0]), api_key=KEY, shutdown_timeout=1.0)
    sock = bind("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    server = DrainingServer(uvicorn.Config(make_app(async_engine, config), log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=config.shutdown_timeout),
                            lambda: end_in_flight(async_engine, config))
    cancelled = []
    watch = logging.Handler()
    watch.emit = lambda record: cancelled.append(record.getMessage()) if "Cancel" in record.getMessage() else None
    logging.getLogger("uvicorn.error").addHandler(watch)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        body = {"model": NAME, "prompt": "The", "max_tokens": 100, "ignore_eos": True}
        errors = []

        def whole():
            try:
                openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(
                    **{k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                errors.append(e)

        waiter = threading.Thread(target=whole)
        waiter.start()
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            while async_engine.stats()["running"] < 2:
                time.sleep(0.02)
            server.should_exit, stopped = True, time.time()
            events += [line for line in lines if line.startswith("data: ")]
        waiter.join(30)
        thread.join(30)
        assert not thread.is_alive() and time.time() - stopped < 3
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "shutting_down" and "--shutdown-timeout 1 s" in error["message"], error
        assert 2 < len(events) < 40  # tokens streamed until the deadline, then the error
        assert [e.status_code for e in errors] == [503] and errors[0].body["code"] == "shutting_down"
        assert cancelled == []
        deadline = time.time() + 10  # both requests were aborted: their sequences and blocks are gone
        while async_engine.stats()["running"] and time.time() < deadline:
            time.sleep(0.02)
        assert async_engine.stats()["running"] == 0 and not engine.has_unfinished()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(watch)
        server.should_exit = True
        thread.join(10)
        async_engine.shutdown()


def test_sigterm_while_loading_stops_the_engine_core_too(hf_llama):
    """SIGTERM before the server is ready: it exits 0 at once, and the engine core (still loading) does not outlive
    it to print a broken-pipe traceback later."""
    env = dict(os.environ, MEGAPIPE_API_KEY=KEY, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "megapipe.cli", "serve", str(hf_llama[0]), "--port", "0"],
                            stderr=subprocess.PIPE, text=True, env=env)

    def children() -> list[int]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == proc.pid:
                found.append(int(stat.parent.name))
        return found

    try:
        deadline = time.time() + 120
        while not children() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        cores = children()
        assert cores, "no engine core process started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "stopped by SIGTERM while starting" in err and "Traceback" not in err, err
        deadline = time.time() + 10  # (multiprocessing's resource tracker, a child too, leaves on its own)
        while any(Path(f"/proc/{pid}").exists() for pid in cores) and time.time() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in cores if Path(f"/proc/{pid}").exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_cli_refusals_are_one_sentence(hf_llama, tmp_path, capsys):
    from megapipe.cli import main

    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_bytes((hf_llama[0] / "tokenizer.json").read_bytes())
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        cases = [
            (["serve", str(tmp_path / "nope")], "does not exist"),
            (["serve", str(hf_llama[0]), "--engine", "tgi"], "--engine 'tgi' is not one of megapipe, vllm"),
            (["serve", str(hf_llama[0]), "--port", str(busy.getsockname()[1])], "cannot listen on 127.0.0.1"),
            (["serve", str(hf_llama[0]), "--port", "0", "--max-model-len", "4096"],
             "--max-model-len = 4096 exceeds the model's max_position_embeddings = 128"),
            (["serve", str(hf_llama[0]), "--kv-cache-memory", "lots"], "--kv-cache-memory 'lots' is not a size"),
            (["serve", str(hf_llama[0]), "--tool-call-parser", "xml"],
             "--tool-call-parser 'xml' is not one of hermes, llama3_json, openai"),
            (["serve", str(hf_llama[0]), "--speculative-tokens", "2"],
             "serve of Llama models does not support engine speculative"),
            (["serve", str(hf_llama[0]), "--lora-modules", "plain"], "--lora-modules 'plain' is not name=PATH"),
            (["serve", str(hf_llama[0]), "--lora-modules", f"a={hf_llama[0]}", f"b={tmp_path / 'no'}"],
             f"--lora-modules b={tmp_path / 'no'}: {tmp_path / 'no'} does not exist"),
            (["serve", str(hf_llama[0]), "--port", "0", "--lora-modules", f"a={tmp_path}"],
             f"--lora-modules a={tmp_path}: {tmp_path} is not a LoRA adapter"),
            (["serve", str(hf_llama[0]), "--log-level", "loud"], "--log-level 'loud' is not one of critical"),
            (["serve", str(hf_llama[0] / "config.json")], "config.json is a file: give a megapipe checkpoint"),
            (["serve", str(no_config)], f"{no_config} looks like a Hugging Face model directory but has no "
                                        f"config.json"),
            (["serve", str(hf_llama[0]), "--host", ""], "--host is empty, which would listen on every interface"),
            (["serve", str(hf_llama[0]), "--kv-cache-memory", "0.5"], "--kv-cache-memory '0.5' is less than one byte"),
            (["serve", str(hf_llama[0]), "--max-body-size", "0.5"], "--max-body-size '0.5' is less than one byte"),
            (["serve", str(hf_llama[0]), "--num-blocks", "10", "--kv-cache-memory", "1GiB"],
             "--num-blocks = 10 and --kv-cache-memory = 1073741824 bytes both size the KV cache: give one"),
            (["serve", str(hf_llama[0]), "--port", "0", "--num-blocks", str(10**11)],
             "cannot allocate the KV cache of 100000000000 blocks"),
            (["serve", str(hf_llama[0]), "--speculative-method", "eagle", "--speculative-tokens", "2"],
             "--speculative-method = 'eagle' is not one of mtp, ngram"),
            (["serve", str(hf_llama[0]), "--speculative-method", "ngram"],
             "--speculative-method ngram needs --num-speculative-tokens N"),
            (["serve", str(hf_llama[0]), "--speculative-method", "ngram", "--speculative-tokens", "2",
              "--prompt-lookup-min", "5"], "--prompt-lookup-min = 5 exceeds --prompt-lookup-max = 4"),
            (["serve", str(hf_llama[0]), "--engine", "vllm", "--vllm-python", str(tmp_path / "py")],
             "no executable Python there"),
            # the engine's own checks, before anything loads, for either engine
            (["serve", str(hf_llama[0]), "--max-num-seqs", "0"], "--max-num-seqs = 0 must be an integer >= 1"),
            (["serve", str(hf_llama[0]), "--gpu-memory-utilization", "1.5"],
             "--gpu-memory-utilization = 1.5 must be a number in (0, 1]"),
            (["serve", str(hf_llama[0]), "--engine", "vllm", "--block-size", "0"],
             "--block-size = 0 must be an integer >= 1"),
        ]
        for args, message in cases:
            assert main(args) != 0, args
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, (args, err)
    finally:
        busy.close()


@pytest.mark.parametrize("source", ["--api-key", "MEGAPIPE_API_KEY"])
@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_at_startup(source, key, hf_llama, monkeypatch, capsys):
    """Neither an empty MEGAPIPE_API_KEY (which click reads as unset: no authentication) nor an empty --api-key (no
    one could authenticate) starts a server."""
    from megapipe.cli import main

    args = ["serve", str(hf_llama[0]), "--port", "-1"]  # past the key check, the port is refused: nothing starts
    monkeypatch.delenv("MEGAPIPE_API_KEY", raising=False)
    if source == "--api-key":
        args += ["--api-key", key]
    else:
        monkeypatch.setenv("MEGAPIPE_API_KEY", key)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{source} is empty: give a key" in err and "Traceback" not in err
