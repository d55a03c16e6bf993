"""One GRPO rollout batch on this data-parallel rank: prompts -> weight sync -> sampled groups -> rewards ->
advantages -> micro-batches with the trainer's old log-probs (and the reference's) -> mismatch check.

Each rank samples its share of the batch's prompts (``prompts_per_step / dp`` of them, G completions each) with its
own engine. Sampling seeds are a function of the run's seed and the prompt's position in the task's stream, so a
completion depends only on the weights, the prompt and that seed: the same on any layout, and the same after an
exact resume (no sampler state to save).

Train/inference agreement: the engine reports the log-probability of every sampled token under the model's raw
distribution (temperature 1, nothing truncated; megapipe.inference.sampling). The trainer recomputes the same
quantity for the same tokens with its own weights and numerics, and every batch logs the mismatch over all of them:
``mismatch_max`` and ``mismatch_mean`` (absolute log-prob differences) and ``mismatch_kl`` (k3 estimate of
KL(engine || trainer) on the sampled tokens); when the chosen one (--mismatch-metric) exceeds --max-mismatch, the
run stops with an error before the batch trains.

What the loss uses: the importance ratio is the policy's log-prob over the *trainer's own* old log-prob, both
under softmax(z / T) (the tempered policy), so on a batch's first update the ratio is exactly 1 and engine
round-off never enters the objective; it is measured and bounded instead. Truncated sampling (top-k / top-p < 1)
draws from p_T restricted to a nucleus and renormalised: a sampled token y has probability p_T(y) / Z with Z the
nucleus mass. The loss treats the samples as drawn from p_T (as TRL and verl do): the ratio is left uncorrected
(the factor 1 / Z would differ per position) and tokens outside the nucleus are never sampled, so the gradient is
that of the objective restricted to the nucleus. Keep --top-p 1 --top-k 0 (the defaults) for unbiased on-policy
GRPO; the reported mismatch is unaffected by truncation, since both sides are raw log-probs.

Where the trainer's log-probs come from: with one update per batch (--updates-per-batch 1) the old log-prob is the
policy's own in the training forward (detached), and the mismatch is measured in that same forward, before the
optimizer step (the recipe's ``before_update``): no separate scoring pass. With several updates per batch a no-grad
pass scores the batch first (the old log-probs must stay those of the sampling weights). A reference model
(--kl-coef > 0) always scores in its own no-grad pass.

Shared prompts (--shared-prompts, the default): the completions of a group are trained in one packed row, the
prompt once and then every completion, each attending to the prompt and to itself only (DocumentMask's prefix),
at the positions the completion had when sampled. The prompt's last token starts each completion's segment (its
hidden state predicts the first sampled token); the rest of the prompt is computed once per row instead of once per
completion. Same loss and gradients as one row per completion, up to round-off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.data.chat_template import split_harmony
from megapipe.errors import MegapipeError
from megapipe.inference.sampling import SamplingParams
from megapipe.models.objective import ModelOutput
from megapipe.parallel.step import model_kwargs
from megapipe.posttrain.rl.engine_sync import full_state_dict
from megapipe.posttrain.rl.grpo import MismatchMeter, degenerate_groups, group_advantages, masked_logprobs
from megapipe.posttrain.rl.rewards import score, weighted


class MismatchError(MegapipeError):
    """The engine's log-probs disagree with the trainer's beyond --max-mismatch."""


class PromptError(MegapipeError):
    """A prompt cannot be used (too long for --max-prompt-tokens, no template for chat messages, ...)."""


@dataclass
class Sample:
    ids: list[int]  # sampled tokens, a stop token included
    logprobs: list[float]  # the engine's raw log-prob of each
    text: str
    truncated: bool  # cut at --max-completion-tokens


def prompt_seed(run_seed: int, index: int) -> int:
    """The sampling seed of prompt ``index``'s group (completion i uses seed + i, the engine's rule)."""
    import xxhash

    return xxhash.xxh64_intdigest(f"megapipe-rl:{run_seed}:{index}".encode()) % (2**62)


def sample_groups(engine, prompt_ids: list[list[int]], seeds: list[int], params) -> list[list[Sample]]:
    """G samples for each prompt (G = params.n), with the engine's raw log-probs of every sampled token. Reads the
    engine's sequences for the token ids, since its outputs leave the stop token out and RL trains on it."""
    from dataclasses import replace

    finished = engine.run_to_completion([(f"rl-{i}", ids, replace(params, seed=seed))
                                         for i, (ids, seed) in enumerate(zip(prompt_ids, seeds, strict=True))])
    groups = []
    for req, out in finished:
        group = []
        for c, seq, done in zip(out.outputs, req.seqs, req.completions, strict=True):
            ids = list(seq.output_ids)
            lps = [lp for lp, _ in done.logprobs]
            if len(lps) != len(ids):
                raise MegapipeError(f"the engine reported {len(lps)} log-probs for {len(ids)} sampled tokens")
            group.append(Sample(ids, lps, c.text, c.finish_reason == "length"))
        groups.append(group)
    return groups


