"""Per-request sampling parameters and the batched sampler.

Order of the logits processors (the one vLLM and HF apply): repetition / frequency / presence penalties on the raw
logits, ``min_tokens`` suppression of EOS and stop ids, then temperature, top-k, top-p and min-p on the tempered
distribution. Greedy (temperature 0) takes the argmax of the penalised logits.

Sampling inverts the distribution's cumulative sum (float64) at one uniform variate per token drawn from the
request's own generator: an exact draw from ``p`` that costs one random number per token, not one per vocabulary
entry. A seeded request therefore consumes the same random numbers whatever else is in the batch, so its output
depends only on its seed and prompt.

Reported logprobs are those of the model's raw distribution: ``log_softmax`` of the unmodified logits, before
penalties, temperature and any top-k / top-p / min-p truncation (vLLM's default ``raw_logprobs``), so they score the
model itself and equal a full forward pass; a token sampled from a truncated distribution still reports its raw
logprob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megapipe.errors import MegapipeError

MAX_LOGPROBS = 20


class ParamError(MegapipeError):
    """A sampling or request parameter is out of range; ``param`` names it (OpenAI's ``error.param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: Optional[int] = 16  # None: up to the model's context
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Sequence[str] = field(default_factory=list)
    stop_token_ids: Sequence[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    logprobs: Optional[int] = None  # top alternatives per generated token (0: the sampled token's logprob only)
    prompt_logprobs: Optional[int] = None  # the same for the prompt tokens (echo); disables prefix-cache reuse
    skip_special_tokens: bool = True
    structured: Optional[object] = None  # a structured.Constraint the output must match
    logit_bias: Optional[dict] = None  # token id -> a number added to its logit (OpenAI's field, within [-100, 100])
    allowed_token_ids: Optional[Sequence[int]] = None  # only these ids may be sampled
    bad_words: Sequence[str] = ()  # words the output may not contain (as vLLM bans them: bad_words_ids)
    bad_words_ids: Sequence[Sequence[int]] = ()  # their token sequences, set by the engine's check_request

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def restricted(self) -> bool:
        """Some logits change before penalties: allowed ids, bad words, a logit bias."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_ids)

    def validate(self, vocab_size: int, max_n: int = 128) -> "SamplingParams":
        def bad(param: str, why: str) -> ParamError:
            return ParamError(param, f"{param} = {getattr(self, param)!r} {why}")

        def finite(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(name)
        if not isinstance(self.n, int) or not 1 <= self.n <= max_n:
            raise bad("n", f"must be an integer within [1, {max_n}]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens = {self.max_tokens}")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be within (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 = no limit)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be within [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 = none)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be within [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be an integer within [0, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer within [0, {MAX_LOGPROBS}]")
        def token_id(t) -> bool:
            return not isinstance(t, bool) and isinstance(t, int) and 0 <= t < vocab_size

        for name in ("stop_token_ids", "allowed_token_ids"):
            for t in getattr(self, name) or ():
                if not token_id(t):
                    raise ParamError(name, f"{name} holds {t!r}, not a token id in [0, {vocab_size})")
        if self.allowed_token_ids is not None and not len(self.allowed_token_ids):
            raise ParamError("allowed_token_ids", "allowed_token_ids is empty: no token could be sampled")
        for t, bias in (self.logit_bias or {}).items():
            if not token_id(t):
                raise ParamError("logit_bias", f"logit_bias holds token {t!r}, not a token id in [0, {vocab_size})")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ParamError("logit_bias", f"logit_bias[{t}] = {bias!r} must be a finite number")
        if any(not isinstance(s, str) or not s for s in self.stop):  # as vLLM refuses it
            raise ParamError("stop", f"stop = {self.stop!r} holds an empty string or a non-string: each stop must be "
                                     f"non-empty text")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ParamError("bad_words", "bad_words must be a list of non-empty strings")
        return self


@dataclass
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    suppressed: Sequence[int] = ()  # ids made impossible this step (EOS / stop ids before min_tokens)
    matcher: Optional[object] = None  # structured output: the sequence's grammar Matcher (its mask is applied)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output ids (HF / vLLM rule), frequency and presence over output ids."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.penalised:
            continue
        out = torch.tensor(list(row.output_ids), dtype=torch.long, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(list(row.prompt_ids), dtype=torch.long, device=logits.device)] = True
            seen[out] = True
            x = logits[i]
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[i] = torch.where(seen, penalised, x)
        if out.numel() and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


TOP_P_CANDIDATES = (64, 1024, 8192)  # top-p looks for its set among this many most likely tokens, then sorts the row


def filter_logits(logits: torch.Tensor, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """[R, V] (or [V]) tempered logits -> the same with -inf outside the top-k, then outside the smallest set of most
    likely tokens whose probability reaches top_p, then below min_p times the most likely token's probability. Each
    of top_k, top_p, min_p is one value for every row or a sequence of one per row (0, 1.0, 0.0: off). Rows are
    handled together: one top-k, softmax or mask over the batch is several times cheaper than one per row."""
    if logits.dim() == 1:
        return filter_logits(logits[None], top_k, top_p, min_p)[0]
    rows, vocab = logits.shape
    ks, ps, mins = (list(v) if isinstance(v, (list, tuple)) else [v] * rows for v in (top_k, top_p, min_p))
    with_k = [i for i, k in enumerate(ks) if 0 < k < vocab]
    if with_k:
        values = _rows(logits, with_k).topk(max(ks[i] for i in with_k), dim=-1).values
        picked = values.gather(-1, _column([ks[i] - 1 for i in with_k], torch.long, logits.device))
        logits = logits.masked_fill(logits < _per_row(picked, with_k, rows, float("-inf")), float("-inf"))
    with_p = [i for i, p in enumerate(ps) if p < 1.0]
    if with_p:
        logits = logits.masked_fill(logits < _nucleus_floor(logits, with_p, [ps[i] for i in with_p]),
                                    float("-inf"))
    with_min = [i for i, m in enumerate(mins) if m > 0.0]
    if with_min:
        probs = _rows(logits, with_min).softmax(dim=-1)
        floor = _column([mins[i] for i in with_min], probs.dtype, probs.device) * probs.amax(-1, keepdim=True)
        drop = probs < floor
        if len(with_min) < rows:  # the other rows keep everything
            every = torch.zeros_like(logits, dtype=torch.bool)
            every[with_min] = drop
            drop = every
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return x if len(rows) == x.shape[0] else x[rows]


def _column(values: list, dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def _per_row(column: torch.Tensor, rows: list[int], count: int, fill: float) -> torch.Tensor:
    """[count, 1]: column's values at ``rows``, ``fill`` elsewhere."""
    if len(rows) == count:
        return column
    out = torch.full((count, 1), fill, dtype=column.dtype, device=column.device)
    out[rows] = column
    return out


def _nucleus_floor(logits: torch.Tensor, rows: list[int], top_p: list[float]) -> torch.Tensor:
    """[R, 1]: for each of ``rows``, the least logit of the smallest set of its most likely tokens whose mass reaches
    its top_p (the most likely token always stays); -inf for the other rows. The set is looked for among the rows'
    TOP_P_CANDIDATES[0] most likely tokens, then among more of them for the rows whose set is larger, and last in a
    sort of those rows, each step for all its rows at once: a sort of a 49k vocabulary costs ~2.5 ms on a CPU core,
    a top-64 of 64 such rows ~2.5 ms in all. A row skips candidates that cannot hold its set (their mass is at most
    their count times the last candidate's probability)."""
    vocab = logits.shape[-1]
    counts = [c for c in TOP_P_CANDIDATES if c < vocab] + [vocab]
    sub, p_col = _rows(logits, rows), _column(top_p, logits.dtype, logits.device)
    floors = torch.full((len(rows), 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    probs = sub.softmax(dim=-1) if counts[0] < vocab else None  # (not logsumexp: 5x slower on rows mostly -inf)
    pending = {counts[0]: list(range(len(rows)))}
    for count in counts:
        js = sorted(pending.pop(count, []))  # in row order: _rows takes the whole batch as it is
        if not js:
            continue
        x = _rows(sub, js)
        if count < vocab:
            values, order = x.topk(count, dim=-1)
            p = _rows(probs, js).gather(-1, order)
        else:  # the softmax of the sorted rows, summed in that order: the definition's own rounding
            values = x.sort(dim=-1, descending=True).values
            p = values.softmax(dim=-1)
        kept = (p.cumsum(dim=-1) - p < _rows(p_col, js)).sum(-1, keepdim=True)  # the mass before each, in order
        found = kept[:, 0] < count if count < vocab else torch.ones(len(js), dtype=torch.bool, device=x.device)
        floors[[js[i] for i in found.nonzero()[:, 0].tolist()]] = values[found].gather(-1, kept[found] - 1)
        if not found.all():
            held, last = p.sum(-1).tolist(), p[:, -1].tolist()
            for i in (~found).nonzero()[:, 0].tolist():
                pending.setdefault(_wider(counts, count, held[i], last[i], top_p[js[i]]), []).append(js[i])
    return _per_row(floors, rows, logits.shape[0], float("-inf"))


def _wider(counts: list[int], count: int, held: float, last: float, top_p: float) -> int:
    """The next candidate count that can hold the set, given the mass ``held`` by the ``count`` most likely tokens
    and the probability ``last`` of the count-th (the vocabulary's size, the last of counts, always can)."""
    return next(c for c in counts if c > count and (c == counts[-1] or held + (c - count) * last >= top_p))


def apply_restrictions(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """In vLLM's order, before penalties: ids outside a row's allowed_token_ids, then the last token of each bad word
    whose other tokens end the output, at -inf; then the logit bias added."""
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(list(p.allowed_token_ids), dtype=torch.long, device=logits.device)
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        if p.bad_words_ids:
            out = list(row.output_ids)
            banned = [w[-1] for w in p.bad_words_ids if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]]
            logits[i, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def penalised(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """fp32 logits [R, V] restricted (allowed ids, bad words, logit bias) and penalised, suppressed ids and those a
    row's grammar forbids at -inf (a copy where anything changes)."""
    copied = any(r.params.penalised or r.params.restricted or r.suppressed for r in rows)
    if copied:
        logits = apply_penalties(apply_restrictions(logits.clone(), rows), rows)
    unsuppressed = {}  # constrained rows' logits before min_tokens held their stop ids back
    for i, row in enumerate(rows):
        if row.suppressed:
            if row.matcher is not None:
                unsuppressed[i] = logits[i:i + 1].clone()
            logits[i, list(row.suppressed)] = float("-inf")
    matcher = next((r.matcher for r in rows if r.matcher is not None), None)
    if matcher is not None:  # structured.Matcher (imported by whoever made it: no import here, structured imports us)
        logits = matcher.apply_masks(logits, rows, copied)
    for i, row_logits in unsuppressed.items():
        if torch.isneginf(logits[i]).all():  # the grammar allows only what min_tokens holds back: its end wins
            logits[i] = matcher.apply_masks(row_logits, [rows[i]], True)[0]
    return logits


def distribution(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Penalised logits [R, V] of sampled (not greedy) rows -> the probabilities [R, V] sampling draws from:
    tempered, then top-k / top-p / min-p truncated."""
    temps = [r.params.temperature for r in rows]
    x = logits if all(t == 1.0 for t in temps) else logits / _column(temps, logits.dtype, logits.device)
    if not all(r.params.top_k == 0 and r.params.top_p == 1.0 and r.params.min_p == 0.0 for r in rows):
        x = filter_logits(x, [r.params.top_k for r in rows], [r.params.top_p for r in rows],
                          [r.params.min_p for r in rows])
    return x.softmax(dim=-1)


def uniforms(generators: Sequence[Optional[torch.Generator]], device) -> torch.Tensor:
    """One float64 uniform per row, from the row's own generator where it has one."""
    u = torch.empty(len(generators), dtype=torch.float64, device=device)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand((), dtype=torch.float64, generator=g, device=device)
    return u


def draw(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One id per row of probs [R, V] (unnormalised is fine): the first id whose cumulative mass exceeds u * total,
    id k with probability p_k (none with p_k = 0)."""
    cdf = probs.double().cumsum_(dim=-1)
    target = (uniforms(generators, cdf.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first of equal maxima; a NaN wins). On CPU megapipe's kernel where it is
    loaded (kernels.py: 64 rows of a 49k vocabulary in ~0.3 ms against ~0.9 ms), else ``max``'s indices, which are
    argmax's, in under half its time (torch 2.13: 0.44 against 1.17 ms for 32 rows)."""
    if logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1]:
        op = getattr(torch.ops.megapipe, "argmax_rows", None)
        if op is not None:
            rows = logits if logits.stride(-1) == 1 else logits.contiguous()
            out = torch.empty(len(rows), dtype=torch.long)
            op(rows, out)
            return out
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """fp32 logits [R, V] -> next token ids [R] (a list of python ints is built by the caller)."""
    logits = penalised(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == len(rows):
        return greedy_ids(logits)
    out = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out[idx] = greedy_ids(logits[idx])
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    idx = torch.tensor(sampled, device=logits.device)
    chosen = [rows[i] for i in sampled]
    out[idx] = draw(distribution(logits[idx], chosen), [r.generator for r in chosen])
    return out


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[list[float], list[list[tuple]]]:
    """logprobs [R, V], chosen ids [R] -> (logprob of each chosen id, its top-k (id, logprob) alternatives)."""
    picked = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if k <= 0:
        return picked, [[] for _ in picked]
    values, ids = logprobs.topk(k, dim=-1)
    return picked, [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
