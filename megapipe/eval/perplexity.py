"""The built-in ``perplexity`` task: token-level loss of a model on megapipe ``.bin/.idx`` data (``--data-path``).

The documents of a prefix are read as one token stream (as pretraining sees them, EOD tokens included) and cut into
windows of ``seq_length + 1`` tokens that overlap by one, Megatron's evaluation windows: window i predicts tokens
``i*S+1 .. (i+1)*S`` from the tokens of the window before them, so every token but the first is predicted exactly
once; a last, shorter window predicts the rest. Scored on the engine (megapipe.eval.scoring), like every lm-eval task.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from megapipe.data.indexed import IndexedDataset
from megapipe.data.sidecar import check_data_tokenizer
from megapipe.errors import DataError, MegapipeError
from megapipe.eval.scoring import max_scored_len, score


def window_count(num_tokens: int, seq_length: int) -> int:
    return max(0, -(-(num_tokens - 1) // seq_length))


def read_windows(prefix: str, seq_length: int, limit: Optional[float], vocab_size: int) -> list[list[int]]:
    """The scoring windows of ``prefix`` (all, the first ``limit`` ones, or that fraction of them when < 1)."""
    data = IndexedDataset(prefix)
    total = window_count(data.num_tokens, seq_length)
    if total == 0:
        raise DataError(f"--data-path {prefix} holds {data.num_tokens} token(s): nothing to predict")
    want = total if limit is None else min(total, int(limit * total) if limit < 1 else int(limit))
    need = want * seq_length + 1
    chunks, have = [], 0
    for i in range(len(data)):
        chunks.append(np.asarray(data[i], dtype=np.int64)[: need - have])
        have += len(chunks[-1])
        if have >= need:
            break
    stream = np.concatenate(chunks)
    top = int(stream.max())
    if top >= vocab_size:
        raise DataError(f"--data-path {prefix} holds token id {top} but the model has {vocab_size} ids: it was "
                        "tokenized with another tokenizer")
    ids = stream.tolist()
    return [ids[s: s + seq_length + 1] for s in range(0, want * seq_length, seq_length)]


def data_perplexity(engine, prefixes: Sequence[str], seq_length: Optional[int] = None, limit: Optional[float] = None,
                    batch_size: int = 16, check_tokenizer: bool = True,
                    progress: Optional[Callable[[int], None]] = None) -> dict[str, dict]:
    """{name: {"ppl", "loss", "tokens", "windows"}}: one entry per prefix ("perplexity" alone for one prefix; with
    several, "perplexity" pools their tokens and "perplexity:<prefix>" holds each)."""
    if not prefixes:
        raise MegapipeError("the perplexity task needs --data-path PREFIX (a .bin/.idx pair)")
    longest = max_scored_len(engine) - 1
    seq_length = longest if seq_length is None else seq_length
    if not isinstance(seq_length, int) or not 1 <= seq_length <= longest:
        raise MegapipeError(f"--seq-length = {seq_length} must be within [1, {longest}] (the engine's max_model_len "
                            f"{engine.max_model_len} - 2)")
    if check_tokenizer and engine.tokenizer is not None:
        check_data_tokenizer(prefixes, engine.tokenizer, hint="or evaluate the checkpoint the data was made for "
                             "(--allow-tokenizer-mismatch to score it anyway)")
    per_prefix = {}
    for prefix in prefixes:
        windows = read_windows(str(prefix), seq_length, limit, engine.vocab_size)
        scores = score(engine, windows, [len(w) - 1 for w in windows], batch_size, progress)
        nll, tokens = -sum(s.logprob for s in scores), sum(len(w) - 1 for w in windows)
        per_prefix[str(prefix)] = (nll, tokens, len(windows))

    def entry(nll: float, tokens: int, count: int) -> dict:
        return {"ppl": math.exp(nll / tokens), "loss": nll / tokens, "tokens": tokens, "windows": count,
                "seq_length": seq_length}

    out = {"perplexity": entry(*map(sum, zip(*per_prefix.values(), strict=True)))}
    if len(per_prefix) > 1:
        out.update({f"perplexity:{p}": entry(*v) for p, v in per_prefix.items()})
    return out
