"""OpenAI's Responses API (``POST /v1/responses``) on the chat machinery, as vLLM serves it.

A request's ``instructions`` and ``input`` items (messages, past function calls and their outputs) become chat
messages, its flat function tools and ``text.format`` the chat request's tools and response_format; the chat path
renders, constrains and runs it. The reply comes back as output items: a ``reasoning`` item (what the reasoning
parser or harmony's analysis channel found), a ``message`` with its ``output_text``, and a ``function_call`` per tool
call. ResponseBuilder makes them, for a stream as the Responses events (``response.created`` ...
``response.completed``) and for a whole response at once by the same code.

Like vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``, nothing is stored: ``store`` is answered false and
``previous_response_id`` is refused; the conversation goes back in ``input``.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any, Optional, Union

from megapipe.inference.protocol import ChatCompletionRequest, _Sampling
from megapipe.inference.sampling import ParamError

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(_Sampling):
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict] = None
    reasoning: Optional[dict] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[str] = None
    background: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: more variables for the chat template

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one stands for (ParamError naming the field that cannot be served)."""
        if self.previous_response_id is not None:
            raise ParamError("previous_response_id", "this server stores no responses (store is off, as in vLLM "
                                                     "by default): send the conversation in input instead")
        if self.background:
            raise ParamError("background", "background responses need a response store, which this server does "
                                           "not keep")
        if self.n != 1:
            raise ParamError("n", "a response has one output: n must be 1")
        if self.include and "message.output_text.logprobs" in self.include or self.top_logprobs:
            raise ParamError("top_logprobs" if self.top_logprobs else "include", "output_text logprobs are not "
                             "served on /v1/responses: ask /v1/chat/completions with logprobs")
        if self.metadata is not None and not all(isinstance(v, str) for v in self.metadata.values()):
            raise ParamError("metadata", "metadata values must be strings (OpenAI's rule)")
        if self.truncation not in (None, "disabled"):
            raise ParamError("truncation", f"truncation {self.truncation!r} is not served: only disabled (a prompt "
                                           f"over the context is refused)")
        shared = set(_Sampling.model_fields) - {"response_format", "stream_options", "n"}
        fields = {k: getattr(self, k) for k in shared if k in self.model_fields_set}
        variables = {}
        effort = (self.reasoning or {}).get("effort")
        if effort:  # as vLLM: the effort for templates that take it, "none" turning thinking off for those that do
            variables = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        variables.update(self.chat_template_kwargs or {})
        fields["chat_template_kwargs"] = variables or None
        tools = _chat_tools(self.tools)
        choice = self.tool_choice if tools or self.tool_choice not in ("auto", "none") else None  # vLLM's: none
        last = self.input[-1] if isinstance(self.input, list) and self.input else {}
        # vLLM's: a last assistant message still in progress is continued, not answered
        going_on = isinstance(last, dict) and last.get("role") == "assistant" and last.get("status") in (
            "in_progress", "incomplete")
        return ChatCompletionRequest.model_validate({
            **fields, "stream": self.stream, "messages": self._messages(), "max_tokens": self.max_output_tokens,
            "continue_final_message": going_on, "add_generation_prompt": not going_on,
            "tools": tools, "tool_choice": _chat_tool_choice(choice),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": _response_format(self.text)})

    def _messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise ParamError("input", "input is empty")
        reasoning = None  # a reasoning item's text, for the assistant turn that follows it (as vLLM keeps it)
        for i, item in enumerate(items):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            turn = out[-1] if out and out[-1]["role"] == "assistant" and reasoning is None else None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ParamError("input", f"input[{i}].role {role!r} is not one of user, system, developer, "
                                              f"assistant")
                out.append({"role": role, "content": _content(item.get("content"), i)})
            elif kind == "function_call":
                for key in ("call_id", "name", "arguments"):
                    if not isinstance(item.get(key), str):
                        raise ParamError("input", f"input[{i}] (a function_call) needs {key} as a string")
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if turn is not None:  # calls of one turn go on one assistant message
                    turn.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str):
                    raise ParamError("input", f"input[{i}] (a function_call_output) needs call_id as a string")
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": _content(item.get("output"), i)})
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                reasoning = _content(parts, i) if isinstance(parts, list) else None
                continue
            else:
                raise ParamError("input", f"input[{i}] has type {kind!r}; served here: message, function_call, "
                                          f"function_call_output, reasoning")
            if reasoning is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = reasoning
            reasoning = None
        return out


def _content(content: Any, i: int) -> Any:
    """A Responses message's content as chat content: its text parts joined, or chat parts where it has images."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ParamError("input", f"input[{i}].content must be a string or a list of parts, not "
                                  f"{type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS or kind == "refusal":
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise ParamError("input", f"input[{i}].content: a {kind} part needs its text as a string")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ParamError("input", f"input[{i}].content has a part of type {kind!r}; served here: input_text, "
                                      f"output_text, input_image (by image_url)")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tools(tools: Optional[list]) -> Optional[list]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ParamError("tools", f"tools[{i}] has type {kind!r}: only function tools are served (no hosted "
                                      f"tools)")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                     if tool.get(k) is not None}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ParamError("tool_choice", f"tool_choice {choice!r} is not served: none, auto, required or "
                                    f"{{\"type\": \"function\", \"name\": ...}}")


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ParamError("text", "text.format must be an object: {\"type\": \"text\" | \"json_object\" | "
                                 "\"json_schema\", ...}")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ParamError("text", "text.format json_schema needs its schema as an object (text.format.schema)")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise ParamError("text", f"text.format type {fmt.get('type')!r} is not one of text, json_object, json_schema")


class ResponseBuilder:
    """One response's output items as its reply grows, and the events that tell a stream so (each with its
    sequence_number). ``update`` takes the reasoning and content so far and the tool-call deltas (ToolStream's);
    an item stays open while it grows and is done when another starts or the reply ends (``finish``)."""

    def __init__(self, body: ResponsesRequest, model: str, response_id: str, params=None):
        """``params``: the SamplingParams the reply runs with (the temperature and top_p it echoes)."""
        self.response = {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": model, "output": [], "instructions": body.instructions, "max_output_tokens":
            body.max_output_tokens, "temperature": params.temperature if params else body.temperature,
            "top_p": params.top_p if params else body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": body.text or
            {"format": {"type": "text"}}, "reasoning": body.reasoning, "metadata": body.metadata,
            "store": False, "previous_response_id": None, "truncation": "disabled", "user": body.user,
            "error": None, "incomplete_details": None, "usage": None}
        self.items: list[dict] = self.response["output"]
        self.open: Optional[int] = None  # the index of the item still growing
        self.calls: dict[int, int] = {}  # tool-call index -> its item's index
        self.sent = {"reasoning": 0, "message": 0}  # how much of the reasoning and the content is in items
        self.seq = 0

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [self._event(kind, response=copy.deepcopy(self.response))
                for kind in ("response.created", "response.in_progress")]

    def update(self, reasoning: str, content: str, calls: list[dict]) -> list[dict]:
        events = []
        for kind, text in (("reasoning", reasoning), ("message", content)):
            new = text[self.sent[kind]:]
            if not new:
                continue
            item = self._current(kind)
            if item is None:
                events += self._add(kind)
                item = self.items[self.open]
            item["content"][0]["text"] += new
            self.sent[kind] = len(text)
            delta = {"item_id": item["id"], "output_index": self.open, "content_index": 0, "delta": new}
            events.append(self._event("response.reasoning_text.delta", **delta) if kind == "reasoning" else
                          self._event("response.output_text.delta", **delta, logprobs=[]))
        for d in calls:
            if "id" in d:
                events += self._add("function_call", call_id=d["id"], name=d["function"]["name"])
                self.calls[d["index"]] = self.open
            at = self.calls[d["index"]]
            if d["function"]["arguments"]:
                self.items[at]["arguments"] += d["function"]["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=self.items[at]["id"],
                                          output_index=at, delta=d["function"]["arguments"]))
        return events

    def finish(self, finish_reason: Optional[str], usage: dict) -> list[dict]:
        """The last events; the response (``self.response``) is whole after them."""
        if not self.items:
            events = self._add("message")  # an empty reply is an empty message, so output_text is ""
        else:
            events = []
        cut = finish_reason == "length"
        open_item = self.items[self.open] if self.open is not None else None
        whole = open_item is not None and open_item["type"] == "function_call" and _is_json(open_item["arguments"])
        events += self._close("incomplete" if cut and not whole else "completed")
        self.response.update(status="incomplete" if cut else "completed", usage=usage,
                             incomplete_details={"reason": "max_output_tokens"} if cut else None)
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=copy.deepcopy(self.response))]

    def error(self, message: str, code: Optional[str], param: Optional[str]) -> dict:
        """The event that ends a stream the engine could not finish."""
        return self._event("error", code=code, message=message, param=param)

    def _current(self, kind: str) -> Optional[dict]:
        item = self.items[self.open] if self.open is not None else None
        return item if item is not None and item["type"] == kind else None

    def _add(self, kind: str, **fields) -> list[dict]:
        events = self._close("completed")
        if kind == "message":
            item = {"type": "message", "id": item_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": item_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"type": "function_call", "id": item_id("fc"), "status": "in_progress", "arguments": "", **fields}
        self.items.append(item)
        self.open = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=self.open, item=copy.deepcopy(item)))
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open,
                                      content_index=0, part={**item["content"][0]}))
        return events

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        at, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done", {}) if item["type"] == "reasoning" else \
                ("response.output_text.done", {"logprobs": []})
            events = [self._event(done[0], **where, content_index=0, text=part["text"], **done[1]),
                      self._event("response.content_part.done", **where, content_index=0, part={**part})]
        return events + [self._event("response.output_item.done", output_index=at, item=copy.deepcopy(item))]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


def usage_of(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int, written: int = 0) -> dict:
    """The Responses usage block; ``written``: prompt tokens this request put in the prefix cache."""
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached,
                                                                    "cache_write_tokens": written},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}
