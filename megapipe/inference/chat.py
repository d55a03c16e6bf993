"""Chat templates: the tokenizer's own Jinja template (tokenizer_config.json ``chat_template`` or
chat_template.jinja), rendered in a sandbox with the variables and helpers Hugging Face templates expect."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from megapipe.inference.sampling import ParamError


class ChatTemplate:
    def __init__(self, source: str, bos_token: Optional[str] = None, eos_token: Optional[str] = None):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ParamError("messages", f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                    ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_tokenizer_dir(cls, directory: Optional[Path]) -> Optional["ChatTemplate"]:
        if directory is None:
            return None
        directory = Path(directory)
        if directory.is_file():
            directory = directory.parent
        config = {}
        if (directory / "tokenizer_config.json").is_file():
            try:
                config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
            except ValueError:
                config = {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source and (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        if not source and (directory / "chat_template.json").is_file():
            source = json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        if not source:
            return None

        def token(name):
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value

        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise ParamError("messages", f"the chat template could not render the messages ({e})") from None
