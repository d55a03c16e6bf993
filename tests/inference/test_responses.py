"""The Responses API (/v1/responses): its request mapped onto the chat path, its output items and stream events
checked against the openai package's own types, and its output against /v1/chat/completions on the same model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from megapipe.inference.protocol import ChatMessage
from megapipe.inference.responses import ResponseBuilder, ResponsesRequest, usage_of
from megapipe.inference.sampling import ParamError
from tests.inference.test_server import KEY
from tests.inference.test_structured import SCHEMA, WEATHER, check_person, check_weather

EVENT = TypeAdapter(ResponseStreamEvent)
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's tools are flat


def test_input_items_become_chat_messages():
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "temperature": 0.5, "top_k": 3, "max_output_tokens": 7,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                               {"type": "input_text", "text": "in Paris?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}],
        "tools": [FLAT_WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}}})
    chat = body.chat_request()
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]
    assert chat.tools == [WEATHER] and chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                           "strict": True}}
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.top_p) == (7, 0.5, 3, None)
    one = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "low"}}).chat_request()
    assert one.messages[0].content == "hi"
    assert one.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    off = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}, "tool_choice": "auto",
                                           "chat_template_kwargs": {"x": 1}}).chat_request()
    assert off.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False, "x": 1}
    assert off.tools is None and off.tool_choice is None  # auto without tools: none, as vLLM (not a 400)
    assert chat.messages[2].as_template_input()["reasoning_content"] == "Look it up."  # for templates that show it
    assert (chat.continue_final_message, chat.add_generation_prompt) == (False, True)
    assert ChatMessage(role="assistant", content="x", reasoning="r").as_template_input()["reasoning_content"] == "r"


@pytest.mark.parametrize("fields,param,words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0] has type 'web_search'"),
    ({"input": [{"type": "computer_call"}]}, "input", "input[0] has type 'computer_call'"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role 'robot'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "'input_file'"),
    ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "'yaml'"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "is not served"),
    ({"n": 2}, "n", "n must be 1"),
    ({"input": []}, "input", "input is empty"),
    ({"input": [{"role": "user", "content": 3}]}, "input", "must be a string or a list of parts, not int"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}]}, "input", "text as a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input", "not int"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "needs call_id"),
    ({"text": {"format": "json"}}, "text", "text.format must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs its schema"),
    ({"metadata": {"a": 1}}, "metadata", "must be strings"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, param, words):
    with pytest.raises(ParamError) as e:
        ResponsesRequest.model_validate({"input": "hi", **fields}).chat_request()
    assert e.value.param == param and words in str(e.value)


def test_builder_events_are_openais_and_end_in_the_whole_response():
    """Reasoning, then content, then two calls as a stream makes them: every event is one of the openai package's
    types, numbered in order; the items open and close in turn; the last event carries the whole response."""
    build = ResponseBuilder(ResponsesRequest.model_validate({"input": "hi", "tools": [FLAT_WEATHER]}), "m", "resp_x")
    events = build.start()
    events += build.update("Let me", "", [])
    events += build.update("Let me think.", "Sure", [])
    events += build.update("Let me think.", "Sure.", [{"index": 0, "id": "call_a", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": '{"ci'}}])
    events += build.update("Let me think.", "Sure.", [
        {"index": 0, "function": {"arguments": 'ty": "Paris"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": ""}}])
    events += build.update("Let me think.", "Sure.", [{"index": 1, "function": {"arguments": "{}"}}])
    events += build.finish("stop", usage_of(5, 9, 2, 3))
    for i, e in enumerate(events):
        EVENT.validate_python(e)
        assert e["sequence_number"] == i
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    whole = Response.model_validate(events[-1]["response"])
    assert whole.status == "completed" and whole.output_text == "Sure."
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    assert whole.output[0].content[0].text == "Let me think."
    assert [(o.call_id, o.arguments, o.status) for o in whole.output[2:]] == [
        ("call_a", '{"city": "Paris"}', "completed"), ("call_b", "{}", "completed")]
    assert whole.usage.input_tokens_details.cached_tokens == 2 and whole.usage.total_tokens == 14
    for args, status in (('{"city": "Pa', "incomplete"), ('{"city": "Paris"}', "completed")):
        build = ResponseBuilder(ResponsesRequest.model_validate({"input": "hi"}), "m", "resp_z")
        build.update("", "", [{"index": 0, "id": "c", "function": {"name": "f", "arguments": args}}])
        last = build.finish("length", usage_of(1, 5, 0, 0))[-1]["response"]
        assert (last["status"], last["output"][0]["status"]) == ("incomplete", status)  # a whole call stays whole
    cut = ResponseBuilder(ResponsesRequest.model_validate({"input": "hi"}), "m", "resp_y")
    last = cut.finish("length", usage_of(1, 0, 0, 0))[-1]
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"} and Response.model_validate(last["response"]).output_text == ""


def test_a_reply_equals_the_chat_completions_and_streams_the_same(live):
    c = live.client()
    kwargs = dict(model="tiny", max_output_tokens=12, temperature=0, instructions="Answer.", metadata={"k": "v"},
                  extra_body={"ignore_eos": True})
    r = c.responses.create(input="Hello there", **kwargs)
    chat = c.chat.completions.create(model="tiny", max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
                                     messages=[{"role": "system", "content": "Answer."},
                                               {"role": "user", "content": "Hello there"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.0, 1.0, 12)  # what it ran with
    assert (r.metadata, r.instructions, r.store) == ({"k": "v"}, "Answer.", False)
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # cut at 12 tokens
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    seen, text = [], ""
    for e in c.responses.create(input="Hello there", stream=True, **kwargs):
        seen.append(e)
        text += e.delta if e.type == "response.output_text.delta" else ""
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert seen[-1].type == "response.incomplete" and seen[-1].response.output_text == text == r.output_text
    raw = httpx.post(live.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny", "input": "hi", "stream": True, "max_output_tokens": 2})
    first = raw.text.split("\n\n")[0].split("\n")
    assert first[0] == "event: response.created" and json.loads(first[1][len("data: "):])["type"] == \
        "response.created"


def test_text_format_and_tool_choice_are_kept(live):
    c = live.client()
    r = c.responses.create(model="tiny", input="Who are you?", max_output_tokens=60, temperature=1.0,
                           extra_body={"seed": 3},
                           text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}})
    assert r.status == "completed"
    check_person(r.output_text)
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        kwargs = dict(model="tiny", input="Weather?", max_output_tokens=100, temperature=1.0, tools=[FLAT_WEATHER],
                      tool_choice=choice, parallel_tool_calls=False, extra_body={"seed": 5})  # one call at most
        r = c.responses.create(**kwargs)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and r.output_text == "", choice
        assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
        for call in calls:
            check_weather(call.arguments)
        done = list(c.responses.create(stream=True, **kwargs))[-1].response
        assert [(o.name, o.arguments) for o in done.output if o.type == "function_call"] == [
            (o.name, o.arguments) for o in calls]


def test_auto_calls_and_a_tool_output_going_back(hermes_live):
    """tool_choice auto reads the model's own calls (Hermes', forced by a regex as in test_structured); the call and
    its output go back as input items through the chat template."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "P[a-z]{2}", "unit": "c"\}\}</tool_call>'
    c = hermes_live.client()
    kwargs = dict(model="tiny", input="Weather?", max_output_tokens=100, temperature=1.0, tools=[FLAT_WEATHER],
                  extra_body={"guided_regex": "Sure[.]" + call, "seed": 9})
    r = c.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Sure."
    fc = r.output[1]
    check_weather(fc.arguments)
    events = list(c.responses.create(stream=True, **kwargs))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == fc.arguments and len(pieces) > 1  # the arguments came in pieces
    back = c.responses.create(model="tiny", max_output_tokens=4, temperature=0, tools=[FLAT_WEATHER], input=[
        {"role": "user", "content": "Weather?"}, fc.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    assert back.status in ("completed", "incomplete") and back.usage.input_tokens > r.usage.input_tokens
    chat = c.chat.completions.create(model="tiny", max_tokens=1, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": fc.call_id, "type": "function",
                                              "function": {"name": fc.name, "arguments": fc.arguments}}]},
        {"role": "tool", "tool_call_id": fc.call_id, "content": "sunny"}])
    assert back.usage.input_tokens == chat.usage.prompt_tokens  # the items render as those chat messages do


