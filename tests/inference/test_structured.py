"""Structured outputs and tool calls through the official ``openai`` client against a live server over a random tiny
Llama: JSON schema / object, choice, regex and grammar constraints, a mixed batch, streaming, errors, forced tool
calls; the engine's mask per row; the tool-call parsers on fixed strings."""

from __future__ import annotations

import json
import re

import openai
import pytest

from megapipe.data.chat_template import CHATML, ChatTemplate
from megapipe.inference import SamplingParams
from megapipe.inference.protocol import ChatMessage
from megapipe.inference.sampling import ParamError
from megapipe.inference.structured import Constraint
from megapipe.inference.tool_calls import HarmonyParser, HermesParser, Llama3JsonParser, ToolStream

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green"]}}, "required": ["name", "age", "ok", "color"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
MESSAGES = [{"role": "user", "content": "Who are you?"}]


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "ok", "color"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    assert type(obj["ok"]) is bool and obj["color"] in ("red", "green")
    assert "\n" not in text and "  " not in text  # single-line JSON: the grammar bounds the whitespace


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and len(args["city"]) <= 8 and args["unit"] in ("c", "f")


def test_json_schema_n_logprobs(live):
    r = live.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, n=3, temperature=1.0, seed=7, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop"  # closed well within max_tokens, whatever the random model wanted
        check_person(c.message.content)
        assert len(c.logprobs.content) >= 10 and all(t.logprob <= 0 for t in c.logprobs.content)


def test_json_object_and_vllm_fields(live):
    c = live.client()
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    for extra in ({"guided_choice": ["yes", "no", "maybe"]}, {"structured_outputs": {"choice": ["yes", "no"]}}):
        r = c.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=1.0, seed=3,
                                 extra_body=extra)
        assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    for extra in ({"guided_regex": r"[a-c]{3}-\d{2}"}, {"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}}):
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5,
                                      extra_body=extra)
        assert re.fullmatch(r"[a-c]{3}-\d{2}", r.choices[0].message.content)
    r = c.completions.create(model="tiny", prompt="Count:", max_tokens=12, temperature=1.0, seed=1,
                             extra_body={"guided_grammar": 'root ::= "one" | "two" ("," "three")?'})
    assert r.choices[0].text in ("one", "two", "two,three")
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=2,
                                  extra_body={"guided_json": SCHEMA})
    check_person(r.choices[0].message.content)


def test_streaming_json(live):
    stream = live.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=11, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert finish == "stop"
    check_person("".join(parts))


class Counting:
    """A GrammarCompiler that counts its compiles."""

    def __init__(self, compiler):
        self.compiler, self.calls = compiler, 0

    def compile_grammar(self, grammar):
        self.calls += 1
        return self.compiler.compile_grammar(grammar)


def test_a_grammar_is_compiled_once(live, monkeypatch):
    """A request of n = 2 with a JSON schema compiles it once (the server's check before queueing, the engine's
    check and each sample's matcher share it), and the next request with that schema not again."""
    counting = Counting(live.engine.grammars.compiler)
    monkeypatch.setattr(live.engine.grammars, "compiler", counting)
    schema = {"type": "object", "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["digit"]}  # this test's own: compiled by no other
    for seed in (1, 2):
        r = live.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=30, n=2, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})
        assert [set(json.loads(c.message.content)) for c in r.choices] == [{"digit"}] * 2
    assert counting.calls == 1


def test_invalid_constraints_are_400(live):
    c = live.client()
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
              "response_format", 'Unsupported type "foo"'),
             ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "parenthesis is not closed"),
             ({"extra_body": {"guided_grammar": "root ::= foo"}}, "guided_grammar", 'Rule "foo" is not defined'),
             ({"response_format": {"type": "xml"}}, "response_format", "'xml' is not one of"),
             ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice", "exclude each other"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice", "'nope', which is not in tools"),
             ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser")]
    for kwargs, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **kwargs)
        err = e.value.body
        assert err["param"] == param and words in err["message"], err


# parses without a tokenizer (an engine core's front end), fails to compile against one: the token id is past the vocabulary
UNCOMPILABLE = 'root ::= TokenTagDispatch((99999999, b))\nb ::= "x"'


