"""The engine core in a process of its own (serve's default; megapipe.inference.engine_core / core_client): the
server's tests again through it (one spawned core for the module), its outputs equal to the in-process engine's to
the byte (detokenising and stop strings moved to the front end), and a core killed mid-stream: the stream ends in
an error, /health answers 503 and new requests are refused, within seconds."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest

from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine_core import AddRequest, EngineCore, Shutdown, recv, send
from megapipe.inference.sampling import ParamError
from megapipe.inference.structured import Constraint
from tests.inference.test_server import (  # noqa: F401 - the server's tests, run here against the core process
    NAME,
    LiveServer,
    test_a_sample_a_stop_string_ends_stops_decoding,
    test_chat_multi_turn_and_streaming,
    test_completions_match_the_engine,
    test_dropped_streams_abort_and_free_their_blocks,
    test_echo_scoring_with_max_tokens_zero,
    test_error_statuses_have_openai_shape,
    test_metrics_use_vllm_names_and_count,
    test_models_health_version_tokenize,
    test_streaming_completions_and_usage,
)
from tests.inference.test_server_bodies import test_bad_bodies_are_400_on_every_route  # noqa: F401
from tests.inference.test_server_sampling import (  # noqa: F401 - stop tokens and min_tokens at the front end
    hf_tokenizer,
    test_min_tokens_as_transformers_min_new_tokens,
    test_presence_and_frequency_penalties,
)
from tests.inference.test_structured import (  # noqa: F401 - grammars parsed in the front end, compiled in the core
    SCHEMA,
    Counting,
    test_a_grammar_that_fails_to_compile_is_400_streaming_too,
    test_invalid_constraints_are_400,
    test_json_schema_n_logprobs,
    test_named_and_required_tool_choice,
    test_streaming_json,
)


@pytest.fixture(scope="module")
def live(hf_llama):
    server = LiveServer(hf_llama[0], engine_process=True)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(hf_llama):
    return LLMEngine.from_pretrained(hf_llama[0], device="cpu")


CASES = [  # stop strings (one inside a multi-token character), n > 1 with a stop in one sample, min_tokens,
    # logprobs and prompt logprobs, special tokens kept, token-id prompts, bad words, a logit bias, allowed ids
    ("The quick brown", SamplingParams(max_tokens=30, temperature=0)),
    ("The quick brown", SamplingParams(max_tokens=30, temperature=0, stop=["o", "xyz"], logprobs=2)),
    ("Hello", SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=3, stop=[" t"], prompt_logprobs=1)),
    ("Hello", SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2, min_tokens=5, stop=["a"])),
    ([5, 6, 7], SamplingParams(max_tokens=20, temperature=0.8, seed=1, logprobs=0, stop=["e"])),
    ("A stitch in", SamplingParams(max_tokens=25, temperature=1.0, seed=7, skip_special_tokens=False)),
    ("The quick brown", SamplingParams(max_tokens=12, temperature=0, bad_words=["ab", "e"], logit_bias={5: 3.0})),
    ("The quick brown", SamplingParams(max_tokens=12, temperature=0.7, seed=2, allowed_token_ids=[5, 9, 40, 77])),
]


def test_outputs_equal_the_in_process_engine(live, reference):
    """Every RequestOutput of the core process's front end equals the engine's own (text, ids, logprobs, finish and
    stop reasons, token counts), the intermediate ones of a stream too."""

    async def stream(prompt, params):
        return [out async for out in live.async_engine.generate(prompt, params)]

    def same(a, b):
        a, b = replace(a, request_id="", metrics={}), replace(b, request_id="", metrics={})
        return a == b

    reasons = set()
    ended = reference.generate(["To be"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    stop_token = ("To be", SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ended[5]], logprobs=1))
    kept = ("To be", SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[ended[5]], logprobs=1,
                                    include_stop_str_in_output=True))
    for prompt, params in CASES + [stop_token, kept]:
        outs = asyncio.run(stream(prompt, replace(params)))
        (want,) = reference.generate([prompt], replace(params))
        assert same(outs[-1], want), (prompt, params, outs[-1], want)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        reasons |= {type(c.stop_reason) for c in want.outputs if c.finish_reason == "stop"}
    assert reasons == {str, int}  # the cases end on stop strings and on stop tokens


def test_the_core_compiles_a_grammar_once(live, hf_llama):
    """An engine core's front end parses a constraint and compiles nothing (a bad one is a 400 there all the same:
    test_invalid_constraints_are_400); its core compiles it once for a request of n = 2, and not again for the next
    one with the same schema; a compile that fails there refuses the request with the ParamError the server answers
    400 with. The core here runs in a thread of this process, over a pipe, to count."""
    assert live.async_engine.grammars.compiler is None
    engine = LLMEngine.from_pretrained(hf_llama[0], device="cpu")
    counting = Counting(engine.grammars.compiler)
    engine.grammars.compiler = counting
    front, back = multiprocessing.Pipe()
    core = threading.Thread(target=EngineCore(engine, back).run, daemon=True)
    core.start()
    params = SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=3, structured=Constraint.json_schema(SCHEMA))
    for rid in ("a", "b"):
        send(front, AddRequest(rid, engine.encode("Who are you?")[1], replace(params), time.monotonic()))
        samples = []
        while not samples or not samples[-1].finished:
            samples += [o for o in recv(front).outputs if o.request_id == rid]
        assert not any(o.error for o in samples)
        assert sorted(s.index for o in samples for s in o.samples if s.finish_reason) == [0, 1]
    assert counting.calls == 1

    class Failing(Counting):  # a compile that fails in the core after the front end's parse passed
        def compile_grammar(self, grammar):
            raise RuntimeError("[08:00:00] grammar_compiler.cc:12: out of luck")

    engine.grammars.compiler = Failing(None)
    other = replace(params, structured=Constraint.json_schema({"type": "object"}))
    send(front, AddRequest("c", [1, 2, 3], other, time.monotonic()))
    outs = []
    while not outs:
        outs = [o for o in recv(front).outputs if o.request_id == "c"]
    (out,) = outs
    send(front, Shutdown())
    core.join(10)
    error = out.error.exception()  # ParamError: the server's 400
    assert isinstance(error, ParamError) and error.param == "response_format" and str(error) == (
        "response_format: the JSON schema cannot be compiled (out of luck)")


def test_utility_calls_and_stats_go_through_messages(live):
    assert asyncio.run(live.async_engine.utility("lora_adapters")) == {}
    with pytest.raises(Exception, match="is not an engine utility"):
        asyncio.run(live.async_engine.utility("step"))
    stats = live.async_engine.stats()
    assert stats["generation_tokens"] > 0 and stats["num_blocks"] > 0


def test_metrics_before_the_first_step(hf_llama):
    """A scrape before any request (Prometheus's first, just after startup) has every series: the core's Ready
    carries its stats (a 500 before)."""
    server = LiveServer(hf_llama[0], engine_process=True)
    try:
        for name in ("vllm:num_requests_running", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:request_queue_time_seconds_count"):
            assert server.metric(name) == 0, name
    finally:
        server.stop()


def test_sigkill_of_the_core_fails_streams_and_health(live):
    """Last in this module (it kills the module's core): a stream in flight ends in an error event, /health goes
    503 and new requests are refused with the reason, within a few seconds."""
    c = live.client()
    stream = c.completions.create(model=NAME, prompt="The", max_tokens=120, temperature=1.0, stream=True,
                                  extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    start = time.time()
    os.kill(live.async_engine.process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="engine core process exited \\(killed by SIGKILL\\)"):
        for _ in chunks:
            pass
    while httpx.get(live.url + "/health").status_code != 503 and time.time() - start < 5:
        time.sleep(0.05)
    assert httpx.get(live.url + "/health").status_code == 503 and time.time() - start < 5
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=NAME, prompt="The", max_tokens=5)
    assert e.value.status_code == 503 and "killed by SIGKILL" in e.value.body["message"]


def test_signals_held_run_their_handlers_once_the_block_ends():
    """A SIGTERM inside the block (a core process being started) runs its handler after it, once; a raising
    handler raises there; the handlers in place before are back."""
    from megapipe.inference.core_client import signals_held

    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise SystemExit(0)

    before, interrupt = signal.signal(signal.SIGTERM, handler), signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            with signals_held(signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # a handler would have run by now
                assert seen == []
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, before)
