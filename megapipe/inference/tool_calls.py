"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request asks for, and the calls in a model's output.

``named`` and ``required`` choices are guaranteed by a grammar (structured.Constraint): the output is the named
function's arguments as JSON, or a JSON list of ``{"name", "parameters"}`` objects over the given functions, as vLLM
constrains them. ``auto`` finds the calls in the model's own format with a parser named as vLLM names them
(``--tool-call-parser``): ``hermes`` (Hermes / Qwen ``<tool_call>{json}</tool_call>``), ``llama3_json`` (a Llama-3
JSON object ``{"name", "parameters"}``, after ``<|python_tag|>`` or not, several joined by ``;``) and ``openai``
(GPT-OSS harmony: a ``commentary to=functions.NAME`` message; the ``final`` channel is the content).

A parser's ``split(text, final)`` gives the content and the calls found so far; while streaming (``final`` False)
it holds back what may still turn into a call, so the content it gives only grows (ToolStream sends the differences).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from megapipe.data.chat_template import HARMONY_MARKERS, held
from megapipe.inference.sampling import ParamError
from megapipe.inference.structured import Constraint


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _schema_of(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


@dataclass
class ToolChoice:
    """A request's tools and what it asks of them: ``mode`` none, auto, required or named (``name``)."""

    tools: list
    mode: str = "none"
    name: Optional[str] = None
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call at most

    @staticmethod
    def parse(tools: Optional[list], choice: Any, parallel_tool_calls: Optional[bool] = None) -> "ToolChoice":
        parsed = ToolChoice._parse(tools, choice)
        parsed.parallel = parallel_tool_calls is not False
        return parsed

    def finish_reason(self, finish: Optional[str], called: bool) -> Optional[str]:
        """An output's finish_reason once its tool calls are read: tool_calls where calls ended it, except a named
        function's, which ends with stop (OpenAI's and vLLM's)."""
        return "tool_calls" if called and finish == "stop" and self.mode != "named" else finish

    @staticmethod
    def _parse(tools: Optional[list], choice: Any) -> "ToolChoice":
        tools = tools or []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ParamError("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                          f"..., \"parameters\": {{...}}}}}}")
        names = [t["function"]["name"] for t in tools]
        if choice is None:
            return ToolChoice(tools, "auto" if tools else "none")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                raise ParamError("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                                "\"function\": {\"name\": ...}}")
            if name not in names:
                raise ParamError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools "
                                                f"({', '.join(names) or 'none given'})")
            return ToolChoice(tools, "named", name)
        if choice not in ("none", "auto", "required"):
            raise ParamError("tool_choice", f"tool_choice {choice!r} is not one of none, auto, required or a named "
                                            f"function")
        if choice != "none" and not tools:
            raise ParamError("tool_choice", f"tool_choice {choice!r} needs tools")
        return ToolChoice(tools, choice)

    def constraint(self) -> Optional[Constraint]:
        """The grammar that guarantees a named or required choice (None for none and auto)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.name)
            return Constraint.json_schema(_schema_of(tool), "tools")
        if self.mode == "required":
            calls, defs = [], {}
            for t in self.tools:
                schema = dict(_schema_of(t))
                for key in ("$defs", "definitions"):  # their $refs point at the root: they move to the list's
                    for name, sub in (schema.pop(key, None) or {}).items():
                        if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                            raise ParamError("tools", f"tools define {key}/{name} differently: tool_choice required "
                                                      f"needs one definition of each name")
                calls.append({"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                               "parameters": schema},
                              "required": ["name", "parameters"]})
            one = {} if self.parallel else {"maxItems": 1}
            return Constraint.json_schema({"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}, **defs},
                                          "tools")
        return None


class Parser:
    needs_special_tokens = False  # the text it reads keeps the special tokens (skip_special_tokens off)

    def split(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


def _call_from(obj: Any, args_key: str, need_args: bool = False) -> Optional[ToolCall]:
    """The call an object of the model's output stands for; ``need_args``: only with its arguments (a bare JSON
    object with a "name" may be an answer, not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if need_args and not ({"arguments", "parameters"} & obj.keys()):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_string(inner: str) -> Optional[str]:
    """A JSON string's value from the text between its quotes (None where it is no JSON string: a control
    character)."""
    try:
        return json.loads(f'"{inner}"')
    except ValueError:
        return None


