"""OpenAI request bodies (plus vLLM's extra sampling fields) as pydantic models, and their mapping to SamplingParams."""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from megapipe.data.chat_template import join_parts
from megapipe.inference.sampling import ParamError, SamplingParams
from megapipe.inference.structured import Constraint

log = logging.getLogger("megapipe.serve")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    model: Optional[str] = None  # left out: the served base model (as vLLM's)
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields (the OpenAI client sends them through extra_body)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response (vLLM's)
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens (-1: --max-model-len), vLLM's
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's)
    request_id: Optional[str] = None  # the response's id (after the X-Request-Id header)
    # vLLM's structured outputs: its current object and its older names
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    response_format: Optional[dict] = None  # OpenAI's (chat), and vLLM's on completions too

    def constraint(self) -> Optional[Constraint]:
        """The one structured-output constraint this request asks for (response_format, structured_outputs or a
        guided_* field), or None; JSON whitespace is single-line unless structured_outputs.any_whitespace is true."""
        found = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type", "text")
            if kind == "json_object":
                found.append(Constraint.json_schema({"type": "object"}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict):
                    raise ParamError("response_format", "response_format json_schema needs a \"json_schema\" object "
                                                        "({\"name\": ..., \"schema\": {...}})")
                found.append(Constraint.json_schema(spec.get("schema", {"type": "object"})))
            elif kind != "text":
                raise ParamError("response_format", f"response_format type {kind!r} is not one of text, json_object,"
                                                    f" json_schema")
        so = dict(self.structured_outputs or {})
        any_whitespace = bool(so.pop("any_whitespace", False))
        for key in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                    "whitespace_pattern", "backend"):
            so.pop(key, None)
        unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
        if unknown:
            raise ParamError("structured_outputs", f"structured_outputs.{unknown[0]} is not supported (json, regex, "
                                                   f"choice, grammar, json_object, any_whitespace)")
        for param, kind, value in (("structured_outputs.json", "json", so.get("json")),
                                   ("guided_json", "json", self.guided_json),
                                   ("structured_outputs.regex", "regex", so.get("regex")),
                                   ("guided_regex", "regex", self.guided_regex),
                                   ("structured_outputs.choice", "choice", so.get("choice")),
                                   ("guided_choice", "choice", self.guided_choice),
                                   ("structured_outputs.grammar", "grammar", so.get("grammar")),
                                   ("guided_grammar", "grammar", self.guided_grammar)):
            if value is None:
                continue
            if kind == "json":
                found.append(Constraint.json_schema(value, param))
            elif kind == "choice":
                found.append(Constraint.choice(value, param))
            elif not isinstance(value, str) or not value:
                raise ParamError(param, f"{param} must be a non-empty string")
            else:
                found.append(Constraint(kind, value, False, param))
        if so.get("json_object"):
            found.append(Constraint.json_schema({"type": "object"}, "structured_outputs.json_object"))
        if len(found) > 1:
            raise ParamError(found[1].param, f"{found[0].param} and {found[1].param} exclude each other: give one "
                                             f"structured-output constraint")
        if not found:
            return None
        c = found[0]
        return Constraint(c.kind, c.spec, any_whitespace, c.param) if c.kind == "json" else c

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None, defaults: Optional[dict] = None) -> SamplingParams:
        """The engine's parameters; ``defaults`` (the model's generation config, as vLLM applies it: temperature,
        top_p, top_k, min_p, repetition_penalty, max_tokens) where the request leaves a field out."""
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {**{"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0},
                 **(defaults or {})}
        given.update((k, getattr(self, k)) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                     if getattr(self, k) is not None)
        return SamplingParams(
            n=self.n, max_tokens=given.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens, temperature=given["temperature"], top_p=given["top_p"],
            top_k=given["top_k"], min_p=given["min_p"], repetition_penalty=given["repetition_penalty"],
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words or []),
        )

    def _logit_bias(self) -> Optional[dict[int, float]]:
        """OpenAI's {"token id": bias} with int keys, each bias clamped to [-100, 100] as OpenAI and vLLM do."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ParamError("logit_bias", f"logit_bias key {key!r} is not a token id") from None
            out[token] = min(100.0, max(-100.0, bias)) if math.isfinite(bias) else bias
        return out


GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(config: dict) -> dict:
    """A generation config's sampling defaults as the request fields they stand in for (vLLM's choice of fields:
    temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens)."""
    return {field: config[key] for key, field in GENERATION_FIELDS.items()
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True  # the tokenizer's own special tokens around a text prompt (a BOS), as vLLM's

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens(cls, value):
        """max_tokens null is OpenAI's default (16) as when left out: the openai client sends max_tokens=None as
        null, which would otherwise run to the end of the context (vLLM's rule too)."""
        return cls.model_fields["max_tokens"].default if value is None else value


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool's answer: the call it answers
    reasoning_content: Optional[str] = None  # an assistant's reasoning, for templates that render it (Qwen3's)
    reasoning: Optional[str] = None  # the same under vLLM's newer name

    def image_urls(self) -> list[str]:
        """The URLs of this message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        urls = []
        for part in self.content:
            if part.get("type") == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ParamError("messages", "an image_url content part needs image_url.url, a string")
                urls.append(url)
        return urls

    def as_template_input(self, image_text: Optional[str] = None) -> dict:
        """The message for the chat template: its parts joined (join_parts), each image part as ``image_text`` (the
        model's image markers, as Qwen2-VL's template writes them), which is None for a model that takes text
        only."""
        content = self.content
        if isinstance(content, list):
            texts, images = [], False
            for part in content:
                kind = part.get("type")
                if kind == "image_url" and image_text is not None:
                    texts.append(image_text)
                    images = True
                elif kind != "text":
                    allowed = "'text' and 'image_url'" if image_text is not None else "only 'text'"
                    raise ParamError("messages", f"content part of type {kind!r} is not supported ({allowed})")
                else:
                    texts.append(str(part.get("text", "")))
            content = join_parts(texts, images)
        out = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.reasoning_content or self.reasoning:
            out["reasoning_content"] = self.reasoning_content or self.reasoning
        return out


def _call_for_template(call: dict) -> dict:
    """An assistant's tool call as chat templates read it: arguments as an object (templates write it as JSON).
    Arguments that are no JSON object (a weak model's cut-off call, replayed in the history) become {} with a
    warning, as vLLM does: refused, they would fail every later turn of the conversation."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str) or args is None:
        try:
            parsed = json.loads(args) if args else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            parsed = None
        if not isinstance(parsed, dict):
            log.warning("tool call %r: arguments %r are not a JSON object; the chat template gets {}",
                        fn.get("name"), (args or "")[:80])
            parsed = {}
        fn["arguments"] = parsed
    return {**call, "function": fn}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None  # false: one tool call at most (OpenAI's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open: the reply continues it
    chat_template_kwargs: Optional[dict[str, Any]] = None  # more variables for the chat template
    echo: bool = False  # the reply starts with the last message's content when that message is the assistant's
    add_special_tokens: bool = False  # the tokenizer's special tokens on top of the chat template's (vLLM's)


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = None  # default: yes for a prompt, no for messages (as vLLM's)
    return_token_strs: bool = False  # the tokens' vocabulary strings beside their ids (vLLM's)


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRARequest(_Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # new weights for an adapter already loaded under lora_name


class UnloadLoRARequest(_Body):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
