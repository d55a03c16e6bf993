"""Structured outputs: a request's constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) compiled
with xgrammar against the engine's tokenizer, one matcher per sequence, and the token masks the sampler applies.

Compiled grammars are cached by constraint and compiled on a worker thread (the server awaits the compile before
queueing the request, so the engine thread only looks it up). An engine core process's front end has no model and
only parses (``Grammars()`` without tokenizer info: a bad constraint is still a 400 there); the core compiles, once.
Not compiled in the front end and shipped: xgrammar's ``CompiledGrammar.serialize_json`` / ``deserialize_json`` cost
about as much as compiling (49k-token vocabulary: compile 27 ms, serialise 16 ms, deserialise 16 ms, 93 kB; a parse
1.5 ms).

JSON is single-line by default (xgrammar's ``any_whitespace=False``: one space after ``,`` and ``:``, none
elsewhere), so even a weak model closes its object within a few tokens; ``any_whitespace=True`` gives the grammar's
free whitespace back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megapipe.inference.sampling import ParamError, greedy_ids

KINDS = ("json", "regex", "choice", "grammar")
ANY_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` (json: a JSON schema's text, regex, choice: a JSON list of the
    strings, grammar: EBNF), ``spec`` (its text; the cache key with the whitespace rule), and ``param``, the request
    field it came from (named in errors)."""

    kind: str
    spec: str
    any_whitespace: bool = False
    param: str = "response_format"

    @staticmethod
    def json_schema(schema: Any, param: str = "response_format", any_whitespace: bool = False) -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ParamError(param, f"{param}: the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ParamError(param, f"{param}: a JSON schema must be an object, not {type(schema).__name__}")
        for where, keyword in unenforced(schema):
            raise ParamError(param, f"{param}: the JSON schema's {keyword!r} (at {where}) is not enforced by the "
                                    f"grammar (xgrammar): the output could break it; leave it out of the schema")
        return Constraint("json", json.dumps(schema, ensure_ascii=False), any_whitespace, param)

    @staticmethod
    def choice(options: Any, param: str = "guided_choice") -> "Constraint":
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise ParamError(param, f"{param} must be a non-empty list of strings")
        return Constraint("choice", json.dumps(options, ensure_ascii=False), False, param)

    def grammar_text(self) -> str:
        """choice as EBNF: one string literal per option (JSON escapes are EBNF's)."""
        options = json.loads(self.spec)
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


# keywords xgrammar 0.2.9 compiles as if they were absent (tests/inference/test_structured.py checks each against the
# installed xgrammar): a schema that needs one would be answered with output that may not match it
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
            "additionalItems")


def unenforced(schema: Any, where: str = "#"):
    """(JSON pointer, keyword) of each keyword in ``schema`` and its subschemas that the grammar would not enforce:
    UNENFORCED, ``uniqueItems: true`` and an ``allOf`` of several schemas."""
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED:
        if keyword in schema:
            yield where, keyword
    if schema.get("uniqueItems") is True:
        yield where, "uniqueItems"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield where, "allOf"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from unenforced(sub, f"{where}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from unenforced(sub, f"{where}/{key}/{i}")
    for key in _SCHEMAS:
        yield from unenforced(schema.get(key), f"{where}/{key}")


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location (``[time] file.cc:123: ``)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n]: control characters (invalid in JSON)
# allowed, escapes not; its unbounded strings exclude all of U+0000..U+001F, as JSON does
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\"\\\0-\x1f]'


def json_grammar(schema: str, any_whitespace: bool) -> str:
    """The EBNF of a JSON schema (xgrammar's), its string characters those JSON allows."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return text.replace(_LOOSE_CHARS, _JSON_CHARS)


class Grammars:
    """Compiled grammars for one tokenizer, cached (LRU, ``cache_size``) and compiled on one worker thread; without
    ``info``, parsed grammars only (checked, nothing to match with)."""

    def __init__(self, info=None, cache_size: int = 512):
        import xgrammar as xgr

        self.info = info  # xgrammar's TokenizerInfo: each id's bytes, the stop ids
        self.compiler = xgr.GrammarCompiler(info, max_threads=1) if info is not None else None
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megapipe-grammar")

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> "Grammars":
        """Over a megapipe Tokenizer (or a transformers one); ids from the tokenizer's vocabulary to vocab_size (the
        model's, padding included) are never allowed."""
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = getattr(tokenizer, "_hf", None)
        fast = PreTrainedTokenizerFast(tokenizer_object=hf) if hf is not None else tokenizer
        return cls(xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=list(stop_ids)))

    def submit(self, c: Constraint) -> Future:
        """The compiled grammar of ``c`` as a future (done at once when cached; a failed compile is not kept)."""
        with self._lock:
            future = self._cache.get(c)
            if future is not None:
                self._cache.move_to_end(c)
                return future
            future = self._pool.submit(self._compile, c)
            self._cache[c] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is not None and self._forget(c, f))
        return future

    def compile(self, c: Constraint):
        return self.submit(c).result()

    def matcher(self, c: Constraint) -> "Matcher":
        return Matcher(self.compile(c))

    def _forget(self, c: Constraint, future: Future) -> None:
        with self._lock:
            if self._cache.get(c) is future:
                del self._cache[c]

    def _compile(self, c: Constraint):
        import xgrammar as xgr

        if c.kind not in KINDS:
            raise ParamError(c.param, f"{c.param}: unknown constraint kind {c.kind!r} (one of {', '.join(KINDS)})")
        try:
            if c.kind == "regex":
                grammar = xgr.Grammar.from_regex(c.spec)
            else:
                grammar = xgr.Grammar.from_ebnf(json_grammar(c.spec, c.any_whitespace) if c.kind == "json" else
                                                c.grammar_text() if c.kind == "choice" else c.spec)
            return grammar if self.compiler is None else self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]
            raise ParamError(c.param, f"{c.param}: the {what} cannot be compiled ({xgrammar_message(e)})") from None


class Matcher:
    """One sequence's place in its grammar: which tokens may come next, advanced with each accepted token."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @staticmethod
    def apply_masks(logits: torch.Tensor, rows: Sequence, in_place: bool = False) -> torch.Tensor:
        """fp32 logits [R, V] with -inf on each constrained row's (SampleRow.matcher) tokens its grammar does not allow
        next (a copy unless ``in_place``). A greedy row whose most likely token is allowed is left as it is: its argmax
        is the masked one, so most greedy steps of a model that follows the format cost no masking pass."""
        import xgrammar as xgr

        held = [i for i, r in enumerate(rows) if r.matcher is not None]
        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
        for i in held:
            rows[i].matcher.fill(bitmask, i)
        greedy = [i for i in held if rows[i].params.greedy]
        if greedy:
            top = greedy_ids(logits[greedy]).tolist()
            fine = {i for i, t in zip(greedy, top, strict=True) if int(bitmask[i, t // 32]) >> (t % 32) & 1}
            held = [i for i in held if i not in fine]
        if not held:
            return logits
        if not in_place:
            logits = logits.clone()
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=held)
        return logits