def test_a_grammar_that_fails_to_compile_is_400_streaming_too(live):
    """Where the grammar is compiled (here, or in the engine core process after the front end's parse) it fails;
    streaming or not, completions and chat, n = 2: a 400 naming the field and xgrammar's reason, and the server
    answers the next request."""
    c = live.client()
    extra = {"guided_grammar": UNCOMPILABLE}
    calls = [lambda stream: c.completions.create(model="tiny", prompt=["Count:", "Go:"], max_tokens=4, n=2,
                                                 stream=stream, extra_body=extra),
             lambda stream: c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2,
                                                      stream=stream, extra_body=extra)]
    for call in calls:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                list(call(stream)) if stream else call(stream)
            err = e.value.body
            assert err["param"] == "guided_grammar" and err["type"] == "invalid_request_error", err
            assert err["message"].startswith("guided_grammar: the grammar cannot be compiled (") and (
                "Token id 99999999 in the grammar is out of the vocabulary range" in err["message"]), err
    r = c.completions.create(model="tiny", prompt="Count:", max_tokens=8, temperature=1.0, seed=1, stream=True,
                             extra_body={"guided_grammar": 'root ::= "one" | "two"'})
    assert "".join(ch.choices[0].text for ch in r) in ("one", "two")


def test_engine_thread_refusing_a_stream_is_400(live, monkeypatch):
    """The engine thread's own compile failing after the server's passed (a grammar evicted from the cache in
    between): a streaming request is still a 400, not an error event after a 200."""
    def refuse(c):
        raise ParamError(c.param, f"{c.param}: the grammar cannot be compiled (out of luck)")

    monkeypatch.setattr(live.engine.grammars, "matcher", refuse)
    with pytest.raises(openai.BadRequestError) as e:
        list(live.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, stream=True,
                                                   extra_body={"guided_choice": ["yes", "no"]}))
    assert e.value.body["message"] == "guided_choice: the grammar cannot be compiled (out of luck)"
    monkeypatch.undo()
    r = live.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
                                              extra_body={"guided_choice": ["yes", "no"]})
    assert "".join(ch.choices[0].delta.content or "" for ch in r) in ("yes", "no")


def test_named_and_required_tool_choice(live):
    c = live.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=4,
                                  tools=[WEATHER], tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # forced: stop (OpenAI's, vLLM's)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, temperature=1.0, seed=6,
                                  tools=[WEATHER], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls and all(x.function.name == "get_weather" for x in calls)
    for x in calls:
        check_weather(x.function.arguments)
    stream = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=4,
                                       tools=[WEATHER], tool_choice=named, stream=True)
    args, names, finish = "", [], None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and finish == "stop"
    assert args == call.function.arguments  # same seed: the streamed call equals the whole one


def test_tool_messages_through_template(live):
    messages = [ChatMessage(role="user", content="Weather in Paris?"),
                ChatMessage(role="assistant", content="", tool_calls=[{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]),
                ChatMessage(role="tool", content="21", tool_call_id="call_1")]
    text = ChatTemplate(CHATML, "chatml").render([m.as_template_input() for m in messages], tools=[WEATHER],
                                                  add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '"name": "get_weather"' in text.split("</tools>")[0]  # the tools in the system turn
    assert "<|im_start|>tool\n21<|im_end|>" in text
    r = live.client().chat.completions.create(  # the server takes such a conversation (tool_choice none)
        model="tiny", messages=[m.model_dump(exclude_none=True) for m in messages], max_tokens=4, temperature=0,
        tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_a_past_call_whose_arguments_are_no_json_object_reaches_the_template_as_empty(live, caplog):
    """A replayed tool call cut off mid-arguments (or arguments that are JSON but no object) is {} for the template
    with a warning, as vLLM takes it, so the conversation can go on; good arguments stay as they are."""
    def call(arguments):
        return {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}

    for arguments, want in (('{"city": "Par', {}), ("[1, 2]", {}), ("", {}), ('{"city": "Paris"}', {"city": "Paris"})):
        message = ChatMessage(role="assistant", content="", tool_calls=[call(arguments)])
        assert message.as_template_input()["tool_calls"][0]["function"]["arguments"] == want, arguments
    assert "arguments '{\"city\": \"Par' are not a JSON object" in caplog.text
    r = live.client().chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call('{"city": "Par')]},
        {"role": "tool", "content": "21", "tool_call_id": "c1"}])
    assert r.choices[0].finish_reason in ("length", "stop")


def test_developer_messages_are_system_messages_to_a_template_without_that_role():
    chatml = ChatTemplate(CHATML, "chatml")
    as_system = chatml.render([{"role": "system", "content": "Be terse"}, {"role": "user", "content": "hi"}])
    assert chatml.render([{"role": "developer", "content": "Be terse"}, {"role": "user", "content": "hi"}]) == \
        as_system
    named = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
                         "{# the 'developer' role is this template's own #}", "own")
    assert named.render([{"role": "developer", "content": "x"}]) == "developer:x;"


