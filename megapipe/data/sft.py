"""SFT records -> token ids + a per-token loss mask.

Records come from JSONL (also .gz), parquet or saved Hugging Face datasets, one of three shapes:

- ``{"messages": [{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": ...}, ...], "tools": [...]}``
  (OpenAI style; ``tool_calls``, ``name``, ``tool_call_id`` and other message keys go to the template as they are;
  an assistant message with ``"weight": 0`` is shown but not trained on, as in OpenAI's fine-tuning format);
- ``{"prompt": ..., "completion": ...}``: two strings (plain text, no template; an end-of-document token follows
  the completion) or two message lists (a conversation whose completion messages are trained on);
- ``{"text": ...}``: every token is trained on, an end-of-document token appended.

A conversation is rendered by a chat template (megapipe.data.chat_template: the tokenizer's own, ``chatml``,
``llama3``, ``harmony``, one of the tokenizer's named templates or a ``.jinja`` file) into one text, which is
tokenized once.
The tokens trained on are found from the rendered text itself: message i's span runs from the end of the
conversation rendered up to message i with the generation prompt to the end of the conversation rendered up to and
including message i (so the template's end-of-turn token is trained: the model learns to stop), and a token is
trained when its character offsets overlap a span. Fragments are never tokenized apart, so the ids are exactly those
the model sees when the conversation is rendered for inference. Under the harmony template (GPT-OSS) only the
messages after the last user message are trained: earlier turns are rendered as history, not as the model wrote
them.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from megapipe.data.chat_template import (
    TEMPLATE_CHOICES,
    ChatTemplateError,
    join_parts,
    load_chat_template,
    special_tokens,
)
from megapipe.data.readers import JSON_TYPES, JSONL_SUFFIXES, JSONRecordError, first_line, load_json_record
from megapipe.data.tokenizer import load_tokenizer, tokenizer_files
from megapipe.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
# where an image part of a message stood; the encoder writes the model's image markers there
IMAGE_PART = "<|megapipe:image|>"
TRAINED_ROLES = ("assistant",)


class NoChatTemplate(DataError):
    """A conversation met a tokenizer without a chat template: a setup mistake, not a bad record to skip."""


# ----------------------------------------------------------------------------------------------- records


@dataclass
class Example:
    """One record, checked. ``kind``: chat (messages + which are trained), pair (prompt/completion strings), text."""

    kind: str
    where: str  # file:line
    messages: list[dict] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    tools: Optional[list] = None
    prompt: str = ""
    completion: str = ""
    text: str = ""
    images: list = field(default_factory=list)  # image sources (paths, data: URLs) in the order they appear


def _type(value) -> str:
    return JSON_TYPES.get(type(value), type(value).__name__)


def _image_source(part: dict):
    """The path or URL of an image part (OpenAI's image_url, HF's image), None for another part."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if part.get("type") == "image":
        return part.get("image", part.get("url", part.get("path")))
    return None


