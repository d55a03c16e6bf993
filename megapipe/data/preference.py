"""Preference pairs (TRL's shapes) -> a cached index of (prompt, chosen answer, rejected answer) token ids, and
the rows DPO trains on.

Records (JSONL / .gz / parquet / saved HF datasets, read as SFT records are: megapipe.data.sft.iter_records):

- ``{"prompt": str, "chosen": str, "rejected": str}``: plain text, an end-of-document token after each answer;
- ``{"chosen": [messages], "rejected": [messages]}``: two conversations sharing their first turns (the prompt, TRL's
  implicit prompt); the messages after the shared turns are the answers;
- ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``: the prompt turns given apart.

Conversations are rendered by the one chat template module (megapipe.data.sft.ChatEncoder, the tokens trained found
as in SFT: the answers' assistant turns). Each side is tokenized whole; the prompt is the longest common token
prefix of the two sides that precedes every trained token, so the ids are those the model sees at inference.

The store is the SFT store's format with three sequences per pair (prompt, chosen answer, rejected answer) in
``tokens`` and their trained masks in ``mask``, cached under a hash of what the tokens depend on; each pair's
optional ``margin`` field (a number, 0 when absent: the reward model's required margin) in ``margins.npy``.

Rows (``PreferenceSamples``): a pair is one row where the model takes packed documents: the prompt once (document
0), then each answer as its own document continuing the prompt (``prefix_ids`` 0, positions following the prompt's),
as RL's shared prompts; else two rows (prompt + chosen, prompt + rejected). ``side`` marks each label position: 1
chosen, 2 rejected (0 elsewhere); ``loss_mask`` the trained answer tokens. ``RewardSamples``: the same pairs as a
reward model reads them (whole sequences, no next-token shift), ``side`` at the one position each side's reward is
read (``score_position``), the pair's margin there on the chosen side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megapipe.data.indexed import IndexedDataset
from megapipe.data.sft import ChatEncoder, Example, _messages, _type
from megapipe.data.sft_dataset import (
    cache_root,
    cached_index,
    expand_sft_inputs,
    index_key,
    split_samples,
    write_index,
)
from megapipe.errors import DataError

SIDES = ("chosen", "rejected")


def parse_pair(record: Any, where: str) -> tuple[Example, Example]:
    """A decoded record -> (chosen, rejected) as SFT examples; a DataError names ``where`` and what is wrong."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: the record is a JSON {_type(record)}, not an object")
    for key in SIDES:
        if key not in record:
            have = ", ".join(sorted(record)) or "none"
            raise DataError(f"{where}: the record has no '{key}' (a preference pair needs 'chosen' and 'rejected', "
                            f"and 'prompt' unless they are conversations sharing their first turns; its keys: {have})")
    c, r, p = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(c, str) and isinstance(r, str):
        if not isinstance(p, str):
            raise DataError(f"{where}: 'chosen' and 'rejected' are strings, so 'prompt' must be one too (got "
                            f"{'nothing' if p is None else 'a ' + _type(p)})")
        for key, v in (("chosen", c), ("rejected", r)):
            if not v:
                raise DataError(f"{where}: '{key}' is empty")
        return Example("pair", where, prompt=p, completion=c), Example("pair", where, prompt=p, completion=r)
    if not (isinstance(c, list) and isinstance(r, list)):
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both lists of messages (got a "
                        f"{_type(c)} and a {_type(r)})")
    chosen, rejected = _messages(c, where, "chosen"), _messages(r, where, "rejected")
    if p is not None:
        if not isinstance(p, list):
            raise DataError(f"{where}: 'prompt' is a {_type(p)}, but 'chosen' and 'rejected' are messages: give the "
                            "prompt as messages too")
        prompt = _messages(p, where, "prompt")
    else:
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise DataError(f"{where}: 'chosen' and 'rejected' share no first turn and there is no 'prompt'")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    return _chat(prompt, chosen, where, "chosen"), _chat(prompt, rejected, where, "rejected")