def test_an_assistant_message_in_progress_is_continued(live):
    """vLLM's rule: a last assistant message whose status is in_progress (or incomplete) is continued, its turn left
    open, instead of answered by a new turn."""
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The answer is"}]}
    sizes = {}
    for status in ("completed", "in_progress", "incomplete"):
        input_ = [{"role": "user", "content": "hi"}, {**said, "status": status}]
        chat = ResponsesRequest.model_validate({"input": input_}).chat_request()
        going_on = status != "completed"
        assert (chat.continue_final_message, chat.add_generation_prompt) == (going_on, not going_on)
        r = live.client().responses.create(model="tiny", max_output_tokens=2, temperature=0, input=input_)
        sizes[status] = r.usage.input_tokens
    # the continued turn has no end-of-turn marker and no new assistant header after it
    assert sizes["in_progress"] == sizes["incomplete"] < sizes["completed"]


def test_refusals_are_openai_errors(live):
    c = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_abc")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input="hi", max_output_tokens=10**9)
    assert e.value.body["param"] == "max_output_tokens" and "max_output_tokens = 1000000000" in str(e.value)
    # what the chat path refuses is named as the Responses request names it
    for fields, param in (({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input"),
                          ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
                           "text")):
        r = httpx.post(live.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "input": "hi", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_reasoning_is_its_own_item(hf_llama):
    """With --reasoning-parser deepseek_r1 the tiny model's reply (which never closes a <think>) is all reasoning:
    a reasoning item holding what chat completions call reasoning_content, streamed as reasoning_text deltas."""
    from tests.inference.test_server import LiveServer

    live = LiveServer(hf_llama[0], server_config={"reasoning_parser": "deepseek_r1"})
    try:
        c = live.client()
        kwargs = dict(model="tiny", input="hi", max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        r = c.responses.create(**kwargs)
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
        thought = chat.choices[0].message.model_extra["reasoning_content"]
        assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text == thought
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 8 and r.output_text == ""
        events = list(c.responses.create(stream=True, **kwargs))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert events[-1].response.output[0].content[0].text == thought
    finally:
        live.stop()