def _content(value, where: str, key: str, images: Optional[list] = None):
    """Message content: a string, or a list of text parts (joined) and, where ``images`` collects their sources,
    image parts (IMAGE_PART in the text); None only where the caller allows it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            is_dict = isinstance(part, dict)
            if is_dict and part.get("type") in ("image_url", "image") and images is not None:
                source = _image_source(part)
                if not isinstance(source, str) or not source:
                    raise DataError(f"{where}: {key}[{i}] is an image part without a path or URL string")
                images.append(source)
                parts.append(IMAGE_PART)
                continue
            if not (is_dict and part.get("type") == "text" and isinstance(part.get("text"), str)):
                allowed = "text and image parts" if images is not None else "only text content"
                raise DataError(f"{where}: {key}[{i}] is not a text part ({{'type': 'text', 'text': ...}}); "
                                f"{allowed} are supported here")
            parts.append(part["text"])
        return join_parts(parts, IMAGE_PART in parts)
    raise DataError(f"{where}: {key} is a {_type(value)}, not a string")


def _messages(value, where: str, key: str, images: Optional[list] = None) -> list[dict]:
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else f"a {_type(value)}"
        raise DataError(f"{where}: '{key}' is {what}, not a list of messages")
    out = []
    for i, m in enumerate(value):
        k = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: {k} is a {_type(m)}, not a message object")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: {k}.role = {role!r} is not one of {', '.join(ROLES)}")
        msg = dict(m)
        msg["content"] = _content(m.get("content"), where, f"{k}.content", images if role == "user" else None)
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise DataError(f"{where}: {k}.tool_calls is not a list of objects")
        if msg["content"] is None and not (role == "assistant" and calls):
            raise DataError(f"{where}: {k} has no 'content' (only an assistant message with tool_calls may omit it)")
        weight = m.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise DataError(f"{where}: {k}.weight = {weight!r} must be 0 or 1")
        if "weight" in msg:
            del msg["weight"]
            if role not in TRAINED_ROLES:
                raise DataError(f"{where}: {k}.weight is only meaningful on assistant messages")
        msg["_weight"] = weight
        out.append(msg)
    return out


def _without_weights(msgs: list[dict]) -> list[dict]:
    for m in msgs:
        m.pop("_weight", None)
    return msgs


def parse_record(record: Any, where: str) -> Example:
    """A decoded record -> Example; a DataError names ``where`` (file:line) and what is wrong."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: the record is a JSON {_type(record)}, not an object")
    images: list = []
    if "messages" in record:
        msgs = _messages(record["messages"], where, "messages", images)
        trained = [m["role"] in TRAINED_ROLES and m["_weight"] == 1 for m in msgs]
        _without_weights(msgs)
        if not any(trained):
            raise DataError(f"{where}: the conversation has no assistant message to train on")
        return Example("chat", where, msgs, trained, _tools(record.get("tools"), where), images=images)
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise DataError(f"{where}: the record has '{'prompt' if key == 'completion' else 'completion'}' "
                                f"but no '{key}'")
        p, c = record["prompt"], record["completion"]
        if isinstance(p, str) and isinstance(c, str):
            if not c:
                raise DataError(f"{where}: 'completion' is empty: there is nothing to train on")
            return Example("pair", where, prompt=p, completion=c)
        if isinstance(p, list) and isinstance(c, list):
            msgs = _without_weights(_messages(p, where, "prompt", images) + _messages(c, where, "completion"))
            trained = [False] * len(p) + [True] * len(c)
            return Example("chat", where, msgs, trained, _tools(record.get("tools"), where), images=images)
        raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages "
                        f"(got a {_type(p)} and a {_type(c)})")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' is a {_type(record['text'])}, not a string")
        if not record["text"]:
            raise DataError(f"{where}: 'text' is empty")
        return Example("text", where, text=record["text"])
    have = ", ".join(sorted(record)) or "none"
    raise DataError(f"{where}: the record has no 'messages', 'prompt'/'completion' or 'text' key (its keys: {have})")


def _tools(value, where: str) -> Optional[list]:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: 'tools' is not a list of objects")
    return value


# ----------------------------------------------------------------------------------------------- reading