def _chat(prompt: list[dict], answer: list[dict], where: str, side: str) -> Example:
    trained = [False] * len(prompt) + [m["role"] == "assistant" for m in answer]
    if not any(trained):
        raise DataError(f"{where}: '{side}' has no assistant message after the prompt")
    msgs = [{k: v for k, v in m.items() if k != "_weight"} for m in prompt + answer]
    return Example("chat", where, msgs, trained)


def parse_margin(record: dict, where: str) -> float:
    """A pair's optional ``margin`` (0 when absent): how far the chosen's reward must exceed the rejected's."""
    m = record.get("margin", 0.0)
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not np.isfinite(m):
        raise DataError(f"{where}: 'margin' is {m!r}, not a finite number")
    return float(m)


def score_position(ids: np.ndarray, pad_id: int) -> int:
    """Where a sequence's reward is read: its last token that is not the pad token (the rule of transformers'
    ``...ForSequenceClassification``), the last token when every one is the pad token."""
    keep = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(keep[-1]) if len(keep) else len(ids) - 1


def encode_pair(encoder: ChatEncoder, chosen: Example, rejected: Example):
    """(prompt ids, (chosen ids, trained), (rejected ids, trained)) of a pair."""
    (ci, cm), (ri, rm) = encoder.encode(chosen), encoder.encode(rejected)
    n = min(len(ci), len(ri))
    common = int(np.argmax(ci[:n] != ri[:n])) if (ci[:n] != ri[:n]).any() else n
    p = min(common, int(np.argmax(cm)) if cm.any() else len(ci), int(np.argmax(rm)) if rm.any() else len(ri))
    where = chosen.where
    if p == 0:
        raise DataError(f"{where}: the pair renders to no prompt token before its answers")
    for side, ids, mask in (("chosen", ci, cm), ("rejected", ri, rm)):
        if len(ids) == p or not mask[p:].any():
            raise DataError(f"{where}: the {side} answer renders to no token to train on")
    return ci[:p], (ci[p:], cm[p:]), (ri[p:], rm[p:])


# ----------------------------------------------------------------------------------------------- the index


@dataclass
class PreferenceIndex:
    path: Path
    tokens: IndexedDataset  # 3 sequences per pair: prompt, chosen answer, rejected answer
    mask: IndexedDataset
    meta: dict
    margins: np.ndarray  # [pairs] float32
    cache_hit: bool = False

    @property
    def num_pairs(self) -> int:
        return len(self.tokens) // 3


def prepare_preference_index(inputs: list[str], encoder: ChatEncoder, skip_bad: bool = False,
                             cache_dir: Optional[str] = None) -> PreferenceIndex:
    paths = expand_sft_inputs(inputs)
    key = {**index_key(paths, encoder, skip_bad), "kind": "preference", "fields": ["margin"]}

    def load(entry: Path, hit: bool) -> PreferenceIndex:
        import json

        return PreferenceIndex(entry, IndexedDataset(entry / "tokens"), IndexedDataset(entry / "mask"),
                               json.loads((entry / "meta.json").read_text()), np.load(entry / "margins.npy"), hit)

    return cached_index("dpo", key, cache_root(paths, cache_dir), cache_dir is not None,
                        lambda entry: _build(paths, encoder, skip_bad, entry, key), load)


def _build(paths: list[Path], encoder: ChatEncoder, skip_bad: bool, entry: Path, key: dict) -> None:
    """Three documents per pair: the prompt (nothing trained), the chosen and the rejected answer; the margins."""
    margins: list[float] = []
    last: list[float] = [0.0]

    def encode(record, where: str):
        prompt, chosen, rejected = encode_pair(encoder, *parse_pair(record, where))
        last[0] = parse_margin(record, where)
        return [(prompt, np.zeros(len(prompt), bool)), chosen, rejected]

    def extra(documents, out):
        if documents is None:
            np.save(out / "margins.npy", np.asarray(margins, dtype=np.float32))
        else:
            margins.append(last[0])

    write_index(paths, encoder, skip_bad, entry, key, "pairs", encode, extra=extra)


# ----------------------------------------------------------------------------------------------- rows


