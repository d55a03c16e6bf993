"""Speculative decoding (``--speculative-tokens K``): drafts from the model's own multi-token prediction modules
(``--speculative-method mtp``) or from the sequence itself (``ngram``, prompt lookup), one verification for both.

Each engine step, a decoding sequence whose last token ``tokens[A]`` is not yet computed gets up to K draft tokens for
positions A + 1 .. A + K, the main model then computes ``tokens[A]`` and the drafts as one chunk of the paged batch (1
+ drafts rows of logits), and the drafts are accepted by the standard rule: greedy, while each equals the main model's
choice at its row; sampled, draft x at a row with target distribution p and draft distribution q with probability
min(1, p(x) / q(x)), and on the first rejection a token drawn from norm(max(p - q, 0)) (Leviathan et al. 2023): every
emitted token follows the main model's distribution exactly. An n-gram draft is deterministic (q one-hot at x): kept
with probability p(x), else replaced by a draw from p without x. The row after the last accepted draft gives one more
token (the correction, or a bonus when all were accepted), so a step emits 1 .. K + 1 tokens. The target distribution
of a row is the one the engine samples from without speculation (megapipe.inference.sampling: penalties, min_tokens
suppression, temperature, top-k / top-p / min-p), computed as if the drafts before it were already output; a seeded
request is reproducible but draws its random numbers in another order than without speculation. Rejected positions
need no undo: their keys lie beyond the sequence's computed length and are overwritten, and the blocks allocated for
them are returned (``Scheduler.rollback``); DeepSeek-V4's compressed entries alike, its compressors' carry advanced
over the kept tokens only (megapipe.inference.compressed_cache).

N-gram drafting (vLLM's ``ngram`` method): the longest suffix of the sequence's tokens, from ``prompt_lookup_max``
down to ``prompt_lookup_min`` tokens, that occurred before in the sequence (prompt and output), its latest earlier
occurrence with K tokens after it (else the latest), proposes the K tokens that followed it there. It needs nothing
of the model, so every model whose steps can be rolled back takes it (not the recurrent state of a hybrid model).

MTP drafting (DeepSeek-V3's chain): MTP depth 1 at position A - 1 takes the main model's final normed hidden state
there and the embedding of ``tokens[A]`` and predicts token A + 1; depth d takes depth d - 1's output at the same
position and the draft before it. With K above the number of modules N, the last module is used again one position
further each time, on its own previous output (as vLLM runs DeepSeek's single MTP module for K > 1): its output at t
and depth N - 1's at t + 1 both predict token t + N + 1.

The MTP blocks attend over their own KV cache (pool layers num_layers + d - 1, the main layers' blocks and slots).
Depth d's entry at position t depends on tokens up to t + d, so each step every depth (re)computes the positions
from ``SpecState.start`` to A - 1 in one chunk: those whose tokens were not all accepted yet are written again
next step. The main model's hidden states of those positions are kept per sequence (``SpecState``); after prefill
they are the prompt's (the first step fills the MTP cache over the whole prompt). A prompt whose first blocks come
from the prefix cache starts its MTP positions after them: the MTP entries of a cached block's last N positions were
computed with whatever followed it in the sequence that wrote it, which changes drafts only, never what the engine
outputs.

DeepSeek-V4 (hyper-connections): depth 1 takes the main model's last-layer streams [n, H] per position instead of
its final hidden state (``Transformer.forward(mtp_input=True)``), and the MTP block's keys share the window's
blocks, planned as the main layers' steps are (their (window, entries) tables and state slots). With every layer
windowed, a query reads one window back, so only the last ``reach`` (depth x window) positions' states are kept and
recomputed, and the engine keeps the blocks that far back (one key more than the main layers read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megapipe.inference.kv_cache import PagedBatch, eviction_window
from megapipe.inference.runner import DecoderLayer, pack_linears, rms_norm
from megapipe.inference.sampling import SampleRow, distribution, draw, greedy_ids, penalised, uniforms


@dataclass
class SpecState:
    """The main model's final normed hidden states [n, H] at positions start .. start + n - 1 of a sequence."""

    start: int
    hidden: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + len(self.hidden)


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # q per draft (sampled requests), else None; empty for deterministic drafts (n-gram: q one-hot at the draft)
    probs: list[Optional[torch.Tensor]] = field(default_factory=list)


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """Tokens emitted for drafts checked against the main model's choices (len(draft) + 1 of them): the drafts up to
    the first that differs, then the main model's own token there."""
    for i, x in enumerate(draft):
        if x != targets[i]:
            return list(draft[:i]) + [targets[i]]
    return list(draft) + [targets[len(draft)]]