def test_mixed_batch_one_step(tiny_engine_factory):
    """A constrained and a free greedy row in the same engine steps: each equals its own run alone, and the
    constrained row's every token was allowed by its grammar."""
    engine = tiny_engine_factory()
    regex = Constraint("regex", r"[a-c]{3}-\d{2}")
    free = SamplingParams(max_tokens=10, temperature=0)
    held = SamplingParams(max_tokens=10, temperature=0, structured=regex)
    alone = [engine.generate(["hello world"], free)[0].outputs[0], engine.generate(["hello world"], held)[0].outputs[0]]
    engine.add_request("free", "hello world", free)
    engine.add_request("held", "hello world", held)
    first = engine.step()
    assert {o.request_id for o in first} == {"free", "held"}  # both sampled in the one step
    assert all(len(o.outputs[0].token_ids) == 1 for o in first)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.outputs[0]
    assert done["free"].token_ids == alone[0].token_ids and len(done["free"].token_ids) == 10
    assert done["held"].token_ids == alone[1].token_ids and re.fullmatch(r"[a-c]{3}-\d{2}", done["held"].text)


def test_hermes_parser():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = HermesParser().split(text, True)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {})]
    assert HermesParser().split("No tools here.", True) == ("No tools here.", [])
    assert HermesParser().split("partial <tool", False) == ("partial ", [])  # may be a tag: held back
    assert HermesParser().split("<tool_call>{not json</tool_call>", True)[1] == []
    assert HermesParser().split('<tool_call>{"name": "f", "arguments": {"a":1} }</tool_call>', True)[1][0].arguments == \
        '{"a":1}'  # the model's own text
    assert HermesParser().split('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', True)[1][0].arguments == \
        "{}"  # arguments given as a string: that string


def test_llama3_json_parser():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}'
    content, calls = Llama3JsonParser().split(text, True)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("f", {})]
    assert Llama3JsonParser().split('{"name": "g", "parameters": {"x": 1}}', True)[1][0].arguments == '{"x": 1}'
    assert Llama3JsonParser().split("The answer is 4.", True) == ("The answer is 4.", [])
    assert Llama3JsonParser().split('{"name": "g", "par', False) == ("", [])


def test_harmony_parser():
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
    content, calls = HarmonyParser().split(text, True)  # <|call|> is the stop token: not in the text
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert HarmonyParser().split(final, True) == ("It is 4.", [])
    assert HarmonyParser().split("plain text", True) == ("plain text", [])


HERMES_OUTPUTS = [  # (output, its calls): a model's slips included
    ('Sure.<tool_call>\n{"name": "a", "arguments": {"x": {"y": [1, "}"]}}}\n</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"z":2}}</tool_call><tool_call>{"name": "c", "arguments": {"w": 1',
     [("a", '{"x": {"y": [1, "}"]}}'), ("b", '{"z":2}'), ("c", '{"w": 1')]),  # the last cut off by max_tokens
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', [("f", '{"a": 1}')]),  # the outer brace missing
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}}</tool_call><tool_call>{"name": "g", "arguments": {"b": 2}}'
     '</tool_call>', [("f", '{"a": 1}'), ("g", '{"b": 2}')]),  # one brace too many
    ('<tool_call>{"name": "f", "arguments": {"a": 1}, "id": "x"}</tool_call>', [("f", '{"a": 1}')]),  # more keys
    ('<tool_call>{"name": "f", "arguments": {"city": "Paris"}', [("f", '{"city": "Paris"}')]),  # EOS before }
    ('<tool_call>{"name": "f", "arguments": {"s": "a}\\"}b ", "n": [{"k": "}"}]}}</tool_call>'
     '<tool_call>{"arguments": {"z": 1}, "name": "h"}</tool_call>',  # braces in strings; arguments before name
     [("f", '{"s": "a}\\"}b ", "n": [{"k": "}"}]}'), ("h", '{"z": 1}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', [("f", '{"x": 1}')]),  # as a string
]


LLAMA3_OUTPUTS = [
    ('<|python_tag|>{"name": "a", "parameters": {"x": {"y": [1, "}"]}}}; {"name": "b", "arguments": {"z":2}};'
     '{"name": "c", "parameters": {"w": 1', [("a", '{"x": {"y": [1, "}"]}}'), ("b", '{"z":2}'), ("c", '{"w": 1')]),
    ('{"name": "f", "parameters": {"a": 1}; {"name": "g", "parameters": {}}', [("f", '{"a": 1}'), ("g", "{}")]),
    ('{"name": "f", "parameters": {"a": 1}}}; {"name": "g", "parameters": {"b": 2}}', [("f", '{"a": 1}'),
                                                                                       ("g", '{"b": 2}')]),
    ('{"name": "f", "parameters": {"a": 1}, "id": "x"}', [("f", '{"a": 1}')]),
    ('{"parameters": {"z": 1}, "name": "h"}', [("h", '{"z": 1}')]),  # name after the arguments: read once whole
]
HARMONY_OUTPUTS = [
    ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
     '<|constrain|>json<|message|>{"city": "Paris", "unit": "C"}', [("get_weather", '{"city": "Paris", "unit": "C"}')]),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|> {\"a\": \"<|x\"} <|call|>",
     [("f", '{"a": "<|x"}')]),
]


