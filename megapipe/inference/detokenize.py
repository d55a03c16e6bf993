"""Incremental detokenization and stop strings.

Text is decoded a token at a time the way vLLM and HF's streamers do it: the new text of a token is
``decode(ids[prefix:]) - decode(ids[prefix:read])`` over a short window, and a token whose bytes end in the middle
of a UTF-8 character yields nothing until the character completes. The window starts in the prompt's last tokens so
tokenizers that drop a leading space at the start of a decode (SentencePiece) still produce the right first word.

Stop strings are matched on the text, so one that spans several tokens is found; the text is cut before it. While a
sequence runs, its last ``len(longest stop) - 1`` characters are held back from the stable text, so a stream never
shows the beginning of a stop string that the next token completes.
"""

from __future__ import annotations

from typing import Optional, Sequence

PROMPT_CONTEXT = 5


def special_ids(tokenizer) -> frozenset[int]:
    hf = getattr(tokenizer, "_hf", None)  # megapipe's Tokenizer wraps an HF tokenizers object
    if hf is not None and hasattr(hf, "get_added_tokens_decoder"):
        return frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip: frozenset[int] = frozenset(),
                 stop: Sequence[str] = (), keep_stop: bool = False):
        self.tokenizer, self.skip = tokenizer, skip
        context = [t for t in prompt_ids[-PROMPT_CONTEXT:] if t not in skip]
        self.ids: list[int] = context
        self.prefix = 0
        self.read = len(context)
        self.text = ""
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # how far back a stop string may start
        # the text held back from a stream: a stop string's start may be cut; kept (include_stop_str_in_output) the
        # text up to its end stays, so nothing need wait (vLLM's too)
        self.lag = 0 if keep_stop else self.hold

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def add(self, token: int, final: bool = False) -> str:
        """Append a token; returns the new text (maybe empty while a character is incomplete)."""
        if token in self.skip:
            return self.flush() if final else ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            new = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += new
            return new
        return self.flush() if final else ""

    def flush(self) -> str:
        """Whatever bytes are still pending (an incomplete character at the very end)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        new = after[len(before):] if len(after) > len(before) else ""
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new

    def find_stop(self, new: str) -> Optional[tuple[int, str]]:
        """(index in text, stop string) of the first stop string that ends within the newest text."""
        if not self.stop or not new:
            return None
        start = max(0, len(self.text) - len(new) - self.hold)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def stop_at(self, hit: tuple[int, str], keep: bool) -> None:
        """End the text at stop string ``hit`` (find_stop's), before it or, ``keep``, after it."""
        self.text = self.text[:hit[0] + (len(hit[1]) if keep else 0)]

    def stable_text(self, finished: bool) -> str:
        if finished or self.lag == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.lag)]
