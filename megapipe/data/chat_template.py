"""Chat templates: which template renders a tokenizer's conversations, and the rendering itself. Every path that turns
messages into text goes through here (SFT records and ``data inspect-sft``, the server's chat routes, RL prompts,
the demos), so a model is served in the format it was trained on.

Which template (one rule for every path):

1. an explicit choice (``--chat-template``): ``chatml``, ``llama3`` or ``harmony`` (megapipe's own), the name of one
   of the tokenizer's named templates, or a ``FILE.jinja``;
2. else the tokenizer's template named ``default`` (a plain template counts as ``default``);
3. else its only template;
4. several named templates and none called ``default``: refused, in a sentence naming the tokenizer and the names,
   as transformers' ``apply_chat_template`` refuses them. Unlike transformers, a ``tool_use`` template is not
   switched to for conversations with tools: one template renders all of a run's conversations (name it to use it).

The tokenizer's templates are read as transformers reads them: ``chat_template.jinja`` (``default``) and
``additional_chat_templates/NAME.jinja`` when present, else tokenizer_config.json's ``chat_template`` (a string, or a
list of ``{"name", "template"}``); a legacy ``chat_template.json`` is the last resort.

Rendering is transformers' own (its sandboxed Jinja environment, helpers and message handling), with the tokenizer's
named special tokens as template variables and messages' None-valued keys dropped, as ``apply_chat_template`` does,
so the text is exactly what ``tokenizer.apply_chat_template(..., tokenize=False)`` returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megapipe.data.readers import first_line
from megapipe.data.tokenizer import tokenizer_files
from megapipe.errors import DataError

# Written for megapipe from the formats' published descriptions (ChatML; Meta's Llama 3 prompt format).
CHATML = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}{%- if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}{{ '# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{ '\\n<tool_call>\\n' + ((call.get('function') or call) | tojson) + '\\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:\\n' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + ((message['content'] or '') | trim) }}"
    "{%- for call in message.get('tool_calls') or [] %}{{ ((call.get('function') or call) | tojson) }}{%- endfor %}"
    "{{ '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# OpenAI's harmony format (GPT-OSS), written for megapipe from the harmony spec and the published gpt-oss template's
# format: the system message (identity, knowledge cutoff, reasoning effort medium, the valid channels; no "Current
# date" line, which the spec makes optional, so a conversation renders the same text every day), a system or developer
# first message as the developer's "# Instructions", tools as TypeScript signatures in the "functions" namespace
# (nested object parameters written `object`), tool calls on the commentary channel ending in <|call|>, tool results
# from "functions.NAME", answers on the final channel. Reasoning (``thinking`` or ``reasoning_content``) goes to the
# analysis channel for the messages after the last user message only (the current turn: earlier turns' reasoning is
# dropped, as the spec drops it once a final answer follows), on a final answer only when it is the conversation's
# last message; that last answer ends in <|return|> (the token the model stops on), every earlier one in <|end|>.
HARMONY_TOOL_TYPE = (
    "{%- macro ts_type(s) -%}"
    "{%- if s.get('enum') -%}{{ '\"' + s['enum'] | join('\" | \"') + '\"' }}"
    "{%- elif s.get('type') == 'array' -%}{{ (ts_type(s['items']) if s.get('items') else 'any') + '[]' }}"
    "{%- elif s.get('type') in ('number', 'integer') -%}number"
    "{%- elif s.get('type') in ('string', 'boolean', 'object') -%}{{ s['type'] }}"
    "{%- else -%}any{%- endif -%}{%- endmacro -%}"
)
HARMONY_TOOLS = (
    "{{- '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools %}{%- set f = tool.get('function') or tool %}"
    "{%- if f.get('description') %}{{- '// ' + f['description'] + '\\n' }}{%- endif %}"
    "{{- 'type ' + f['name'] + ' = ' }}{%- set props = (f.get('parameters') or {}).get('properties') %}"
    "{%- if props %}{{- '(_: {\\n' }}{%- for name, spec in props.items() %}"
    "{%- if spec.get('description') %}{{- '// ' + spec['description'] + '\\n' }}{%- endif %}"
    "{{- name + ('' if name in (f['parameters'].get('required') or []) else '?') + ': ' + ts_type(spec) }}"
    "{%- if spec.get('default') is not none %}"
    "{{- ', // default: ' + (spec['default'] | string if spec.get('enum') else spec['default'] | tojson) }}"
    "{%- endif %}{{- ',\\n' }}{%- endfor %}{{- '}) => any;\\n\\n' }}"
    "{%- else %}{{- '() => any;\\n\\n' }}{%- endif %}{%- endfor %}{{- '} // namespace functions' }}"
)
HARMONY = (
    HARMONY_TOOL_TYPE
    + "{%- set ns = namespace(last_user=-1, tool=none) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, final. Channel must "
    "be included for every message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}"
    "{%- endif %}{{- '<|end|>' }}"
    "{%- set instructions = messages[0]['content'] if messages and messages[0]['role'] in ('system', 'developer') "
    "else '' %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions + '\\n\\n' }}{%- endif %}"
    "{%- if tools %}" + HARMONY_TOOLS + "{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- set reasoning = m.get('thinking') or m.get('reasoning_content') %}"
    "{%- set last = loop.last and not add_generation_prompt %}"
    "{%- if loop.first and m['role'] in ('system', 'developer') %}"
    "{%- elif m['role'] == 'user' %}{{- '<|start|>user<|message|>' + m['content'] + '<|end|>' }}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{%- set reasoning = reasoning or m.get('content') %}"
    "{%- if reasoning and loop.index0 > ns.last_user %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' }}{%- endif %}"
    "{%- for call in m['tool_calls'] %}{%- set call = call.get('function') or call %}"
    "{%- set args = call.get('arguments') %}{%- set ns.tool = call['name'] %}"
    "{{- '<|start|>assistant to=functions.' + call['name'] + '<|channel|>commentary json<|message|>' }}"
    "{{- (args if args is string else (args or {}) | tojson) + '<|call|>' }}{%- endfor %}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- if reasoning and last %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + ('<|return|>' if last else '<|end|>') }}"
    "{%- elif m['role'] == 'tool' %}{%- set name = m.get('name') or ns.tool %}"
    "{%- if not name %}{{- raise_exception('a tool message follows no tool call') }}{%- endif %}"
    "{{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' + m['content'] + '<|end|>' }}"
    "{%- else %}{{- raise_exception('harmony has no role ' + m['role'] + ' after the first message') }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)


def join_parts(texts: list[str], images: bool) -> str:
    """A message's content parts as one string for the template: text parts on lines of their own, as vLLM joins
    them for templates that read a string; beside images (each part its model's markers) run together, as
    vision-language templates write parts themselves."""
    return ("" if images else "\n").join(texts)


HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_MARKERS = (*HARMONY_ENDS, "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>")
BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "harmony": HARMONY}
TEMPLATE_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"),
}
TEMPLATE_CHOICES = "chatml, llama3, harmony or a FILE.jinja"
OWN = "tokenizer"  # the name of a tokenizer's own template chosen by the rule, not by name
# The special tokens transformers gives a template as variables (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(DataError):
    """A template could not render a conversation, or refused it (its ``raise_exception``)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template's Jinja ``source``, the ``name`` it was chosen by (``tokenizer``, ``tokenizer:NAME``, ``chatml``,
    ``llama3`` or the file's path) and the tokenizer's special tokens it may use."""

    source: str
    name: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def trains_current_turn_only(self) -> bool:
        """Harmony renders the turns before the last user message as history (their reasoning dropped, an answer's
        <|return|> written <|end|>), so only the messages after it are trained as the model produced them."""
        return self.source == HARMONY

    @property
    def has_channels(self) -> bool:
        """Replies are harmony messages on channels, split by ``split_harmony`` (their special tokens kept)."""
        return self.source == HARMONY

    def render(self, messages: list[dict], tools: Optional[list] = None, add_generation_prompt: bool = False,
               continue_final_message: bool = False, variables: Optional[dict] = None) -> str:
        """The conversation as the template writes it; ``variables``: more of the template's variables (a request's
        chat_template_kwargs, e.g. Qwen3's ``enable_thinking``), which may not replace the ones set here."""
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other")
        variables = dict(variables or {})
        taken = sorted(set(variables) & ({"messages", "tools", "documents", "add_generation_prompt",
                                          "continue_final_message", "chat_template"} | set(self.special_tokens)))
        if taken:
            raise ChatTemplateError(f"chat_template_kwargs may not set {taken[0]!r}: the server sets it")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        # OpenAI's developer role is the system role to a template that does not name it (as vLLM's chat
        # renderer does): otherwise the template writes a role the model never saw and adds its default system prompt
        if "'developer'" not in self.source and '"developer"' not in self.source:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            texts, _ = render_jinja_template([messages], tools=tools, chat_template=self.source,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **self.special_tokens,
                                             **variables)
        except Exception as e:  # Jinja raises many types (undefined names, type errors); transformers ValueErrors
            if type(e) is TemplateError:  # what the template's raise_exception() raises
                raise ChatTemplateError(f"the chat template {self.name} refused the conversation: {e}") from None
            raise ChatTemplateError(f"the chat template {self.name} cannot render the conversation "
                                    f"({type(e).__name__}: {first_line(e)})") from None
        return texts[0]


def held(text: str, markers: tuple[str, ...]) -> int:
    """Where a tail of ``text`` that could be the start of one of ``markers`` begins (len(text) when none could): what
    a stream holds back until the next tokens tell (a marker may come in several tokens)."""
    for k in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return len(text)


def split_harmony(text: str, final: bool = True) -> tuple[str, Optional[str]]:
    """A harmony reply (what the model writes after the generation prompt ``<|start|>assistant``, special tokens
    kept) -> (its final channel's text, its analysis channel's text or None when it has none): the answer and the
    reasoning (an OpenAI-style server's content and reasoning_content). A message cut short counts up to where it
    stops; commentary (tool calls) is left out. Grows only by appending as the reply grows (streaming deltas; while
    not ``final`` a tail that may begin a marker is held back)."""
    content, reasoning = [], []
    for message in text.split("<|start|>"):
        header, found, body = message.partition("<|message|>")
        if not found:
            continue
        ended = False
        for end in HARMONY_ENDS:
            body, cut, _ = body.partition(end)
            ended = ended or bool(cut)
        if not (final or ended):
            body = body[:held(body, HARMONY_MARKERS)]
        channel = header.partition("<|channel|>")[2].split(" ", 1)[0]
        if channel == "final":
            content.append(body)
        elif channel == "analysis":
            reasoning.append(body)
    return "".join(content), "".join(reasoning) if reasoning else None


def load_chat_template(tokenizer: str | Path, choice: Optional[str] = None) -> Optional[ChatTemplate]:
    """The template to render ``tokenizer``'s conversations with (the module docstring's rule); None when ``choice``
    is None and the tokenizer has no template."""
    file, config = tokenizer_files(tokenizer)
    tokens = special_tokens(config)
    own = own_templates(file.parent, config)
    if choice is None:
        if not own:
            return None
        if "default" in own or len(own) == 1:
            return ChatTemplate(own["default"] if "default" in own else next(iter(own.values())), OWN, tokens)
        raise DataError(f"tokenizer {tokenizer} has several chat templates and none named 'default' "
                        f"({', '.join(sorted(own))}): choose one with --chat-template NAME, or name one 'default' in "
                        "its tokenizer_config.json")
    if choice in BUILTIN_TEMPLATES:
        _check_builtin_tokens(choice, file, tokenizer)
        return ChatTemplate(BUILTIN_TEMPLATES[choice], choice, tokens)
    if choice in own:
        return ChatTemplate(own[choice], f"{OWN}:{choice}", tokens)
    if "{{" in choice or "{%" in choice:  # the template itself, as vLLM's --chat-template also takes it
        _check_syntax(choice, "--chat-template")
        return ChatTemplate(choice, "--chat-template", tokens)
    path = Path(choice).expanduser()
    if not path.is_file():
        names = f", or one of tokenizer {tokenizer}'s templates: {', '.join(sorted(own))}" if own else ""
        raise DataError(f"--chat-template {choice!r} is neither a known template nor a file (use {TEMPLATE_CHOICES}"
                        f"{names})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {choice}: cannot read the file ({first_line(e)})") from None
    _check_syntax(text, str(path))
    return ChatTemplate(text, str(path.absolute()), tokens)


def own_templates(directory: Path, config: dict) -> dict[str, str]:
    """A tokenizer directory's chat templates by name (a single unnamed one is ``default``), read as transformers
    reads them: the .jinja files replace tokenizer_config.json's entry when there are any."""
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        files[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if files:
        return files
    value = config.get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    if not (isinstance(value, str) and value) and (directory / "chat_template.json").is_file():
        try:
            value = json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            value = None
    return {"default": value} if isinstance(value, str) and value else {}


def special_tokens(config: dict, names: tuple[str, ...] = SPECIAL_TOKEN_NAMES) -> dict[str, str]:
    """tokenizer_config.json's special tokens among ``names``, as strings (a token may be written as an object)."""
    out = {}
    for name in names:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def _check_builtin_tokens(choice: str, file: Path, tokenizer) -> None:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    missing = [t for t in TEMPLATE_TOKENS[choice] if t not in vocab]
    if missing:
        raise DataError(
            f"--chat-template {choice} needs the special token {missing[0]}, which tokenizer {tokenizer} does not "
            "have; use the tokenizer's own template or a FILE.jinja written for its tokens"
        )


def _check_syntax(text: str, where: str) -> None:
    """Compiled as transformers' renderer compiles it: a syntax error or an unknown filter or test (an assertion
    error of Jinja's compiler) fails here, not in every request."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError (an unknown filter) is one
        raise DataError(f"{where}:{e.lineno}: the chat template is not valid Jinja ({e.message})") from None