@pytest.mark.parametrize("parser,text,want", [(HermesParser, t, w) for t, w in HERMES_OUTPUTS]
                         + [(Llama3JsonParser, t, w) for t, w in LLAMA3_OUTPUTS]
                         + [(HarmonyParser, t, w) for t, w in HARMONY_OUTPUTS])
def test_tool_stream_deltas(parser, text, want):
    """Streaming a model's output a few characters at a time: content first, then each call as vLLM streams it, its
    id, type and name once, then its arguments as they grow (the model's own JSON text, closing braces held back
    until they show whose they are); a call once sent never goes away, so the pieces joined are the whole output's
    calls whatever the model's slips (a brace missing or too many, more keys, a call cut off)."""
    content_whole, whole = parser().split(text, True)
    assert [(c.name, c.arguments) for c in whole] == want
    for step in (1, 3, 7):
        stream, content, calls = ToolStream(parser()), "", {}
        for end in [*range(1, len(text) + 1, step), len(text)]:
            delta, deltas = stream.update(text[:end], end == len(text))
            content += delta
            for d in deltas:
                if "id" in d:
                    assert d["index"] == len(calls) and d["type"] == "function"
                    calls[d["index"]] = [d["function"]["name"], ""]
                calls[d["index"]][1] += d["function"]["arguments"]
        assert content == content_whole == (text[:text.find("<tool_call>")] if parser is HermesParser else "")
        assert [tuple(c) for _, c in sorted(calls.items())] == want, step
    stream = ToolStream(parser())
    pieces = sum(len(stream.update(text[:end], False)[1]) for end in range(1, len(text)))
    if parser is HarmonyParser or re.search(r'\{"name": "\w+", "(arguments|parameters)": \{', text):
        assert pieces > len(want)  # arguments came in pieces before their call was whole