def _head(keys: str) -> re.Pattern:
    """Where a call object starts with its name and then its arguments' object (under one of ``keys``): from there
    on it is a call, streamed (_head_call)."""
    return re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:%s)"\s*:\s*(?=\{)' % keys)


def _head_call(head: re.Match, text: str) -> tuple[Optional[ToolCall], Optional[int]]:
    """The call a matched head starts, its arguments as streamed so far, and where they end (None while they are
    not whole); no call where the name is no JSON string."""
    name = _json_string(head.group(1))
    if name is None:
        return None, None
    arguments, end = _arguments(text, head.end())
    return ToolCall(name, arguments), end


def _arguments(text: str, at: int) -> tuple[str, Optional[int]]:
    """A streamed call's arguments, their object opening at ``at``: the model's own JSON text up to the object's end
    and that end, or while the object is not whole, the text so far less the closing braces and blanks at its end
    (they may close an object around it) and None. What follows the object is not looked at, so the arguments of a
    call once seen only grow."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, at)
        return text[at:end], end
    except (ValueError, RecursionError):  # not whole yet (or nested deeper than the parser goes)
        return text[at:].rstrip(" \t\r\n}"), None


class NamedCall(Parser):
    """tool_choice naming a function: the whole output is its arguments (streamed as they grow)."""

    def __init__(self, name: str):
        self.name = name
        self.id = call_id()

    def split(self, text, final):
        return "", [ToolCall(self.name, text, self.id)]


class RequiredCalls(Parser):
    """tool_choice required: the output is a JSON list of {"name", "parameters"} (read once it is complete)."""

    def split(self, text, final):
        if not final:
            return "", []
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return text, []
        calls = [_call_from(x, "parameters") for x in items] if isinstance(items, list) else []
        return ("", calls) if calls and all(calls) else (text, [])


class FirstCall(Parser):
    """Another parser's content and its first call only (parallel_tool_calls false with tool_choice auto)."""

    def __init__(self, parser: Parser):
        self.parser, self.needs_special_tokens = parser, parser.needs_special_tokens

    def split(self, text, final):
        content, calls = self.parser.split(text, final)
        return content, calls[:1]