def accept_sampled(draft: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                   generator: Optional[torch.Generator]) -> list[int]:
    """The rejection rule: draft[i] drawn from q[i] is kept with probability min(1, p[i, x] / q[i, x]); the first
    rejected one is replaced by a draw from norm(max(p[i] - q[i], 0)) and ends the step; when all are kept a bonus
    token is drawn from p[len(draft)]. q [k, V], p [k + 1, V] probabilities. Each emitted token is distributed as
    sampling from p (given the tokens before it) would give."""
    out = []
    for i, x in enumerate(draft):
        u = float(uniforms([generator], p.device)[0])
        if u * float(q[i, x]) < float(p[i, x]):
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q up to round-off: nothing left to correct
            residual = p[i]
        return out + [int(draw(residual[None], [generator])[0])]
    return out + [int(draw(p[len(draft)][None], [generator])[0])]


class Speculator:
    """Verifies the drafts each sequence was given (``propose``, by a subclass) and keeps the acceptance counts
    (``stats``). ``sample_row(seq, ahead)`` is the runner's SampleRow of a sequence as if the ids ``ahead`` were
    already output. ``needs_hidden``: the drafter reads the main model's final hidden states (``record``, ``keep``)."""

    needs_hidden = False

    def __init__(self, tokens: int, sample_row: Callable[..., SampleRow]):
        self.k, self.sample_row = tokens, sample_row
        self.num_drafts = 0  # verification steps with at least one draft
        self.drafted = [0] * tokens  # drafts proposed at each position 1..K
        self.accepted = [0] * tokens  # of which accepted

    def propose(self, seqs: Sequence, tables: dict) -> None:
        """Sets ``seq.draft`` (a Draft of ``seq.num_lookahead`` tokens at most) for every sequence in ``seqs``;
        ``tables``: their block tables by seq_id (SchedulerOutput.tables)."""
        raise NotImplementedError

    def record(self, seq, start: int, hidden: Optional[torch.Tensor]) -> None:
        """The main model computed positions start .. of ``seq``: their hidden states, for a drafter that reads them."""

    def keep(self, seq, start: int, hidden: Optional[torch.Tensor]) -> None:
        """After a verification at position ``start`` that accepted len(hidden) - 1 drafts."""

    # ------------------------------------------------------------------------------------------------ verifying

    def verify(self, seq, logits: torch.Tensor) -> list[int]:
        """The tokens ``seq`` emits from the main model's logits [1 + len(draft), V] at tokens[A] and its drafts;
        counts the acceptances."""
        draft = seq.draft.tokens
        rows = [self.sample_row(seq, draft[:i]) for i in range(len(draft) + 1)]
        logits = penalised(logits, rows)
        if rows[0].params.greedy:
            out = accept_greedy(draft, greedy_ids(logits).tolist())
        else:
            p = distribution(logits, rows)
            if seq.draft.probs:
                q = torch.stack(seq.draft.probs)
            else:  # deterministic drafts
                q = torch.zeros(len(draft), p.shape[-1], dtype=p.dtype, device=p.device)
                q[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1.0
            out = accept_sampled(draft, q, p, rows[0].generator)
        if draft:
            self.num_drafts += 1
            for i in range(len(draft)):
                self.drafted[i] += 1
                self.accepted[i] += i < len(out) - 1
        return out

    def stats(self) -> dict:
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": drafted,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_decode_num_draft_tokens_per_pos": list(self.drafted),
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted),
                "spec_decode_acceptance_rate_per_pos": [a / d if d else 0.0
                                                        for a, d in zip(self.accepted, self.drafted, strict=True)]}


