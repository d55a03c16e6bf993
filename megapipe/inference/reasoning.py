"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reply's thinking as ``reasoning_content``, the rest as
``content``.

``deepseek_r1``: everything before ``</think>`` is reasoning (the ``<think>`` may be the generation prompt's, not
the reply's); a reply without ``</think>`` is all reasoning (it was cut short while thinking). ``qwen3``: only a reply
that opens with ``<think>`` has reasoning; one that does not is all content. GPT-OSS harmony's channels need no parser: the template says so (``split_harmony``).

``split(text, final)`` grows by appending as the reply grows: while streaming (not ``final``) a tail that may begin a
tag is held back, so sending the differences never shows half a tag.
"""

from __future__ import annotations

from typing import Optional

from megapipe.data.chat_template import held

START, END = "<think>", "</think>"


class ReasoningParser:
    """deepseek_r1's rule (the subclass changes where reasoning may be absent)."""

    needs_start = False

    def split(self, text: str, final: bool) -> tuple[Optional[str], str]:
        """(the reasoning, None when the reply has none; the content)."""
        body = text.lstrip()
        opened = body.startswith(START)
        if not (opened or final) and START.startswith(body):
            return None, ""  # the tag may be on its way
        if self.needs_start and not opened:
            return None, text
        if opened:
            body = body[len(START):]
        thinking, closed, content = body.partition(END)
        if closed:
            return thinking, content
        return (thinking if final else thinking[:held(thinking, (END,))]), ""  # cut short while thinking


class Qwen3ReasoningParser(ReasoningParser):
    needs_start = True


PARSERS = {"deepseek_r1": ReasoningParser, "qwen3": Qwen3ReasoningParser}


def reasoning_parser_for(name: Optional[str]) -> Optional[ReasoningParser]:
    from megapipe.inference.sampling import ParamError

    if name is None:
        return None
    if name not in PARSERS:
        raise ParamError("reasoning_parser", f"--reasoning-parser {name!r} is not one of {', '.join(PARSERS)}")
    return PARSERS[name]()