class PromptRenderer:
    """Prompt (string or chat messages) -> token ids: the chat template when there is one, --system-prompt first."""

    def __init__(self, tokenizer, template, system_prompt: Optional[str], max_tokens: int):
        self.tokenizer, self.template, self.system, self.max_tokens = tokenizer, template, system_prompt, max_tokens

    def render(self, prompt) -> str:
        if self.template is None:
            if not isinstance(prompt, str):
                raise PromptError("a prompt given as chat messages needs a chat template, and this tokenizer has "
                                  "none: give --chat-template FILE.jinja")
            return (self.system + "\n\n" + prompt) if self.system else prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        return self.template.render(messages, add_generation_prompt=True)

    @property
    def channels(self) -> bool:
        """Completions are harmony messages: sampled with their channel markers, scored on the final channel."""
        return self.template is not None and self.template.has_channels

    def answer(self, text: str) -> str:
        """What the rewards score: the completion, or the final channel of a harmony one (``split_harmony``)."""
        return split_harmony(text)[0] if self.channels else text

    def encode(self, prompt, where: str) -> list[int]:
        ids = self.tokenizer.encode(self.render(prompt))
        if not ids:
            raise PromptError(f"{where}: the prompt is empty")
        if len(ids) > self.max_tokens:
            raise PromptError(f"{where}: the prompt has {len(ids)} tokens (with the chat template), more than "
                              f"--max-prompt-tokens {self.max_tokens}")
        return ids


@dataclass
class Row:
    """One completion, ready to be batched."""

    prompt: list[int]
    sample: Sample
    advantage: float
    trained: bool  # False: its group was dropped, or it is truncated under --mask-truncated
    group: int  # index of its prompt in the batch

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.sample.ids)