class PreferenceSamples:
    """The pairs ``pair_ids`` of an index as training samples of ``seq_length`` tokens (one packed row, or two rows
    with ``packed=False``: every array then has a leading dimension of 2). Answers too long are cut at the end
    (``overlong='truncate'``, the longer first) or the pair left out (``'drop'``); a pair whose prompt leaves no
    room, or whose cut answer keeps no trained token, is left out. Train samples are reshuffled every epoch."""

    shift = 1  # next-token rows: the prompt's last token is input only as each answer's first

    def __init__(self, index: PreferenceIndex, pair_ids: np.ndarray, seq_length: int, pad_id: int, packed: bool,
                 overlong: str, seed: int, num_samples: int, shuffle: bool, split_name: str = "train"):
        self.index, self.seq_length, self.pad_id, self.packed = index, seq_length, pad_id, packed
        self.seed, self.shuffle = seed, shuffle
        sizes = np.asarray(index.tokens.sizes, dtype=np.int64)
        self.kept: list[tuple[int, int, int]] = []  # (pair, chosen length, rejected length)
        self.truncated = self.dropped = 0
        for i in np.asarray(pair_ids).tolist():
            fit = self._fit(int(i), *sizes[3 * i: 3 * i + 3].tolist(), overlong)
            if fit is None:
                self.dropped += 1
            else:
                self.kept.append(fit)
        if not self.kept:
            raise DataError(f"the {split_name} split has no preference pair that fits --seq-length {seq_length} "
                            f"({len(pair_ids)} pairs, {self.dropped} left out); raise --seq-length or add data")
        self.per_epoch = len(self.kept)
        self.epochs = max(1, -(-num_samples // self.per_epoch)) if num_samples else 1
        self._order: tuple[int, np.ndarray] = (-1, np.arange(0))

    def _fit(self, i: int, p: int, a: int, b: int, overlong: str):
        budget = self.seq_length - (p - self.shift)
        if self.packed:
            if a + b <= budget:
                return i, a, b
            cut_a = min(a, max(budget - b, budget // 2))
            cut_b = min(b, budget - cut_a)
        else:
            if max(a, b) <= budget:
                return i, a, b
            cut_a, cut_b = min(a, budget), min(b, budget)
        if overlong == "drop" or cut_a < 1 or cut_b < 1:
            return None
        if not (self.index.mask.get(3 * i + 1, 0, cut_a).any() and self.index.mask.get(3 * i + 2, 0, cut_b).any()):
            return None
        self.truncated += 1
        return i, cut_a, cut_b

    def __len__(self) -> int:
        return self.per_epoch * self.epochs

    def row_of(self, i: int) -> int:
        epoch, j = divmod(i, self.per_epoch)
        if not self.shuffle:
            return j
        if self._order[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 3, epoch])))
            self._order = (epoch, rng.permutation(self.per_epoch))
        return int(self._order[1][j])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        return self.pair(self.row_of(i))

    def pair(self, r: int) -> dict[str, np.ndarray]:
        """Pair ``r`` of the epoch (before shuffling) as arrays."""
        i, a, b = self.kept[r]
        t, m = self.index.tokens, self.index.mask
        prompt = t.get(3 * i).astype(np.int64)
        answers = [(t.get(3 * i + 1, 0, a).astype(np.int64), m.get(3 * i + 1, 0, a).astype(bool)),
                   (t.get(3 * i + 2, 0, b).astype(np.int64), m.get(3 * i + 2, 0, b).astype(bool))]
        out = self._packed(prompt, answers) if self.packed else self._rows(prompt, answers)
        return self._with_margin(out, float(self.index.margins[i]))

    def _with_margin(self, out: dict, margin: float) -> dict:
        return out

    def _empty(self, shape) -> dict[str, np.ndarray]:
        return {"tokens": np.full(shape, self.pad_id, dtype=np.int64), "labels": np.full(shape, self.pad_id,
                dtype=np.int64), "loss_mask": np.zeros(shape, dtype=bool), "side": np.zeros(shape, dtype=np.int64)}

    def _packed(self, prompt, answers) -> dict[str, np.ndarray]:
        s, p = self.seq_length, len(prompt) - 1
        out = self._empty(s)
        out.update(document_ids=np.full(s, -1, dtype=np.int64), prefix_ids=np.full(s, -1, dtype=np.int64),
                   position_ids=np.zeros(s, dtype=np.int64))
        out["tokens"][:p], out["labels"][:p] = prompt[:-1], prompt[1:]
        out["document_ids"][:p] = out["prefix_ids"][:p] = 0
        out["position_ids"][:p] = np.arange(p)
        at = p
        for side, (ids, trained) in enumerate(answers, start=1):
            seg = slice(at, at + len(ids))
            out["tokens"][seg] = np.r_[prompt[-1], ids[:-1]]
            out["labels"][seg], out["loss_mask"][seg] = ids, trained
            out["side"][seg] = side
            out["document_ids"][seg], out["prefix_ids"][seg] = side, 0
            out["position_ids"][seg] = np.arange(p, p + len(ids))
            at += len(ids)
        return out

    def _rows(self, prompt, answers) -> dict[str, np.ndarray]:
        out = self._empty((2, self.seq_length))
        p = len(prompt)
        for r, (ids, trained) in enumerate(answers):
            seq = np.r_[prompt, ids]
            n = len(seq) - 1
            out["tokens"][r, :n], out["labels"][r, :n] = seq[:-1], seq[1:]
            out["loss_mask"][r, p - 1: n] = trained
            out["side"][r, p - 1: n] = r + 1
        return out


class RewardSamples(PreferenceSamples):
    """The pairs as a reward model reads them: each side the whole sequence (prompt + answer, no next-token shift;
    packed: the prompt once, then each answer as a document continuing it), ``side`` / ``loss_mask`` at the one
    position per side the reward is read (``score_position``), ``margin`` the pair's margin at the chosen's."""

    shift = 0

    def _empty(self, shape) -> dict[str, np.ndarray]:
        return {**super()._empty(shape), "margin": np.zeros(shape, dtype=np.float32)}

    def _read_at(self, out: dict, at, ids: np.ndarray, offset: int, side: int) -> None:
        out["side"][at + (offset + score_position(ids, self.pad_id),)] = side

    def _packed(self, prompt, answers) -> dict[str, np.ndarray]:
        s, p = self.seq_length, len(prompt)
        out = self._empty(s)
        out.update(document_ids=np.full(s, -1, dtype=np.int64), prefix_ids=np.full(s, -1, dtype=np.int64),
                   position_ids=np.zeros(s, dtype=np.int64))
        out["tokens"][:p] = prompt
        out["document_ids"][:p] = out["prefix_ids"][:p] = 0
        out["position_ids"][:p] = np.arange(p)
        at = p
        for side, (ids, _) in enumerate(answers, start=1):
            seg = slice(at, at + len(ids))
            out["tokens"][seg] = ids
            out["document_ids"][seg], out["prefix_ids"][seg] = side, 0
            out["position_ids"][seg] = np.arange(p, p + len(ids))
            self._read_at(out, (), ids, at, side)
            at += len(ids)
        return self._finish(out)

    def _rows(self, prompt, answers) -> dict[str, np.ndarray]:
        out = self._empty((2, self.seq_length))
        for r, (ids, _) in enumerate(answers):
            seq = np.r_[prompt, ids]
            out["tokens"][r, :len(seq)] = seq
            self._read_at(out, (r,), seq, 0, r + 1)
        return self._finish(out)

    @staticmethod
    def _finish(out: dict) -> dict:
        out["labels"] = out["tokens"].copy()  # unused: a reward model has no next-token target
        out["loss_mask"] = out["side"] > 0
        return out

    def _with_margin(self, out: dict, margin: float) -> dict:
        out["margin"][out["side"] == 1] = margin
        return out


def build_preference_datasets(index: PreferenceIndex, split: str, seq_length: int, num_samples: dict[str, int],
                              seed: int, packed: bool, overlong: str, pad_id: int,
                              samples: type = PreferenceSamples) -> dict:
    """Train / valid ``samples`` (PreferenceSamples, RewardSamples) of the pairs (``split_samples``)."""
    return split_samples(index.num_pairs, "preference data", split, num_samples, lambda ids, wanted, name:
                         samples(index, ids, seq_length, pad_id, packed, overlong, seed, wanted,
                                 shuffle=name == "train", split_name=name))