def test_sampler_masks_per_row(live):
    """sample() over a batch of free, constrained greedy and constrained sampled rows: a greedy constrained row
    takes the argmax of its grammar-masked logits (whether or not its unmasked argmax was allowed), a sampled one
    only allowed tokens, a free row its unmasked argmax."""
    import torch
    import xgrammar as xgr

    from megapipe.inference.sampling import SampleRow, sample

    grammars = live.engine.grammars
    c = Constraint("regex", "[a-c]{3}")
    V = live.engine.vocab_size
    allowed = xgr.allocate_token_bitmask(1, V)
    grammars.matcher(c).fill(allowed, 0)
    ok = torch.tensor([bool(int(allowed[0, t // 32]) >> (t % 32) & 1) for t in range(V)])
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(4, V, generator=gen)
        if trial % 2:  # the unmasked argmax allowed: the path that skips masking
            logits[1, ok.nonzero()[trial % 3, 0]] = 10.0
        rows = [SampleRow(SamplingParams(temperature=0), None, [1], []),
                SampleRow(SamplingParams(temperature=0), None, [1], [], (), grammars.matcher(c)),
                SampleRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(trial), [1], [], (),
                          grammars.matcher(c)),
                SampleRow(SamplingParams(temperature=0), None, [1], [], (), grammars.matcher(c))]
        before = logits.clone()
        out = sample(logits, rows).tolist()
        assert torch.equal(logits, before)  # the caller's logits are left alone
        masked = logits.masked_fill(~ok, float("-inf"))
        assert out[0] == int(logits[0].argmax()) and out[1] == int(masked[1].argmax())
        assert out[3] == int(masked[3].argmax()) and ok[out[2]]


def test_vllm_gets_the_tool_call_parser(tmp_path):
    from megapipe.inference.vllm_engine import vllm_command

    cmd = vllm_command(tmp_path / "python", tmp_path, host="127.0.0.1", port=1, api_key=None, served_model_name="m",
                       max_num_seqs=8, max_model_len=None, dtype="auto", tool_call_parser="hermes")
    assert cmd[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def test_auto_tool_choice_parses_the_output(hermes_live):
    """tool_choice auto with --tool-call-parser hermes: an output in Hermes' format (forced here by a regex, as a
    random model would not write it) comes back as tool_calls, whole and streamed (the arguments in pieces)."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "P[a-z]{2}", "unit": "c"\}\}</tool_call>'
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=1.0, seed=9, tools=[WEATHER],
                  extra_body={"guided_regex": "Sure[.]" + call})
    c = hermes_live.client()
    r = c.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and re.fullmatch(r'\{"city": "P[a-z]{2}", "unit": "c"\}',
                                                              tc.function.arguments)
    content, calls, finish = "", [], None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content == "Sure." and finish == "tool_calls"
    # as vLLM streams a call: its id, type and name first, then its arguments in pieces as they are written
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert len(calls) > 2 and {d.index for d in calls} == {0} and all(d.function.name is None for d in calls[1:])
    assert "".join(d.function.arguments for d in calls) == tc.function.arguments  # same seed: the same call
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, tools=[WEATHER])
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_parallel_tool_calls_false_allows_one_call(hermes_live):
    """OpenAI's parallel_tool_calls false: with auto the parser's first call only (the output holds two here), with
    required a grammar of one call (a list of at most one item)."""
    call = r'<tool_call>\{"name":"get_(weather|time)"\}</tool_call>'  # short: two fit the tiny model's context
    kwargs = dict(model="tiny", messages=MESSAGES, temperature=1.0, seed=9, tools=[WEATHER],
                  extra_body={"guided_regex": call + call})
    c = hermes_live.client()
    both = c.chat.completions.create(**kwargs).choices[0].message.tool_calls
    one = c.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0].message.tool_calls
    assert len(both) == 2 and [x.function.name for x in one] == [both[0].function.name]
    streamed = [d for chunk in c.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True)
                for ch in chunk.choices for d in ch.delta.tool_calls or []]
    assert {d.index for d in streamed} == {0}
    required = dict(model="tiny", messages=MESSAGES, max_tokens=100, temperature=1.0, tools=[WEATHER],
                    tool_choice="required", parallel_tool_calls=False)
    for seed in range(4):
        calls = c.chat.completions.create(**required, seed=seed).choices[0].message.tool_calls
        assert calls is None or len(calls) == 1  # (None: a sample cut by max_tokens)
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from megapipe.inference.structured import json_grammar
    from megapipe.inference.tool_calls import ToolChoice

    item = json.dumps({"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}})
    for parallel, accepted in ((None, [True, True]), (False, [True, False])):
        spec = ToolChoice.parse([WEATHER], "required", parallel).constraint().spec
        grammar = xgr.Grammar.from_ebnf(json_grammar(spec, False))
        assert [_is_grammar_accept_string(grammar, json.dumps([json.loads(item)] * k)) for k in (1, 2)] == accepted


def test_keywords_xgrammar_leaves_out_are_refused(live):
    """Each keyword the refusal lists is one the installed xgrammar compiles as if it were absent (when a new
    version enforces one, this fails and the list shrinks); a schema that uses one is a 400 naming it."""
    import xgrammar as xgr

    from megapipe.inference.structured import UNENFORCED

    def grammar(schema):
        return str(xgr.Grammar.from_json_schema(json.dumps(schema)))

    person = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
    values = {"not": {"type": "string"}, "if": {"required": ["b"]}, "then": {"required": ["b"]},
              "else": {"required": ["b"]}, "dependentRequired": {"a": ["b"]},
              "dependentSchemas": {"a": {"required": ["b"]}}, "dependencies": {"a": ["b"]}}
    for keyword in UNENFORCED:
        base = {"type": "array", "items": {"type": "integer"}} if keyword == "contains" else person
        value = {"const": 1} if keyword == "contains" else values[keyword]
        assert grammar({**base, keyword: value}) == grammar(base), keyword
    array = {"type": "array", "items": {"type": "integer"}}
    assert grammar({**array, "uniqueItems": True}) == grammar(array)
    nested = {"type": "object", "properties": {"not": {"type": "array", "items": {"type": "integer"},
                                                       "uniqueItems": True}}}
    with pytest.raises(ParamError, match=r"'uniqueItems' \(at #/properties/not\) is not enforced"):
        Constraint.json_schema(nested)
    Constraint.json_schema({"type": "object", "properties": {"not": {"type": "integer"}}})  # a property's name
    with pytest.raises(openai.BadRequestError, match="'allOf' .at #. is not enforced"):
        live.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                              extra_body={"guided_json": {"allOf": [person, person]}})
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {**person, "not": {"required": ["b"]}}}}
    with pytest.raises(openai.BadRequestError, match="'not' .at #. is not enforced"):
        live.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format=bad)


def test_response_format_on_completions(live):
    c = live.client()
    r = c.completions.create(model="tiny", prompt="A person:", max_tokens=60, temperature=1.0, seed=3,
                             extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
    check_person(r.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="response_format type 'nonsense'"):
        c.completions.create(model="tiny", prompt="A", max_tokens=2, extra_body={"response_format": {"type": "nonsense"}})


def test_required_tool_choice_with_definitions(live):
    place = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "$defs": {"Loc": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                                            "required": ["city"]}},
        "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"]}}}
    c = live.client()
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100, temperature=1.0, seed=6,
                                  tools=[WEATHER, place], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "visit":
            assert args["loc"]["city"] in ("Oslo", "Rome")
        else:
            check_weather(call.function.arguments)
    other = json.loads(json.dumps(place))
    other["function"]["name"] = "leave"
    other["function"]["parameters"]["$defs"]["Loc"]["required"] = []
    with pytest.raises(openai.BadRequestError, match=r"tools define \$defs/Loc differently"):
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, tools=[place, other],
                                  tool_choice="required")


def test_a_bare_json_answer_is_not_a_llama3_call():
    assert Llama3JsonParser().split('{"name": "Bob", "age": 3}', True) == ('{"name": "Bob", "age": 3}', [])
    assert Llama3JsonParser().split('{"name": "f", "arguments": {}}', True)[1][0].name == "f"


@pytest.mark.parametrize("text,want", [("Hello<|channel|>final<|message|>Hi<|return|>", "HelloHi"),
                                       ("plain <|x|> text", "plain <|x|> text"),
                                       ("ab<|channel|>analysis<|message|>x<|end|>", "ab")])
def test_harmony_content_streamed_is_the_whole_outputs(text, want):
    """Text before the first marker is content, streamed or not (it streamed and then vanished from the whole
    output)."""
    assert HarmonyParser().split(text, True)[0] == want
    for step in (1, 2, 5):
        stream, content = ToolStream(HarmonyParser()), ""
        for end in [*range(1, len(text) + 1, step), len(text)]:
            content += stream.update(text[:end], end == len(text))[0]
        assert content == want, step


def test_nesting_deeper_than_the_json_parser_goes_is_no_error():
    deep = '{"name": "f", "parameters": {"a": ' + "[" * 5000
    for text in (deep, "<|python_tag|>" + deep + "]" * 5000 + "}}"):
        assert Llama3JsonParser().split(text, True)[1][0].name == "f"
    assert HermesParser().split("<tool_call>" + deep.replace("parameters", "arguments") + "</tool_call>", True)[1]


def test_harmony_streams_hold_markers_back_and_keep_reasoning_beside_calls():
    from megapipe.data.chat_template import split_harmony

    text = ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Sunny<|return|>")
    for parse in (lambda t, final: split_harmony(t, final), lambda t, final: (HarmonyParser().split(t, final)[0], "")):
        sent = ["", ""]
        for end in range(1, len(text) + 1):  # a character at a time: markers come in pieces
            got = parse(text[:end], end == len(text))
            for i, part in enumerate(got):
                part = part or ""
                assert part.startswith(sent[i]) and "<|" not in part, (text[:end], part)
                sent[i] = part
        assert sent[0] == "Sunny"


def test_min_tokens_gives_way_to_the_grammars_end(live):
    """min_tokens holds EOS back; where the grammar allows nothing else, its end wins: the output matches."""
    c = live.client()
    for temperature in (0.0, 1.0):
        r = c.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=temperature, seed=1,
                                 extra_body={"guided_choice": ["yes", "no"], "min_tokens": 5,
                                             "skip_special_tokens": False})
        ch = r.choices[0]
        assert ch.text in ("yes", "no") and ch.finish_reason == "stop" and ch.stop_reason is None
        assert r.usage.completion_tokens < 5  # ended before min_tokens: no filler after the choice