class HermesParser(Parser):
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after the content.

    A block that starts ``{"name": "...", "arguments": {`` is a call from then on, streamed as vLLM streams one: its
    name, then its arguments as the model writes them (its own JSON text), up to the end of the arguments' object
    once that is whole, before that less the closing braces and blanks at the end (they may close the object around
    them). Whatever comes after the arguments (a missing or extra brace, more keys) is ignored, so a call once seen
    only grows and never goes away: a block cut off at the end keeps the arguments it had (OpenAI's truncated call).
    Other blocks are read once they close, as whole JSON."""

    START, END = "<tool_call>", "</tool_call>"
    HEAD = _head("arguments")

    def split(self, text, final):
        start = text.find(self.START)
        if start < 0:
            return (text if final else text[:held(text, (self.START,))]), []
        calls, at = [], start
        while at >= 0:
            end = text.find(self.END, at)
            body = text[at + len(self.START):end] if end >= 0 else text[at + len(self.START):]
            if end < 0:
                body = body[:held(body, (self.END,))]  # the closing tag may be on its way
            call = self._call(body, end >= 0 or final)
            if call is not None:
                calls.append(call)
            at = -1 if end < 0 else text.find(self.START, end)
        if final and not calls:
            return text, []
        return text[:start], calls

    def _call(self, body: str, whole: bool) -> Optional[ToolCall]:
        head = self.HEAD.match(body)
        if head is not None:
            return _head_call(head, body)[0]
        if not whole:
            return None
        try:
            return _call_from(json.loads(body), "arguments")
        except (ValueError, RecursionError):
            return None


class Llama3JsonParser(Parser):
    """Llama 3: JSON objects ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), after ``<|python_tag|>``
    or not, joined by ``;``. An object that starts with its name and then its arguments is a call from then on,
    streamed as HermesParser streams one; others are read once whole."""

    TAG = "<|python_tag|>"
    HEAD = _head("parameters|arguments")
    BETWEEN = re.compile(r"[\s;}]*")  # between calls: the separator, and a brace too many

    def split(self, text, final):
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(body):
            return "", []  # the tag may be on its way
        if not body.startswith("{"):
            return (text if final or body else ""), []
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            head = self.HEAD.match(body, at)
            if head is not None:
                call, end = _head_call(head, body)
                if call is None:
                    break
                calls.append(call)
                if end is None:
                    break
                try:  # the rest of the object: more keys are ignored, a missing brace before a ';' forgiven
                    _, at = decoder.raw_decode(body, at)
                except (ValueError, RecursionError):
                    at = end if body[end:].lstrip().startswith(";") else len(body)
            else:
                try:
                    obj, at = decoder.raw_decode(body, at)
                except (ValueError, RecursionError):
                    break
                call = _call_from(obj, "parameters", need_args=True)
                if call is None:
                    break
                calls.append(call)
            at = self.BETWEEN.match(body, at).end()
        if final and not calls:
            return text, []
        return "", calls


class HarmonyParser(Parser):
    """GPT-OSS's harmony messages: ``<|channel|>CHANNEL [to=functions.NAME] [<|constrain|>json]<|message|>BODY``
    ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``; a new one starts after ``<|start|>ROLE``."""

    needs_special_tokens = True
    ENDS = re.compile(r"<\|(?:end|call|return)\|>")

    def split(self, text, final):
        lead = text.find("<|")
        if lead < 0:
            return (text if final else text[:held(text, ("<|",))]), []
        if "<|message|>" not in text:
            plain = final and "<|channel|>" not in text and "<|start|>" not in text
            return (text if plain else text[:lead]), []
        content, calls = [text[:lead]], []  # text before the first marker is content as it came
        for part in text[lead:].split("<|start|>"):
            header, sep, rest = part.partition("<|message|>")
            if not sep:
                continue
            end = self.ENDS.search(rest)
            body = rest[:end.start()] if end else rest
            done = end is not None or final
            recipient = re.search(r"to=functions\.([^\s<]+)", header)
            if recipient:  # a call from its header on, its arguments streamed as they come
                arguments = body if done else body[:held(body, HARMONY_MARKERS)]
                calls.append(ToolCall(recipient.group(1), arguments.strip()))
            elif re.search(r"<\|channel\|>\s*final", header):
                content.append(body if done else body[:held(body, HARMONY_MARKERS)])
        return "".join(content), calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "openai": HarmonyParser}


def parser_for(name: Optional[str]) -> Optional[Parser]:
    if name is None:
        return None
    if name not in PARSERS:
        raise ParamError("tool_call_parser", f"--tool-call-parser {name!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[name]()


class ToolStream:
    """Streams one choice's content and tool calls as OpenAI's deltas, from its growing text."""

    def __init__(self, parser: Parser):
        self.parser = parser
        self.content = ""  # the content sent so far (the parser's content only grows)
        self.sent_args: list[int] = []
        self.ids: list[str] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        content, calls = self.parser.split(text, final)
        delta = content[len(self.content):]
        if delta:
            self.content = content
        out = []
        for i, call in enumerate(calls):
            if i == len(self.sent_args):
                self.ids.append(call.id)
                self.sent_args.append(len(call.arguments))
                out.append({"index": i, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent_args[i]:
                out.append({"index": i, "function": {"arguments": call.arguments[self.sent_args[i]:]}})
                self.sent_args[i] = len(call.arguments)
        return delta, out

    @property
    def called(self) -> bool:
        return bool(self.sent_args)
