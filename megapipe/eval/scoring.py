"""Scoring token sequences on the inference engine: the log-likelihood of each sequence's last tokens.

The same path as the server's ``echo`` + ``max_tokens: 0`` scoring: a request with ``prompt_logprobs`` returns, for
every prompt token after the first, its log-probability under the model given the tokens before it (the raw
distribution: no temperature, no truncation). The engine feeds every prompt token and keeps one generation slot, so a
sequence may hold at most ``engine.max_model_len - 1`` tokens; the one sampled token is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megapipe.errors import MegapipeError
from megapipe.inference import SamplingParams


@dataclass
class Score:
    logprob: float  # sum over the scored tokens
    greedy: bool  # every scored token was the model's argmax
    token_logprobs: list[float]


def max_scored_len(engine) -> int:
    """The longest sequence (context + scored tokens) the engine can score."""
    return engine.max_model_len - 1


def score(engine, sequences: Sequence[Sequence[int]], num_scored: Sequence[int], batch_size: int = 64,
          progress: Optional[Callable[[int], None]] = None) -> list[Score]:
    """For each token sequence, the log-likelihood of its last ``num_scored[i]`` tokens given the tokens before them.

    Sequences go to the engine ``batch_size`` at a time (it batches them continuously); ``progress(n)`` is called
    after each group with the number just scored.
    """
    limit = max_scored_len(engine)
    for i, (seq, n) in enumerate(zip(sequences, num_scored, strict=True)):
        if not 1 <= n < len(seq):
            raise MegapipeError(f"sequence {i}: {n} tokens to score of {len(seq)} (at least one context token needed)")
        if len(seq) > limit:
            raise MegapipeError(f"sequence {i} holds {len(seq)} tokens; the engine scores at most {limit} "
                                f"(--max-model-len {engine.max_model_len} - 1)")
    # each scored token's rank tells whether it was the argmax; temperature 0: the one sampled token is free
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out: list[Score] = []
    for start in range(0, len(sequences), batch_size):
        group = [list(s) for s in sequences[start:start + batch_size]]
        for seq, n, result in zip(group, num_scored[start:start + batch_size], engine.generate(group, params),
                                  strict=True):
            entries = result.prompt_logprobs[len(seq) - n:]
            lps = [lp for lp, _, _ in entries]
            greedy = all(rank == 1 for _, _, rank in entries)
            out.append(Score(float(sum(lps)), greedy, lps))
        if progress is not None:
            progress(len(group))
    return out