def input_identity(paths: list[Path]) -> list:
    """What a cache key needs to notice a changed input: path, size, mtime, inode (of every file of a directory)."""
    out = []
    for p in paths:
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(file:line or file row N, decoded record) of one input; undecodable lines yield a DataError as the record."""
    name = path.name.lower()
    if name.removesuffix(".gz").endswith(JSONL_SUFFIXES):
        yield from _jsonl_records(path)
    elif name.endswith(".parquet"):
        yield from _parquet_records(path)
    else:
        yield from _datasets_records(path)


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        opener = gzip.open if path.name.lower().endswith(".gz") else open
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                where = f"{path}:{number}"
                if not raw.strip():
                    continue
                try:
                    yield where, load_json_record(raw.decode("utf-8"))
                except JSONRecordError as e:
                    yield where, DataError(f"{where}: the record {e}")
                except UnicodeDecodeError as e:
                    yield where, DataError(f"{where}: the record is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                           f"offset {e.start})")
                except json.JSONDecodeError as e:
                    yield where, DataError(f"{where}: the record is not valid JSON ({e.msg} at column {e.colno})")
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read input file {path} ({e})") from None


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{path} row {row}", _drop_nulls(record)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read input file {path} as parquet ({first_line(e)})") from None


def _datasets_records(path: Path) -> Iterator[tuple[str, Any]]:
    """A ``save_to_disk`` directory (a DatasetDict: its train split)."""
    import os

    import datasets

    if not path.is_dir():
        raise DataError(f"input {path} is not JSONL (.jsonl/.json/.ndjson, optionally .gz), parquet or a saved "
                        "Hugging Face dataset directory")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types for "cannot load this"
        raise DataError(f"cannot load input {path} with Hugging Face datasets ({first_line(e)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds and len(ds) != 1:
            raise DataError(f"input {path} holds splits {', '.join(sorted(ds))}; save the one to train on alone")
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    for row, record in enumerate(ds, 1):
        yield f"{path} row {row}", _drop_nulls(record)


def _drop_nulls(record: dict) -> dict:
    """Tables give every row every column (None where a record had none): drop those, so shapes are detected as in
    JSONL (also inside messages, where a struct column adds keys that other messages had)."""
    out = {k: v for k, v in record.items() if v is not None}
    for key in ("messages", "prompt", "completion"):
        if isinstance(out.get(key), list):
            out[key] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in out[key]]
    return out


# ----------------------------------------------------------------------------------------------- encoding


class ChatEncoder:
    """Renders and tokenizes records: ``encode(example) -> (ids int64 [n], trained bool [n])`` where ``trained[t]``
    says whether token t is a target the loss counts."""

    def __init__(self, tokenizer_path: str | Path, chat_template: Optional[str] = None, train_on_prompt: bool = False,
                 image_text: Optional[str] = None):
        from transformers import PreTrainedTokenizerFast

        file, config = tokenizer_files(tokenizer_path)
        specials = special_tokens(config, ("bos_token", "eos_token", "unk_token", "pad_token"))
        self.hf = PreTrainedTokenizerFast(tokenizer_file=str(file), **specials)
        self.tokenizer_sha = hashlib.sha256(file.read_bytes()).hexdigest()
        self.tokenizer_path = Path(tokenizer_path)
        self.vocab = self.hf.get_vocab()
        self.chat = load_chat_template(tokenizer_path, chat_template)
        self.template_option = chat_template
        self.train_on_prompt = train_on_prompt
        self.eod_id = load_tokenizer(tokenizer_path).eod_id
        self.image_text = image_text  # a vision-language model's markers of one image; None: text only

    @property
    def template(self) -> Optional[str]:
        return self.chat.source if self.chat is not None else None

    @property
    def template_name(self) -> str:
        return self.chat.name if self.chat is not None else "none"

    @property
    def template_sha(self) -> Optional[str]:
        return hashlib.sha256(self.template.encode()).hexdigest() if self.template is not None else None

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False, where: str = "") -> str:
        if self.chat is None:
            raise NoChatTemplate(
                f"{where + ': ' if where else ''}tokenizer {self.tokenizer_path} has no chat template: pass "
                f"--chat-template {TEMPLATE_CHOICES}"
            )
        try:
            return self.chat.render(messages, tools, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as e:
            raise DataError(f"{where}: {e}") from None

    def spans(self, ex: Example) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its trained messages."""
        full = self.render(ex.messages, ex.tools, where=ex.where)
        spans, trained_flags = [], ex.trained
        if self.chat.trains_current_turn_only:
            last_user = max((i for i, m in enumerate(ex.messages) if m.get("role") == "user"), default=-1)
            trained_flags = [t and i > last_user for i, t in enumerate(trained_flags)]
        for i, trained in enumerate(trained_flags):
            if not trained:
                continue
            before = self.render(ex.messages[:i], ex.tools, add_generation_prompt=True, where=ex.where) if i else ""
            upto = self.render(ex.messages[: i + 1], ex.tools, where=ex.where)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError(
                    f"{ex.where}: the chat template {self.template_name} does not render this conversation turn by "
                    f"turn (the text up to message {i} changes once later messages follow), so its assistant tokens "
                    f"cannot be located; use a template that renders each turn alike (--chat-template "
                    f"{TEMPLATE_CHOICES})"
                )
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return full, spans

    def _with_image_markers(self, ex: Example) -> Example:
        if not ex.images:
            return ex
        if self.image_text is None:
            raise DataError(f"{ex.where}: the record holds {len(ex.images)} image(s) but the model takes text only")
        msgs = [dict(m, content=m["content"].replace(IMAGE_PART, self.image_text)) if isinstance(m.get("content"), str)
                else m for m in ex.messages]
        return replace(ex, messages=msgs)

    def encode(self, ex: Example) -> tuple[np.ndarray, np.ndarray]:
        _, ids, _, trained = self.encode_detailed(ex)
        return ids, trained

    def encode_detailed(self, ex: Example) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
        """(rendered text, ids, character offsets [n, 2] into the text, trained); an appended end-of-document
        token has the empty offset (len(text), len(text))."""
        if ex.kind == "text":
            text, spans, eod = ex.text, [(0, len(ex.text))], True
        elif ex.kind == "pair":
            text = ex.prompt + ex.completion
            spans, eod = [(len(ex.prompt), len(text))], True
        else:
            (text, spans), eod = self.spans(self._with_image_markers(ex)), False
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        trained = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trained |= (offsets[:, 1] > lo) & (offsets[:, 0] < hi)
        if eod:
            if self.eod_id is None:
                raise DataError(f"{ex.where}: a {ex.kind} record ends with the end-of-document token, but tokenizer "
                                f"{self.tokenizer_path} has none")
            ids = np.append(ids, self.eod_id)
            offsets = np.concatenate([offsets, [[len(text), len(text)]]])
            trained = np.append(trained, True)
        if self.train_on_prompt:
            trained[:] = True
        return text, ids, offsets, trained
