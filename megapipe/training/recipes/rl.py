"""GRPO with verifiable rewards as a recipe of the one training loop (``megapipe posttrain rl``).

A training step is one optimizer update. Every --updates-per-batch steps the data iterator makes a new rollout
batch (megapipe.posttrain.rl.rollout): --prompts-per-step prompts of the task, --group-size completions each,
sampled by an in-process engine that has just been given the trainer's weights (and checked to hold them), scored
by the reward functions (and a reward model, --reward-model), with group-relative advantages and the trainer's old
log-probs; the steps in between reuse that batch (the old log-probs make them off-policy updates with a clipped
ratio). The loss is GRPOLoss (megapipe.posttrain.rl.grpo), computed on the final hidden states chunk by chunk
through the output projection.

Global batch: prompts_per_step x group_size sequences (train.global_batch_size is set to it), cut into
micro-batches of --micro-batch-size rows per rank; data.seq_length is --max-prompt-tokens + --max-completion-tokens.

Resume: the checkpoint holds the prompt stream's position; sampling seeds derive from it, so a run killed and
resumed samples the completions the uninterrupted run sampled. A checkpoint written in the middle of a rollout
batch (--updates-per-batch > 1) also holds the rest of that batch (tokens, advantages, old log-probs; per rank, as
compressed safetensors bytes in the manifest's data state), since the weights that sampled it are gone.

Lineage: ``stage`` "rl", ``parent`` the checkpoint the run resumed or started from, ``posttrain_start`` the
checkpoint the run started from (its reference model for --kl-coef, and what a relaunch must name; megapipe.posttrain.
start), and the start's ``hf`` generation settings (end-of-sequence ids), so serving the result stops where the base
model stopped.
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from pathlib import Path
from typing import Optional

import torch

from megapipe.checkpoint import load_checkpoint, read_manifest, resolve_checkpoint
from megapipe.checkpoint.load import eos_ids_of
from megapipe.data.chat_template import load_chat_template
from megapipe.dtypes import PRECISION_DTYPES
from megapipe.errors import CheckpointError, ConfigError
from megapipe.models import build_model
from megapipe.posttrain.rl.engine_sync import build_engine, full_state_dict, sync_engine
from megapipe.posttrain.rl.grpo import GRPOLoss, GRPOSettings, MismatchMeter
from megapipe.posttrain.rl.rewards import build_rewards, reward_model_reward, reward_model_spec
from megapipe.posttrain.rl.rollout import PromptRenderer, RolloutWorker
from megapipe.posttrain.rl.tasks import build_task
from megapipe.posttrain.start import START_KEY, posttrain_checkpoints, start_of
from megapipe.training.recipes.base import Recipe, RunContext
from megapipe.training.run import base_model_config

STAGE = "rl"
TRAIN_KEYS = ("tokens", "labels", "completion_mask", "old_logprobs", "ref_logprobs", "advantages", "document_ids",
              "prefix_ids", "position_ids", "sampled_mask", "engine_logprobs")


def rl_config(cfg):
    """The run's config: the global batch and sequence length the rl section implies, and which checkpoint to
    load: --save's newest checkpoint when it holds this RL run (exact resume), else --load's weights (a new run)."""
    r = cfg.rl
    train = dataclasses.replace(cfg.train, global_batch_size=r.prompts_per_step * r.group_size)
    data = dataclasses.replace(cfg.data, seq_length=r.max_prompt_tokens + r.max_completion_tokens)
    ckpt = posttrain_checkpoints(cfg, cfg.checkpoint.load, STAGE).checkpoint
    if ckpt.load is None:
        raise ConfigError("posttrain rl starts from a checkpoint: give --load CKPT (e.g. one made by "
                          "`megapipe import hf` or `megapipe posttrain sft`)")
    _check_length(cfg, ckpt.load)
    return dataclasses.replace(cfg, train=train, data=data, checkpoint=ckpt)


def _check_length(cfg, ckpt) -> None:
    """Prompt + completion within the model's position limit, said in the rl section's terms."""
    r = cfg.rl
    model = base_model_config(cfg.model, resolve_checkpoint(Path(ckpt).expanduser()))
    limit = model.max_position_embeddings
    if limit is not None and r.max_prompt_tokens + r.max_completion_tokens > limit:
        raise ConfigError(
            f"--max-prompt-tokens {r.max_prompt_tokens} + --max-completion-tokens {r.max_completion_tokens} = "
            f"{r.max_prompt_tokens + r.max_completion_tokens} tokens is beyond the model's position limit "
            f"(model.max_position_embeddings = {limit}): lower them")


def check_world_size(cfg, world_size: int) -> None:
    r = cfg.rl
    if r.prompts_per_step % world_size:
        raise ConfigError(f"rl.prompts_per_step (--prompts-per-step) = {r.prompts_per_step} is not divisible by the "
                          f"{world_size} data-parallel ranks (each samples whole groups of its share of prompts)")


def _dtype(rl, precision: str) -> torch.dtype:
    return PRECISION_DTYPES[rl.rollout_dtype or precision]


class RLRecipe(Recipe):
    stage = STAGE
    empty_batches = True

    def __init__(self, rl):
        self.rl = rl
        self.stream: Optional[RolloutStream] = None
        # one update per batch: the loss measures the mismatch in the training forward, checked before the update
        self.meter = MismatchMeter() if rl.updates_per_batch == 1 else None
        self._start: Optional[str] = None
        self._start_hf: Optional[dict] = None

    def loss(self):
        r = self.rl
        return GRPOLoss(GRPOSettings(r.clip_low, r.clip_high, r.kl_coef, r.kl_estimator, r.loss_aggregation,
                                     r.temperature, r.logprob_chunk), self.meter)

    def packed_sequences(self, cfg) -> bool:
        return cfg.rl.shared_prompts

    def before_update(self, ctx: RunContext) -> None:
        """On-policy batches: the mismatch the training forward measured, over every rank, into the batch's metrics;
        above --max-mismatch the run stops here, before the optimizer step."""
        if self.meter is None or self.stream is None:
            return
        figures = self.stream.worker.mismatch(self.meter)
        self.meter.reset()
        self.stream.add_metrics(figures)

    def check(self, run) -> None:
        p = run.cfg.parallel
        for name in ("tp", "pp", "cp"):
            if getattr(p, name) > 1:
                raise ConfigError(f"posttrain rl runs data-parallel layouts (FSDP / DDP) only: parallel.{name} = "
                                  f"{getattr(p, name)} is not supported yet")
        if run.parent is None:
            raise ConfigError("posttrain rl starts from a checkpoint: give --load CKPT")
        if run.tokenizer is None:
            raise ConfigError(f"{run.parent} has no tokenizer, which posttrain rl needs to render prompts and "
                              "completions: give --set data.tokenizer=DIR")
        self.parts(run.cfg, run.tokenizer, run.cfg.train.seed)

    def parts(self, cfg, tokenizer, seed: int, device=None):
        """(task, rewards, renderer) of the run; each mistake in them is a ConfigError / DataError naming it. The
        reward model (--reward-model) is loaded on ``device``; without one it is only checked."""
        r = cfg.rl
        task = build_task(r, seed)
        rewards = build_rewards(r.reward, task, r.format_regex)
        if r.reward_model is not None:
            if device is None:
                reward_model_spec(r.reward_model)
            else:
                rewards.append(reward_model_reward(r.reward_model, device))
        template = None if r.chat_template == "none" else load_chat_template(tokenizer.path, r.chat_template)
        return task, rewards, PromptRenderer(tokenizer, template, r.system_prompt, r.max_prompt_tokens)

    def start_checkpoint(self, ctx: RunContext) -> str:
        """The checkpoint this run started from (carried over in the resumed checkpoint's manifest), and the
        ``hf`` settings it came with."""
        if self._start is None:
            self._start = start_of(ctx.resume, ctx.parent) or str(Path(ctx.parent).absolute())
            self._start_hf = read_manifest(ctx.resume if ctx.resume is not None else ctx.parent).get("hf")
        return self._start

    def train_data(self, ctx: RunContext, model, state: dict):
        check_world_size(ctx.cfg, ctx.dims.dp_size)
        self.stream = RolloutStream(self, ctx, model, state)
        return self.stream

    def manifest(self, ctx: RunContext) -> dict:
        r = self.rl
        out = {START_KEY: self.start_checkpoint(ctx), "rl": {
            "task": r.task, "rewards": [x.name for x in self.stream.worker.rewards] if self.stream else list(r.reward)}}
        if self._start_hf:
            out["hf"] = self._start_hf
        return out

    def metrics(self, ctx: RunContext) -> dict:
        return self.stream.pop_metrics() if self.stream is not None else {}


def _reference(ctx: RunContext, start: str):
    ref = build_model(ctx.cfg.model, device=ctx.device)
    load_checkpoint(start, ref, optimizer=None, load_optim=False, load_rng=False)
    ref.eval().requires_grad_(False)
    return ref


def _eos_ids(start_hf: Optional[dict], tokenizer) -> list[int]:
    gen = (start_hf or {}).get("generation_config") or {}
    return eos_ids_of(gen.get("eos_token_id"), tokenizer)


class RolloutStream:
    """The recipe's train iterator: micro-batches of the current rollout batch, --updates-per-batch passes each."""

    def __init__(self, recipe: RLRecipe, ctx: RunContext, model, state: dict):
        rl, cfg, dims = recipe.rl, ctx.cfg, ctx.dims
        self.rl, self.dims, self.num_microbatches = rl, dims, ctx.num_microbatches
        task, rewards, renderer = recipe.parts(cfg, ctx.tokenizer, cfg.train.seed, ctx.device)
        start = recipe.start_checkpoint(ctx)
        reference = _reference(ctx, start) if rl.kl_coef > 0 else None
        rows = rl.prompts_per_step // dims.dp_size * rl.group_size
        engine = build_engine(cfg.model, ctx.tokenizer, _eos_ids(recipe._start_hf, ctx.tokenizer),
                              _dtype(rl, cfg.train.precision), ctx.device, rows, cfg.data.seq_length,
                              full_state_dict(model))
        self.worker = RolloutWorker(model, dims, rl, cfg.train.seed, task, rewards, renderer, engine, reference,
                                    on_policy=recipe.meter is not None, device=ctx.device, autocast=ctx.autocast)
        self.worker.sync = lambda sd: sync_engine(engine, sd, rl.check_weights)
        self.consumed = int(state.get("consumed_prompts", 0))
        self.batch: list[dict] = []
        self.passes_left = 0
        self.queue: list[dict] = []
        self._metrics: list[dict] = []
        pending = state.get("pending")
        if pending:
            saved, dp = len(pending["buffers"]), dims.dp_size
            if saved != dp:
                raise CheckpointError(
                    f"{ctx.resume} was saved by {saved} data-parallel rank(s) in the middle of a rollout batch "
                    f"(--updates-per-batch {rl.updates_per_batch}), whose rows each rank holds: resume it with {saved} "
                    f"rank(s), not {dp}, or from a checkpoint at a rollout-batch boundary")
            self.batch = decode_batch(pending["buffers"][dims.dp_rank])
            self.passes_left = int(pending["passes_left"])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.queue:
            if self.passes_left == 0:
                self.batch, metrics = self.worker.rollout(self.consumed, self.num_microbatches)
                self.consumed += self.rl.prompts_per_step
                self.passes_left = self.rl.updates_per_batch
                self._metrics.append(metrics)
            self.queue = list(self.batch)
            self.passes_left -= 1
        mb = self.queue.pop(0)
        return {k: mb[k] for k in TRAIN_KEYS if k in mb}

    def add_metrics(self, figures: dict) -> None:
        """Figures of the current batch measured while training on it (the mismatch); checked against the bound."""
        self._metrics[-1].update(figures)
        self.worker.check_mismatch(self._metrics[-1], self.consumed - self.rl.prompts_per_step)

    def pop_metrics(self) -> dict:
        """The rollout figures since the last call (averaged over batches; maxima kept), or {} when none."""
        batches, self._metrics = self._metrics, []
        if not batches:
            return {}
        out = {}
        for k in batches[0]:
            values = [b[k] for b in batches]
            out[k] = max(values) if k.endswith("_max") else sum(values) / len(values)
        return out

    def state_dict(self) -> dict:
        """The prompt position, plus the unfinished rollout batch of every rank when a checkpoint falls inside one
        (collective then: every rank saves)."""
        state = {"consumed_prompts": self.consumed}
        if self.queue:
            raise RuntimeError("a checkpoint was taken in the middle of a step")
        if self.passes_left > 0:
            mine = encode_batch(self.batch)
            buffers = [mine]
            if self.dims.dp_size > 1:
                import torch.distributed as dist

                buffers = [None] * self.dims.dp_size
                dist.all_gather_object(buffers, mine, group=self.dims.group("dp"))
            state["pending"] = {"passes_left": self.passes_left, "buffers": buffers}
        return state


def encode_batch(batch: list[dict]) -> str:
    """Micro-batches -> text for the manifest (safetensors bytes, zlib, base64: tensors only, never pickle)."""
    from safetensors.torch import save

    flat = {f"{i}/{k}": v.contiguous() for i, mb in enumerate(batch) for k, v in mb.items()}
    return base64.b64encode(zlib.compress(save(flat), 6)).decode("ascii")


def decode_batch(text: str) -> list[dict]:
    from safetensors.torch import load

    flat = load(zlib.decompress(base64.b64decode(text)))
    out: dict[int, dict] = {}
    for key, value in flat.items():
        i, name = key.split("/", 1)
        out.setdefault(int(i), {})[name] = value
    return [out[i] for i in sorted(out)]
