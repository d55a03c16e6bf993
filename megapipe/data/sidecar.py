"""What made a ``.bin/.idx`` pair: ``PREFIX.megapipe.json`` beside it, naming the tokenizer (by a fingerprint of what
it does) and how the data was written.

Megatron's reader opens only ``PREFIX.bin`` and ``PREFIX.idx``, so the sidecar changes nothing for it, and a pair
without one (made by Megatron's tools) reads as before, with its tokenizer unknown. The sidecar records the sizes of
the pair it describes: one that no longer matches them (the pair was rewritten by another tool) is ignored.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from megapipe.data.paths import bin_path, idx_path
from megapipe.errors import DataError
from megapipe.fileio import write_bytes_atomic

log = logging.getLogger(__name__)

SUFFIX = ".megapipe.json"
FORMAT = "megapipe-dataset"
VERSION = 1


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def tokenizer_record(tokenizer) -> dict:
    """What the sidecar says about a loaded :class:`~megapipe.data.tokenizer.Tokenizer`."""
    return {"fingerprint": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id,
            "source": str(Path(tokenizer.path).absolute())}


def write_sidecar(prefix: str | Path, record: dict) -> None:
    """Write the sidecar of the (already renamed into place) pair at ``prefix``, with the pair's sizes."""
    body = {"format": FORMAT, "version": VERSION, **record,
            "bin_bytes": bin_path(prefix).stat().st_size, "idx_bytes": idx_path(prefix).stat().st_size}
    write_bytes_atomic(sidecar_path(prefix), (json.dumps(body, indent=2, ensure_ascii=False) + "\n").encode())


def remove_sidecar(prefix: str | Path) -> None:
    try:
        os.unlink(sidecar_path(prefix))
    except FileNotFoundError:
        pass


def read_sidecar(prefix: str | Path) -> Optional[dict]:
    """The sidecar of ``prefix``; None when there is none or it describes other files than the pair now there."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete it if the dataset was rewritten by another tool") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise DataError(f"{path} is not a megapipe dataset sidecar (no \"format\": \"{FORMAT}\")")
    sizes = (bin_path(prefix).stat().st_size if bin_path(prefix).is_file() else None,
             idx_path(prefix).stat().st_size if idx_path(prefix).is_file() else None)
    if sizes != (body.get("bin_bytes"), body.get("idx_bytes")):
        log.warning("warning: %s describes other files than %s.bin/.idx now (rewritten by another tool?): ignored",
                    path, prefix)
        return None
    return body


def recorded_tokenizer(prefix: str | Path) -> Optional[dict]:
    body = read_sidecar(prefix)
    tok = body.get("tokenizer") if body else None
    return tok if isinstance(tok, dict) and tok.get("fingerprint") else None


def describe(tok: dict) -> str:
    return f"{tok.get('source', '?')} ({tok.get('vocab_size', '?')} tokens)"


def check_data_tokenizer(prefixes: Sequence[str | Path], tokenizer,
                         hint: str = "or pass --allow-tokenizer-mismatch to use it anyway") -> list[str]:
    """Refuse data tokenized with another tokenizer than ``tokenizer`` (a loaded Tokenizer): a DataError naming the
    prefix and both tokenizers, ending with ``hint``. Returns the prefixes whose tokenizer is not recorded
    (Megatron-made data), for a warning."""
    unknown = []
    mine = tokenizer.fingerprint
    for prefix in prefixes:
        tok = recorded_tokenizer(prefix)
        if tok is None:
            unknown.append(str(prefix))
        elif tok["fingerprint"] != mine:
            raise DataError(
                f"data {prefix} was tokenized with tokenizer {describe(tok)}, not with {tokenizer.path} "
                f"({tokenizer.vocab_size} tokens): its token ids mean other text; re-run preprocess with "
                f"{tokenizer.path}, {hint}"
            )
    return unknown


def merged_tokenizer(prefixes: Sequence[str], allow_mixed: bool) -> Optional[dict]:
    """The tokenizer record for a merge of ``prefixes``: theirs when they share one; None when some are unknown or
    (with ``allow_mixed``) they differ; a DataError when they differ otherwise."""
    records = {str(p): recorded_tokenizer(p) for p in prefixes}
    known = {p: t for p, t in records.items() if t is not None}
    prints = {t["fingerprint"] for t in known.values()}
    if len(prints) > 1 and not allow_mixed:
        a, ta = next(iter(known.items()))
        b, tb = next((p, t) for p, t in known.items() if t["fingerprint"] != ta["fingerprint"])
        raise DataError(
            f"cannot merge {b} with {a}: {b} was tokenized with {describe(tb)}, {a} with {describe(ta)}, so the "
            "same id would mean different text; re-tokenize one of them, or pass --allow-mixed-tokenizers"
        )
    unknown = [p for p, t in records.items() if t is None]
    if unknown and known:
        log.warning("warning: the tokenizer of %s is not recorded (no %s sidecar): the merge records none",
                    ", ".join(unknown), SUFFIX)
    if len(prints) == 1 and not unknown:
        return next(iter(known.values()))
    return None
