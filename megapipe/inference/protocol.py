"""OpenAI request bodies (plus vLLM's extra sampling fields) as pydantic models, and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from megapipe.inference.sampling import ParamError, SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    model: str
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
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int] = None) -> SamplingParams:
        if self.logit_bias:
            raise ParamError("logit_bias", "logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None

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
        """The message for the chat template: text parts joined, each image part as ``image_text`` (the model's
        image markers, as Qwen2-VL's template writes them), which is None for a model that takes text only."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind == "image_url" and image_text is not None:
                    texts.append(image_text)
                elif kind != "text":
                    allowed = "'text' and 'image_url'" if image_text is not None else "only 'text'"
                    raise ParamError("messages", f"content part of type {kind!r} is not supported ({allowed})")
                else:
                    texts.append(str(part.get("text", "")))
            content = "".join(texts)
        out = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict] = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRARequest(_Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(_Body):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
