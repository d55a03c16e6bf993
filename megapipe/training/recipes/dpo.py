"""Preference optimisation (``megapipe posttrain dpo``): pairs of megapipe.data.preference, the losses of
megapipe.posttrain.dpo_losses, on the one training loop.

A loss unit is a pair (the loop divides the summed pair losses by the pairs of the global batch). Both answers of a
pair are in the same micro-batch: one packed row (the prompt once, as RL's shared prompts) where the model takes
packed documents, else two rows. The reference's log-probs of the answer tokens come with each micro-batch
(``ref_logps`` [B, S]), computed by the data iterator before the step: by the start checkpoint, frozen (replicated
or FSDP-sharded like the distillation teacher); under LoRA by the policy with its adapters switched off (no second
model); or with --precompute-ref-logprobs once per pair before training (each side's sum kept, placed on the side's
first answer token). Layouts: data parallelism (FSDP / DDP); tp, pp and cp are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from megapipe.checkpoint import resolve_checkpoint
from megapipe.data.gpt_dataset import parse_split
from megapipe.data.preference import PreferenceSamples, build_preference_datasets, prepare_preference_index
from megapipe.data.sft import ChatEncoder
from megapipe.data.sft_dataset import SFTLoader
from megapipe.errors import ConfigError
from megapipe.models.capabilities import capabilities
from megapipe.models.lora import adapters_off
from megapipe.models.objective import Loss, LossResult, ModelOutput
from megapipe.posttrain.dpo_losses import PreferenceSpec, preference_loss
from megapipe.posttrain.lora import check_lora_run, lora_spec
from megapipe.posttrain.rl.grpo import masked_logprobs
from megapipe.posttrain.rl.logprobs import DEFAULT_CHUNK
from megapipe.posttrain.rl.rollout import sequence_logprobs
from megapipe.posttrain.start import START_KEY, start_of
from megapipe.training.recipes.base import RunContext
from megapipe.training.recipes.distill import frozen_model
from megapipe.training.recipes.sft import LoRARecipe

STAGE = "dpo"


def pair_sums(values: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position ``values`` (given at the ``loss_mask`` positions, row-major) summed per pair and side:
    (sums [pairs, 2], token counts [pairs, 2]); a pair is a packed row or two consecutive rows."""
    mask = batch["loss_mask"].bool()
    b = mask.shape[0]
    rows = torch.arange(b, device=mask.device)[:, None].expand(mask.shape)
    packed = "document_ids" in batch
    pairs = b if packed else b // 2
    key = ((rows if packed else rows // 2) * 2 + batch["side"] - 1)[mask]
    sums = torch.zeros(2 * pairs, dtype=torch.float32, device=mask.device).index_add(0, key, values.float())
    counts = torch.bincount(key, minlength=2 * pairs)
    return sums.view(pairs, 2), counts.view(pairs, 2)


class PreferenceLoss(Loss):
    fusable = True
    token_nll = False  # a preference loss: no perplexity in its evaluation

    def __init__(self, spec: PreferenceSpec):
        self.spec = spec

    def units(self, batch: dict) -> torch.Tensor:
        b = batch["side"].shape[0]
        return torch.tensor(b if "document_ids" in batch else b // 2)

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        mask = batch["loss_mask"].bool()
        logp, _ = masked_logprobs(out, batch["labels"], mask, 1.0, DEFAULT_CHUNK)
        policy, counts = pair_sums(logp, batch)
        rc = rr = None
        if self.spec.needs_reference:
            ref = pair_sums(batch["ref_logps"][mask], batch)[0]
            rc, rr = ref[:, 0], ref[:, 1]
        loss, chosen, rejected = preference_loss(self.spec, policy[:, 0], policy[:, 1], counts[:, 0], counts[:, 1],
                                                 rc, rr)
        p = policy.detach()
        metrics = {
            "rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
            "rewards/margin": (chosen - rejected).sum(), "rewards/accuracy": (chosen > rejected).float().sum(),
            "logps/chosen": p[:, 0].sum(), "logps/rejected": p[:, 1].sum(),
            "lengths/chosen": counts[:, 0].float().sum(), "lengths/rejected": counts[:, 1].float().sum(),
        }
        return LossResult(total=loss.sum(), metrics=metrics)


def reference_logps(model, mb: dict, autocast) -> torch.Tensor:
    """[B, S] the model's log-probs of the labels at the ``loss_mask`` positions (0 elsewhere), no gradient."""
    mask = mb["loss_mask"].bool()
    with torch.no_grad(), autocast():
        (logp,) = sequence_logprobs(model, mb, mask, [1.0], DEFAULT_CHUNK)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    out[mask] = logp.float()
    return out


def _on_first_tokens(sums: torch.Tensor, mb: dict) -> torch.Tensor:
    """[B, S] each pair's precomputed side sums placed on the side's first answer token (``sums`` [pairs, 2])."""
    mask, side = mb["loss_mask"].bool(), mb["side"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    packed = "document_ids" in mb
    for r in range(mask.shape[0]):
        for s in (1, 2):
            at = torch.nonzero(mask[r] & (side[r] == s))
            if len(at):
                out[r, at[0, 0]] = sums[r if packed else r // 2, s - 1]
    return out


def trim_padding(mb: dict) -> dict:
    """The micro-batch cut after its last position that counts (``side``: the last answer token, or the last
    reward read): what follows is padding, which no earlier position attends to (causal)."""
    used = (mb["side"] > 0).any(0).nonzero()
    width = int(used[-1]) + 1 if len(used) else 1
    return {k: v[:, :width] if v.dim() == 2 else v for k, v in mb.items()}


class PreferenceStream:
    """Micro-batches of pairs (two-row pairs flattened to rows) with the reference's log-probs attached."""

    def __init__(self, loader: SFTLoader, reference, table: Optional[torch.Tensor], device):
        self.loader, self.reference, self.table, self.device = loader, reference, table, device

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = [self.loader.dataset.row_of(i) for i in self.loader.sample_ids()]
        mb = next(self.loader)
        mb = trim_padding({k: v.flatten(0, 1) if v.dim() == 3 else v for k, v in mb.items()})
        if self.table is not None:
            mb["ref_logps"] = _on_first_tokens(self.table[rows], mb)
        elif self.reference is not None:
            dev = {k: v.to(self.device) for k, v in mb.items()}
            mb["ref_logps"] = self.reference(dev).cpu()
        return mb

    def state_dict(self) -> dict:
        return self.loader.state_dict()


class DPORecipe(LoRARecipe):
    stage = STAGE
    samples = PreferenceSamples  # how a pair becomes rows
    command = "posttrain dpo"

    def __init__(self, dpo_cfg, quiet: bool = False):
        """``dpo_cfg`` None: no preference loss (a subclass brings its own)."""
        self.quiet = quiet
        self.spec = PreferenceSpec.from_config(dpo_cfg) if dpo_cfg is not None else None
        self._encoder = self._index = self._datasets = self._reference = None
        self._tables: dict = {}

    def loss(self) -> PreferenceLoss:
        return PreferenceLoss(self.spec)

    @property
    def loss_name(self) -> str:
        return self.spec.loss_type

    @property
    def needs_reference(self) -> bool:
        return self.spec is not None and self.spec.needs_reference

    def packed_sequences(self, cfg) -> bool:
        return capabilities(cfg.model).packing

    def check(self, run) -> None:
        cfg = run.cfg
        if run.tokenizer is None:
            raise ConfigError(f"{self.command} needs a tokenizer: the --load checkpoint holds none, so give "
                              "--tokenizer")
        for name in ("tp", "pp", "cp"):
            if getattr(cfg.parallel, name) > 1:
                raise ConfigError(f"{self.command} runs data-parallel layouts (FSDP / DDP) only: parallel.{name} = "
                                  f"{getattr(cfg.parallel, name)} is not supported yet")
        if cfg.sft.packing or cfg.sft.train_on_prompt:
            flag = "--packing" if cfg.sft.packing else "--train-on-prompt"
            raise ConfigError(f"{flag} is an SFT flag: {self.command} packs each pair's prompt once by itself and "
                              "trains on the answers only")
        if run.parent is None:
            raise ConfigError(f"{self.command} starts from a checkpoint: give --load CKPT")
        check_lora_run(cfg, run.resume)
        self.index(cfg, run.tokenizer)

    def index(self, cfg, tokenizer):
        if self._index is None:
            self._encoder = ChatEncoder(tokenizer.path, cfg.sft.chat_template)
            self._index = prepare_preference_index(cfg.sft.data, self._encoder, cfg.sft.skip_bad_records,
                                                   cfg.data.cache_dir)
        return self._index

    def datasets(self, ctx: RunContext) -> dict:
        if self._datasets is None:
            cfg, t = ctx.cfg, ctx.cfg.train
            has_valid = parse_split(cfg.data.split)[1] > 0
            wanted = {"train": ctx.train_iters * t.global_batch_size,
                      "valid": t.eval_iters * t.global_batch_size if has_valid else 0}
            self._datasets = build_preference_datasets(self.index(cfg, ctx.tokenizer), cfg.data.split,
                                                       cfg.data.seq_length, wanted, t.seed,
                                                       self.packed_sequences(cfg), cfg.sft.overlong,
                                                       ctx.tokenizer.pad_id, self.samples)
            if ctx.is_main and not self.quiet:
                from rich.console import Console

                Console().print(self.describe())
        return self._datasets

    def describe(self) -> str:
        m, train = self._index.meta, self._datasets["train"]
        bad = m["bad_records"]
        return (f"{self.stage} data: {m['pairs']:,} pairs ({train.per_epoch:,} train), loss {self.loss_name}, "
                f"{'one packed row' if train.packed else 'two rows'} per pair"
                f"{f', {bad} bad record(s) skipped' if bad else ''}"
                f"{f', {train.truncated} cut at --seq-length' if train.truncated else ''}"
                f"{f', {train.dropped} left out' if train.dropped else ''}"
                f"{' (index cached)' if self._index.cache_hit else ''}")

    def reference(self, ctx: RunContext, model):
        """mb -> [B, S] reference log-probs: the policy without its adapters (LoRA), else the frozen start."""
        if not self.needs_reference:
            return None
        if lora_spec(ctx.cfg) is not None:
            def with_base(mb):
                with adapters_off(model):
                    return reference_logps(model, mb, ctx.autocast)
            return with_base
        if self._reference is None:
            d = ctx.cfg.dpo
            start = resolve_checkpoint(start_of(ctx.resume, ctx.parent))
            self._reference = frozen_model(start, ctx, d.ref_precision, d.ref_parallel)
        ref = self._reference
        return lambda mb: reference_logps(ref, mb, ctx.autocast)

    def table(self, ctx: RunContext, dataset, reference) -> torch.Tensor:
        """[pairs of an epoch, 2] the reference's summed answer log-probs, computed once (every rank)."""
        out = torch.zeros(dataset.per_epoch, 2, dtype=torch.float32)
        mbs = ctx.cfg.train.micro_batch_size
        for lo in range(0, dataset.per_epoch, mbs):
            ids = range(lo, min(lo + mbs, dataset.per_epoch))
            rows = [dataset.pair(r) for r in ids]
            mb = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
            mb = {k: (v.flatten(0, 1) if v.dim() == 3 else v).to(ctx.device) for k, v in mb.items()}
            logp = reference(mb)
            out[lo: lo + len(ids)] = pair_sums(logp[mb["loss_mask"].bool()], mb)[0].cpu()
        return out

    def _stream(self, ctx: RunContext, model, split: str, consumed: int = 0):
        ds = self.datasets(ctx)[split]
        if ds is None:
            return None
        t = ctx.cfg.train
        loader = SFTLoader(ds, t.micro_batch_size, t.global_batch_size, ctx.dims.dp_rank, ctx.dims.dp_size,
                           consumed)
        if ctx.cfg.dpo.precompute_ref_logprobs and self.needs_reference:
            if split not in self._tables:
                self._tables[split] = self.table(ctx, ds, self.reference(ctx, model))
            return PreferenceStream(loader, None, self._tables[split], ctx.device)
        return PreferenceStream(loader, self.reference(ctx, model), None, ctx.device)

    def train_data(self, ctx: RunContext, model, state: dict):
        self._model = model
        stream = self._stream(ctx, model, "train", state.get("consumed_samples", 0))
        if ctx.cfg.dpo.precompute_ref_logprobs and self.needs_reference:
            if self.datasets(ctx)["valid"] is not None:
                self._stream(ctx, model, "valid")  # its table too, while the reference is loaded
            self._reference = None  # the frozen reference is no longer needed
        return stream

    def eval_data(self, ctx: RunContext, split: str):
        return self._stream(ctx, self._model, split)

    def manifest(self, ctx: RunContext) -> dict:
        out = {START_KEY: start_of(ctx.resume, ctx.parent), "dpo": {
            **dataclasses.asdict(self.spec), "data": list(ctx.cfg.sft.data),
            "chat_template": self._encoder.template_name, "index": str(self._index.path),
            "pair_layout": "packed" if self.datasets(ctx)["train"].packed else "rows",
        }}
        spec = lora_spec(ctx.cfg)
        if spec is not None:
            out["lora"] = spec.to_manifest()
        return out