class MTPSpeculator(Speculator):
    """Drafts with the MTP modules of ``runner.model`` into the runner's pool (which holds their layers)."""

    needs_hidden = True

    def __init__(self, runner, tokens: int, sample_row: Callable[..., SampleRow]):
        super().__init__(tokens, sample_row)
        model = runner.model
        self.model, self.runner, self.pool = model, runner, runner.pool
        self.depth = model.cfg.mtp_depth
        self.window, self.kernel = runner.window, runner.attention_kernel
        self.states = runner.states if runner.states else None  # DeepSeek-V4 plans its steps with the state slots
        # a model whose every layer is windowed (DeepSeek-V4): the hidden states of the last ``reach`` positions are
        # all the drafts read (depth d's keys there need depth d - 1's outputs one window further back); the engine
        # keeps their blocks (eviction_window's reach + 1)
        window = eviction_window(model.cfg)
        self.reach = None if window is None else self.depth * window
        if runner.packed:  # the MTP modules' matmuls packed as the main layers' are
            pack_linears(model.mtp, runner.own_linears)
        # the runner's fast layer path for the MTP blocks too, where it runs the main layers
        self.layers = None
        if runner.layers is not None and all(DecoderLayer.supports(m.block) for m in model.mtp):
            self.layers = [DecoderLayer(m.block, runner.ops) for m in model.mtp]

    # ------------------------------------------------------------------------------------------------ state

    def record(self, seq, start: int, hidden: torch.Tensor) -> None:
        """The main model computed positions start .. start + len(hidden) - 1 of ``seq``: keep their hidden states
        (after the kept ones when they continue them, else in their place: a new prompt, a recompute)."""
        state = getattr(seq, "spec", None)
        if state is not None and state.end == start:
            state.hidden = torch.cat([state.hidden, hidden])
        else:
            state = seq.spec = SpecState(start, hidden.clone())
        if self.reach is not None and len(state.hidden) > self.reach:
            state.start, state.hidden = state.end - self.reach, state.hidden[-self.reach:]

    # ------------------------------------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, seqs: Sequence, tables: dict) -> None:
        for seq in seqs:
            seq.draft = Draft()
        ready = [s for s in seqs if getattr(s, "spec", None) is not None and s.spec.end == len(s.tokens) - 1]
        if not ready:
            return
        spans = [(s.spec.start, len(s.spec.hidden)) for s in ready]
        batch = self._batch()
        positions = batch.plan([], [(tables[s.seq_id], start, n) for s, (start, n) in zip(ready, spans, strict=True)],
                               self._slots(ready))
        last = torch.tensor(list(accumulate(n for _, n in spans)), device=positions.device) - 1
        hidden = torch.cat([s.spec.hidden for s in ready])
        for depth in range(1, self.depth + 1):
            ids = [t for s, (start, n) in zip(ready, spans, strict=True) for t in _ahead(s, start, n, depth)]
            logits, hidden = self._mtp(depth, hidden, ids, positions, batch, last)
            self._take(ready, logits)
        # beyond the last module: it again, one position further each time, on its own output (one row per sequence)
        tail = hidden[last]
        for j in range(self.depth + 1, self.k + 1):
            going = [i for i, s in enumerate(ready) if s.num_lookahead >= j]
            if not going:
                break
            seqs_j = [ready[i] for i in going]
            batch = self._batch()
            pos = batch.plan([(tables[s.seq_id], len(s.tokens) - 2 + j - self.depth) for s in seqs_j], [],
                             self._slots(seqs_j))
            ids = [s.draft.tokens[j - 2] for s in seqs_j]
            logits, h = self._mtp(self.depth, tail[going], ids, pos, batch, None)
            tail[going] = h
            self._take(seqs_j, logits)
        for s in ready:
            del s.draft.tokens[s.num_lookahead:], s.draft.probs[s.num_lookahead:]

    def _batch(self) -> PagedBatch:
        return PagedBatch(self.pool, self.window, self.kernel, self.states)

    def _slots(self, seqs: Sequence) -> Optional[list[int]]:
        return [s.state_slot for s in seqs] if self.states is not None else None

    def _mtp(self, depth: int, hidden: torch.Tensor, ids: list[int], positions: torch.Tensor, batch: PagedBatch,
             rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP depth ``depth`` on the flattened rows: hidden [T, H], the ids ``depth`` ahead -> (fp32 logits of
        ``rows`` (all when None), this depth's hidden [T, H]). ``Transformer.mtp_step``, or its arithmetic through
        the runner's fast layer and packed output head where the runner has them."""
        tokens = torch.tensor(ids, dtype=torch.long, device=hidden.device)
        if self.layers is None:
            logits, h = self.model.mtp_step(depth, hidden[None], tokens[None], positions, batch)
            return (logits[0] if rows is None else logits[0, rows]), h[0]
        module, layer = self.model.mtp[depth - 1], self.layers[depth - 1]
        embedded = self.model.tok_embeddings(tokens)
        x = module.eh_proj(torch.cat([rms_norm(embedded, module.enorm), rms_norm(hidden, module.hnorm)], dim=-1))
        cos, sin = self.runner.cos_sin(positions, x.dtype)
        h, delta = layer(x, None, cos, sin, batch)
        h = h.add_(delta)
        return self.runner.logits(layer.norm(h if rows is None else h[rows], None, module.norm)), h

    def _take(self, seqs: Sequence, logits: torch.Tensor) -> None:
        """The next draft of each sequence from its MTP logits [len(seqs), V]: greedy or drawn from q, processed as
        the engine samples."""
        rows = [self.sample_row(s, s.draft.tokens) for s in seqs]
        logits = penalised(logits.float(), rows)
        for i, (s, row) in enumerate(zip(seqs, rows, strict=True)):
            if row.params.greedy:
                s.draft.tokens.append(int(greedy_ids(logits[i])))
                s.draft.probs.append(None)
            else:
                q = distribution(logits[i:i + 1], [row])
                s.draft.tokens.append(int(draw(q, [row.generator])[0]))
                s.draft.probs.append(q[0])

    def keep(self, seq, start: int, hidden: torch.Tensor) -> None:
        """After a verification at position ``start`` (= A) that accepted len(hidden) - 1 drafts: drop the kept
        hidden states of positions whose MTP entries are now final at every depth, keep those of the rest, and add
        the newly computed ones."""
        state = getattr(seq, "spec", None)
        if state is not None and state.end == start:
            first = min(start, start + len(hidden) - self.depth)  # depth d at t is final when t + d <= A + accepted
            state.hidden, state.start = state.hidden[max(0, first - state.start):], max(state.start, first)
        self.record(seq, start, hidden)


class NgramSpeculator(Speculator):
    """Prompt lookup: drafts copied from where the sequence's last n tokens (``longest`` .. ``shortest``) occurred
    before."""

    def __init__(self, tokens: int, sample_row: Callable[..., SampleRow], longest: int, shortest: int):
        super().__init__(tokens, sample_row)
        self.longest, self.shortest = longest, shortest

    def propose(self, seqs: Sequence, tables: dict) -> None:
        for seq in seqs:
            seq.draft = Draft(lookup(seq.tokens, seq.num_lookahead, self.longest, self.shortest))


def lookup(tokens: Sequence[int], k: int, longest: int, shortest: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens`` (of
    ``longest`` down to ``shortest`` tokens) that has one: the latest with k tokens after it, else the latest."""
    if k <= 0 or len(tokens) <= shortest:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        # windows starting at 0 .. size - n - 1: every earlier occurrence, not the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        starts = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if len(starts):
            full = starts[starts + n + k <= size]
            at = int(full[-1] if len(full) else starts[-1]) + n
            return arr[at:at + k].tolist()
    return []


def _ahead(seq, start: int, n: int, depth: int) -> list[int]:
    """The ids ``depth`` positions after positions start .. start + n - 1: accepted tokens, then the drafts so far."""
    first = start + depth
    known = seq.tokens[first:] if first < len(seq.tokens) else []
    return (known + seq.draft.tokens[max(0, first - len(seq.tokens)):])[:n]



