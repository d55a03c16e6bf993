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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.errors import MegapipeError
from megapipe.posttrain.rl.grpo import degenerate_groups, group_advantages, masked_logprobs
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
        for c, seq in zip(out.outputs, req.seqs, strict=True):
            ids = list(seq.output_ids)
            lps = [lp for lp, _ in seq.logprobs]
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
    """Right-padded [B, S] tensors: ``tokens``, ``labels`` (the next token), ``sampled_mask`` (label positions that
    are sampled tokens), ``completion_mask`` (those trained on), ``engine_logprobs``, and ``advantages`` [B]."""
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


def mismatch_sums(engine_lp: torch.Tensor, trainer_lp: torch.Tensor) -> tuple[float, float, float, int]:
    """(sum |d|, max |d|, sum k3, count) over tokens, d = trainer - engine log-prob; k3 = e^d - 1 - d estimates
    KL(engine || trainer) from tokens the engine sampled."""
    d = (trainer_lp.double() - engine_lp.double())
    if d.numel() == 0:
        return 0.0, 0.0, 0.0, 0
    return float(d.abs().sum()), float(d.abs().max()), float((torch.expm1(d) - d).sum()), d.numel()


def sequence_logprobs(model, tokens, labels, mask, temperatures, chunk: int) -> list[torch.Tensor]:
    """The model's log-probs of ``labels`` where ``mask`` is set, once per temperature; the output projection runs
    inside the model's forward (``head``: FSDP holds the whole output weight there), chunk by chunk."""
    from megapipe.training.objective import ModelOutput

    def head(hidden, weight):
        out = ModelOutput(hidden=hidden, output_weight=lambda: weight)
        return [masked_logprobs(out, labels, mask, t, chunk)[0] for t in temperatures]

    return model(tokens, head=head)


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
    """Makes the rollout batches of one rank: ``rollout(first_index)`` -> (micro-batches, metrics)."""

    def __init__(self, trainer, rl, task, rewards, renderer: PromptRenderer, engine, reference=None):
        self.trainer, self.rl, self.task, self.rewards, self.renderer = trainer, rl, task, rewards, renderer
        self.engine, self.reference = engine, reference
        self.reduce = Reducer(trainer.dims)
        self.pad_id = getattr(trainer.tokenizer, "pad_id", None) or 0
        self.sync = None  # set by the recipe: the weight-sync callable (state dict -> check result)

    def prompts(self, first_index: int):
        dims, p = self.trainer.dims, self.rl.prompts_per_step
        per = p // dims.dp_size
        start = first_index + dims.dp_rank * per
        return [self.task.prompt(i) for i in range(start, start + per)]

    def sampling_params(self):
        from megapipe.inference.sampling import SamplingParams

        r = self.rl
        return SamplingParams(n=r.group_size, max_tokens=r.max_completion_tokens, min_tokens=r.min_completion_tokens,
                              temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, logprobs=0)

    def rollout(self, first_index: int, num_microbatches: int) -> tuple[list[dict], dict]:
        from megapipe.posttrain.rl.engine_sync import full_state_dict

        rl, trainer, G = self.rl, self.trainer, self.rl.group_size
        prompts = self.prompts(first_index)
        prompt_ids = [self.renderer.encode(p.prompt, p.where) for p in prompts]
        t0 = time.perf_counter()
        self.sync(full_state_dict(trainer.model))
        t1 = time.perf_counter()
        seeds = [prompt_seed(trainer.cfg.train.seed, p.index) for p in prompts]
        groups = sample_groups(self.engine, prompt_ids, seeds, self.sampling_params())
        t2 = time.perf_counter()

        flat_prompts = [p.prompt for p in prompts for _ in range(G)]
        completions = [s.text for g in groups for s in g]
        keys = sorted({k for p in prompts for k in p.fields})
        fields = {k: [p.fields.get(k) for p in prompts for _ in range(G)] for k in keys}
        per_fn = score(self.rewards, flat_prompts, completions, fields)
        total = torch.tensor(weighted(self.rewards, per_fn), dtype=torch.float64).view(len(prompts), G)
        accuracy = [self.task.accuracy(c, {k: fields[k][i] for k in keys}) for i, c in enumerate(completions)]

        n_local = total.numel()
        s1, s2, n = self.reduce.sum([float(total.sum()), float((total ** 2).sum()), float(n_local)])
        batch_std = ((s2 - s1 * s1 / n) / (n - 1)) ** 0.5 if n > 1 else 0.0
        adv = group_advantages(total, rl.scale_rewards, batch_std=max(batch_std, 0.0))
        dropped = degenerate_groups(total) if rl.dynamic_sampling else torch.zeros(len(prompts), dtype=torch.bool)

        rows = []
        for gi, (ids, group) in enumerate(zip(prompt_ids, groups, strict=True)):
            for si, s in enumerate(group):
                trained = not bool(dropped[gi]) and not (rl.mask_truncated and s.truncated)
                rows.append(Row(ids, s, float(adv[gi, si]), trained))
        microbatches = [collate(chunk, self.pad_id) for chunk in split_rows(rows, num_microbatches)]
        mism = self.score_microbatches(microbatches)
        t3 = time.perf_counter()

        metrics = self.metrics(per_fn, total, accuracy, groups, dropped, mism, (t1 - t0, t2 - t1, t3 - t2))
        self.check_mismatch(metrics, first_index)
        return microbatches, metrics

    @torch.no_grad()
    def score_microbatches(self, microbatches: list[dict]) -> list[float]:
        """The trainer's (and the reference's) log-probs of the sampled tokens, into each micro-batch; returns the
        mismatch sums against the engine (sum |d|, max |d|, sum k3, count)."""
        trainer, rl = self.trainer, self.rl
        temps = (rl.temperature,) if rl.temperature == 1.0 else (rl.temperature, 1.0)
        sums = [0.0, 0.0, 0.0, 0]
        for mb in microbatches:
            mask = mb["sampled_mask"]
            tokens, labels = mb["tokens"].to(trainer.device), mb["labels"].to(trainer.device)
            dmask = mask.to(trainer.device)
            with trainer._autocast():
                old, *raw = sequence_logprobs(trainer.model, tokens, labels, dmask, temps, rl.logprob_chunk)
                raw = raw[0] if raw else old
                if self.reference is not None:
                    ref_lp, = sequence_logprobs(self.reference, tokens, labels, dmask, temps[:1], rl.logprob_chunk)
                    mb["ref_logprobs"] = torch.zeros(mask.shape, dtype=torch.float32).masked_scatter_(
                        mask, ref_lp.float().cpu())
            mb["old_logprobs"] = torch.zeros(mask.shape, dtype=torch.float32).masked_scatter_(mask, old.float().cpu())
            a, m, k, c = mismatch_sums(mb["engine_logprobs"][mask], raw.float().cpu())
            sums = [sums[0] + a, max(sums[1], m), sums[2] + k, sums[3] + c]
        return sums

    def metrics(self, per_fn, total, accuracy, groups, dropped, mism, times) -> dict:
        """This batch's figures over every rank."""
        lengths = [len(s.ids) for g in groups for s in g]
        truncated = [s.truncated for g in groups for s in g]
        cols = list(zip(*per_fn, strict=True)) if per_fn and per_fn[0] else []
        sums = [float(total.sum()), float((total ** 2).sum()), float(total.numel()), sum(accuracy), sum(lengths),
                float(sum(truncated)), float(dropped.sum()), float(dropped.numel()), mism[0], mism[2], float(mism[3])]
        for col in cols:
            sums += [sum(col), sum(x * x for x in col)]
        sums = self.reduce.sum(sums)
        maxima = self.reduce.max([float(max(lengths, default=0)), mism[1], *times])
        n, tokens = sums[2], sums[4]
        out = {
            "reward": sums[0] / n, "reward_std": _std(sums[0], sums[1], n), "accuracy": sums[3] / n,
            "completion_len": tokens / n, "completion_len_max": maxima[0], "truncated": sums[5] / n,
            "groups_dropped": sums[6] / sums[7],
            "mismatch_mean": sums[8] / sums[10] if sums[10] else 0.0, "mismatch_max": maxima[1],
            "mismatch_kl": sums[9] / sums[10] if sums[10] else 0.0,
            "weight_sync_s": maxima[2], "rollout_s": maxima[3], "logprob_s": maxima[4],
            "rollout_tokens_per_s": tokens / maxima[3] if maxima[3] > 0 else 0.0, "rollout_tokens": tokens,
        }
        for i, r in enumerate(self.rewards):
            s, sq = sums[11 + 2 * i], sums[12 + 2 * i]
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