def split_rows(rows: list[Row], n: int) -> list[list[Row]]:
    """The trained rows in ``n`` micro-batches as even as possible (longest first, so lengths pack together); a
    micro-batch left without a trained row gets one untrained row (it contributes nothing, the step keeps its
    shape: every rank runs the same number of forward passes)."""
    trained = sorted((r for r in rows if r.trained), key=lambda r: -r.length)
    spare = [r for r in rows if not r.trained]
    out, at = [], 0
    for i in range(n):
        size = len(trained) // n + (1 if i < len(trained) % n else 0)
        chunk = trained[at:at + size]
        at += size
        out.append(chunk if chunk else [spare[i % len(spare)]])
    return out


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """One row per completion, right-padded [B, S]: ``tokens``, ``labels`` (the next token), ``sampled_mask`` (label
    positions that are sampled tokens), ``completion_mask`` (those trained on), ``engine_logprobs``, and
    ``advantages`` [B]."""
    seq = max(r.length for r in rows)
    b = len(rows)
    tokens = torch.full((b, seq), pad_id, dtype=torch.long)
    sampled = torch.zeros((b, seq), dtype=torch.bool)
    engine_lp = torch.zeros((b, seq), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, c = len(r.prompt), len(r.sample.ids)
        tokens[i, :p + c] = torch.tensor(r.prompt + r.sample.ids)
        sampled[i, p - 1:p - 1 + c] = True
        engine_lp[i, p - 1:p - 1 + c] = torch.tensor(r.sample.logprobs, dtype=torch.float32)
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    trained = torch.tensor([r.trained for r in rows])
    return {
        "tokens": tokens, "labels": labels, "sampled_mask": sampled, "completion_mask": sampled & trained[:, None],
        "engine_logprobs": engine_lp, "advantages": torch.tensor([r.advantage for r in rows], dtype=torch.float32),
    }


def collate_shared(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """One packed row per prompt: the prompt but its last token (document 0), then one segment per completion
    (document k): the prompt's last token and the completion but its last token, labelled with the completion, at
    the positions they had when sampled, attending to the prompt (``prefix_ids`` 0) and to their own segment. The
    keys of ``collate`` plus ``document_ids``, ``prefix_ids`` and ``position_ids``; ``advantages`` per position.
    Padding is document -1, attending only to itself."""
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    packed = [g for _, g in sorted(groups.items())]
    seq = max(len(g[0].prompt) - 1 + sum(len(r.sample.ids) for r in g) for g in packed)
    shape = (len(packed), seq)
    out = {"tokens": torch.full(shape, pad_id, dtype=torch.long), "labels": torch.full(shape, pad_id),
           "sampled_mask": torch.zeros(shape, dtype=torch.bool), "completion_mask": torch.zeros(shape, dtype=torch.bool),
           "engine_logprobs": torch.zeros(shape), "advantages": torch.zeros(shape),
           "document_ids": torch.full(shape, -1), "prefix_ids": torch.full(shape, -1),
           "position_ids": torch.zeros(shape, dtype=torch.long)}
    for i, group in enumerate(packed):
        prompt = group[0].prompt
        p = len(prompt) - 1
        out["tokens"][i, :p] = torch.tensor(prompt[:-1])
        out["document_ids"][i, :p] = out["prefix_ids"][i, :p] = 0
        out["position_ids"][i, :p] = torch.arange(p)
        at = p
        for k, r in enumerate(group, start=1):
            ids, c = r.sample.ids, len(r.sample.ids)
            seg = slice(at, at + c)
            out["tokens"][i, seg] = torch.tensor([prompt[-1], *ids[:-1]])
            out["labels"][i, seg] = torch.tensor(ids)
            out["document_ids"][i, seg] = k
            out["prefix_ids"][i, seg] = 0
            out["position_ids"][i, seg] = torch.arange(p, p + c)
            out["sampled_mask"][i, seg] = True
            out["completion_mask"][i, seg] = r.trained
            out["engine_logprobs"][i, seg] = torch.tensor(r.sample.logprobs, dtype=torch.float32)
            out["advantages"][i, seg] = r.advantage
            at += c
    return out


def sequence_logprobs(model, mb: dict, mask, temperatures, chunk: int) -> list[torch.Tensor]:
    """The model's log-probs of the micro-batch's ``labels`` where ``mask`` is set, once per temperature; the output
    projection runs inside the model's forward (``head``: FSDP holds the whole output weight there), chunk by
    chunk. ``mb``: tensors on the model's device."""
    def head(hidden, weight):
        out = ModelOutput(hidden=hidden, output_weight=lambda: weight)
        return [masked_logprobs(out, mb["labels"], mask, t, chunk)[0] for t in temperatures]

    return model(mb["tokens"], head=head, **model_kwargs(mb))


class Reducer:
    """Sums and maxima over the data-parallel ranks (identity on one process)."""

    def __init__(self, dims):
        self.group = dims.group("dp") if dims.world_mesh is not None and dims.dp_size > 1 else None

    def _reduce(self, values: list[float], op) -> list[float]:
        if self.group is None or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)


class RolloutWorker:
    """Makes the rollout batches of one rank: ``rollout(first_index)`` -> (micro-batches, metrics).

    ``model``: the policy being trained (as parallelised; ``dims`` its layout), ``seed`` the run's; ``device`` and
    ``autocast`` (a factory of the forward's precision context) are the trainer's."""

    def __init__(self, model, dims, rl, seed: int, task, rewards, renderer: PromptRenderer, engine, reference=None,
                 on_policy: bool = False, *, device, autocast):
        self.model, self.dims, self.rl, self.seed = model, dims, rl, seed
        self.task, self.rewards, self.renderer = task, rewards, renderer
        self.engine, self.reference = engine, reference
        self.device, self.autocast = device, autocast
        self.reduce = Reducer(dims)
        self.pad_id = getattr(renderer.tokenizer, "pad_id", None) or 0
        self.sync = None  # set by the recipe: the weight-sync callable (state dict -> check result)
        # the training forward gives the old log-probs and measures the mismatch (the recipe's meter): no scoring pass
        self.on_policy = on_policy

    def prompts(self, first_index: int):
        dims, p = self.dims, self.rl.prompts_per_step
        per = p // dims.dp_size
        start = first_index + dims.dp_rank * per
        return [self.task.prompt(i) for i in range(start, start + per)]

    def sampling_params(self):
        r = self.rl
        return SamplingParams(n=r.group_size, max_tokens=r.max_completion_tokens, min_tokens=r.min_completion_tokens,
                              temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, logprobs=0,
                              skip_special_tokens=not self.renderer.channels)

    def rollout(self, first_index: int, num_microbatches: int) -> tuple[list[dict], dict]:
        rl, G = self.rl, self.rl.group_size
        prompts = self.prompts(first_index)
        prompt_ids = [self.renderer.encode(p.prompt, p.where) for p in prompts]
        t0 = time.perf_counter()
        self.sync(full_state_dict(self.model))
        t1 = time.perf_counter()
        seeds = [prompt_seed(self.seed, p.index) for p in prompts]
        groups = sample_groups(self.engine, prompt_ids, seeds, self.sampling_params())
        t2 = time.perf_counter()

        flat_prompts = [p.prompt for p in prompts for _ in range(G)]
        completions = [self.renderer.answer(s.text) for g in groups for s in g]
        keys = sorted({k for p in prompts for k in p.fields})
        fields = {k: [p.fields.get(k) for p in prompts for _ in range(G)] for k in keys}
        per_fn = score(self.rewards, flat_prompts, completions, fields)
        total = torch.tensor(weighted(self.rewards, per_fn), dtype=torch.float64).view(len(prompts), G)
        accuracy = [self.task.accuracy(c, {k: fields[k][i] for k in keys}) for i, c in enumerate(completions)]

        adv = group_advantages(total, rl.scale_rewards, self.reduce.sum)
        dropped = degenerate_groups(total) if rl.dynamic_sampling else torch.zeros(len(prompts), dtype=torch.bool)

        rows = []
        for gi, (ids, group) in enumerate(zip(prompt_ids, groups, strict=True)):
            for si, s in enumerate(group):
                trained = not bool(dropped[gi]) and not (rl.mask_truncated and s.truncated)
                rows.append(Row(ids, s, float(adv[gi, si]), trained, gi))
        pack = collate_shared if rl.shared_prompts else collate
        microbatches = [pack(chunk, self.pad_id) for chunk in split_rows(rows, num_microbatches)]
        meter = MismatchMeter()
        self.score_microbatches(microbatches, meter)
        t3 = time.perf_counter()

        metrics = self.metrics(per_fn, total, accuracy, groups, dropped, (t1 - t0, t2 - t1, t3 - t2))
        if not self.on_policy:
            metrics.update(self.mismatch(meter))
            self.check_mismatch(metrics, first_index)
        return microbatches, metrics

    @torch.no_grad()
    def score_microbatches(self, microbatches: list[dict], meter: MismatchMeter) -> None:
        """No-grad passes over the sampled tokens, into each micro-batch: the trainer's old log-probs (several
        updates per batch; the mismatch against the engine into ``meter``) and the reference's."""
        rl = self.rl
        if self.on_policy and self.reference is None:
            return
        temps = (rl.temperature,) if rl.temperature == 1.0 else (rl.temperature, 1.0)
        for mb in microbatches:
            mask = mb["sampled_mask"]
            dev = {k: v.to(self.device) for k, v in mb.items()}
            with self.autocast():
                if not self.on_policy:
                    old, *raw = sequence_logprobs(self.model, dev, dev["sampled_mask"], temps, rl.logprob_chunk)
                    mb["old_logprobs"] = torch.zeros(mask.shape).masked_scatter_(mask, old.float().cpu())
                    meter.add(mb["engine_logprobs"][mask], (raw[0] if raw else old).float())
                if self.reference is not None:
                    ref_lp, = sequence_logprobs(self.reference, dev, dev["sampled_mask"], temps[:1], rl.logprob_chunk)
                    mb["ref_logprobs"] = torch.zeros(mask.shape).masked_scatter_(mask, ref_lp.float().cpu())

    def mismatch(self, meter: MismatchMeter) -> dict:
        """The batch's mismatch figures over every rank (collective) from this rank's sums."""
        a, m, k, c = meter.sums
        a, k, c = self.reduce.sum([a, k, float(c)])
        m, = self.reduce.max([m])
        return {"mismatch_mean": a / c if c else 0.0, "mismatch_max": m, "mismatch_kl": k / c if c else 0.0}

    def metrics(self, per_fn, total, accuracy, groups, dropped, times) -> dict:
        """This batch's figures over every rank."""
        lengths = [len(s.ids) for g in groups for s in g]
        truncated = [s.truncated for g in groups for s in g]
        cols = list(zip(*per_fn, strict=True)) if per_fn and per_fn[0] else []
        sums = [float(total.sum()), float((total ** 2).sum()), float(total.numel()), sum(accuracy), sum(lengths),
                float(sum(truncated)), float(dropped.sum()), float(dropped.numel())]
        for col in cols:
            sums += [sum(col), sum(x * x for x in col)]
        sums = self.reduce.sum(sums)
        maxima = self.reduce.max([float(max(lengths, default=0)), *times])
        n, tokens = sums[2], sums[4]
        out = {
            "reward": sums[0] / n, "reward_std": _std(sums[0], sums[1], n), "accuracy": sums[3] / n,
            "completion_len": tokens / n, "completion_len_max": maxima[0], "truncated": sums[5] / n,
            "groups_dropped": sums[6] / sums[7],
            "weight_sync_s": maxima[1], "rollout_s": maxima[2], "logprob_s": maxima[3],
            "rollout_tokens_per_s": tokens / maxima[2] if maxima[2] > 0 else 0.0, "rollout_tokens": tokens,
        }
        for i, r in enumerate(self.rewards):
            s, sq = sums[8 + 2 * i], sums[9 + 2 * i]
            out[f"reward/{r.label}"] = s / n
            out[f"reward/{r.label}_std"] = _std(s, sq, n)
        return out

    def check_mismatch(self, metrics: dict, first_index: int) -> None:
        rl = self.rl
        value = metrics[f"mismatch_{rl.mismatch_metric}"]
        if value > rl.max_mismatch:
            raise MismatchError(
                f"the rollout engine and the trainer disagree on the sampled tokens' log-probs (batch of prompts "
                f"{first_index}..{first_index + rl.prompts_per_step - 1}): mismatch_{rl.mismatch_metric} = "
                f"{value:.3g} > --max-mismatch {rl.max_mismatch:g} (max |d| {metrics['mismatch_max']:.3g}, mean "
                f"{metrics['mismatch_mean']:.3g}, KL {metrics['mismatch_kl']:.3g}); check the rollout dtype "
                f"(--rollout-dtype) against --precision, or raise --max-mismatch")


def _std(s: float, sq: float, n: float) -> float:
    return max(sq / n - (s / n) ** 2, 0.0) ** 0.5 if n else 0.0
