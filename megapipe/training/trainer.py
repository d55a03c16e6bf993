"""The one training loop: data -> forward/backward over micro-batches -> clip -> update, with eval, metrics,
checkpoints, exact resume, NaN skipping, fp16 loss scaling and a graceful stop. What differs between stages
(pretraining, SFT, distillation, RL) comes from a recipe (megapipe.training.recipes): its data, its loss over a
micro-batch, its stage name and extra metrics.

Exact resume: everything a step depends on (weights, optimizer moments, schedule position, loss scale, data
position, RNG) is in the checkpoint, and nothing in the loop depends on wall-clock or process state, so an fp32 run
killed and resumed reproduces the uninterrupted run's losses bit for bit.

Stopping: SIGTERM/SIGINT (with train.exit_signal_handler), train.exit_interval and train.exit_duration_in_mins end
the run after the current step with a checkpoint. A signal that arrives during an evaluation cuts it short, one
during a save lets the save finish: the run always ends with its newest step saved.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megapipe.checkpoint import load_checkpoint, save_checkpoint
from megapipe.config import Config, to_dict
from megapipe.errors import DataError, MegapipeError
from megapipe.models import build_model, count_params, flops_per_token
from megapipe.models.capabilities import STAGES, requested_layouts, require
from megapipe.parallel.distributed import init_distributed
from megapipe.parallel.ep import update_expert_biases
from megapipe.parallel.parallelize import parallelize_model, setup_parallel
from megapipe.parallel.step import clip_grad_norm_, eval_step, train_step
from megapipe.training.cpu_memory import keep_freed_memory
from megapipe.training.lr import LRSchedule
from megapipe.training.metrics import MetricsLogger, Window, device_peak_flops, mfu
from megapipe.training.optim import build_optimizer, describe_optimizer, set_lr
from megapipe.training.precision import DynamicLossScaler, autocast
from megapipe.training.recipes import PretrainRecipe, RunContext
from megapipe.training.run import resolve_run
from megapipe.training.signals import StopRequest


class TrainingError(MegapipeError):
    """Training cannot continue (e.g. the loss stays NaN); the message says why and what to change."""


MANIFEST_TOP_LEVEL = ("step", "tokens_seen")  # TrainState's fields that sit at a manifest's top level


@dataclass
class TrainState:
    """The loop's own counters; saved in every checkpoint's manifest (``state_dict``)."""

    step: int = 0  # iterations done (skipped ones included: they consume data)
    updates: int = 0  # successful optimizer updates (the LR schedule's clock, as in Megatron)
    tokens_seen: int = 0
    skipped_steps: int = 0
    nan_in_row: int = 0
    last_eval: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        """The manifest fields this state is saved in: ``step`` and ``tokens_seen`` at the manifest's top level
        (where every reader of checkpoints finds them), the other counters in ``trainer_state``."""
        counters = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in MANIFEST_TOP_LEVEL}
        return {"step": self.step, "tokens_seen": self.tokens_seen, "trainer_state": counters}

    def load_state_dict(self, state: dict) -> None:
        """From a manifest (``state_dict``'s fields); what it lacks takes its default."""
        counters = state.get("trainer_state") or {}
        for f in fields(self):
            value = counters.get(f.name, f.default_factory() if f.default is MISSING else f.default)
            setattr(self, f.name, int(state.get(f.name, value)) if f.name in MANIFEST_TOP_LEVEL else value)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """``Trainer(cfg, recipe).train()``; the recipe defaults to pretraining."""

    def __init__(self, cfg: Config, recipe=None, quiet: bool = False, with_data: bool = True):
        """``with_data=False`` builds model, optimizer and step only (benchmarks and tools feed their own batches)."""
        self.recipe = recipe if recipe is not None else PretrainRecipe()
        self.dist = init_distributed(cfg)
        self.device = torch.device(self.dist.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.is_main = self.dist.rank == 0
        seed_everything(cfg.train.seed)

        self.run = resolve_run(cfg, private_tokenizer=True)
        if with_data:
            self.recipe.check(self.run)
        self.cfg, self.tokenizer, self.train_iters = self.run.cfg, self.run.tokenizer, self.run.train_iters
        self.resume_ckpt, self.parent_ckpt = self.run.resume, self.run.parent
        t = self.cfg.train
        packed = self.recipe.packed_sequences(self.cfg)
        if self.recipe.stage in STAGES:  # what the architecture declares (megapipe.models.capabilities)
            require(self.cfg.model, self.recipe.stage, "", layouts=requested_layouts(self.cfg.parallel),
                    packing=packed)
        _, self.dims = setup_parallel(self.cfg, self.device.type, packed)
        self.num_microbatches = self.dims.num_microbatches(t)
        self.ctx = RunContext(
            cfg=self.cfg, dims=self.dims, tokenizer=self.tokenizer, device=self.device,
            autocast=functools.partial(autocast, t.precision, self.device.type), resume=self.resume_ckpt,
            parent=self.parent_ckpt, is_main=self.is_main, train_iters=self.train_iters,
            num_microbatches=self.num_microbatches,
        )

        self.loss = self.recipe.loss()
        self.model = self._build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, self.cfg.optim, t.lr)
        self.schedule = LRSchedule.from_train_config(t, self.train_iters)
        self.scaler = (
            DynamicLossScaler(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window)
            if t.precision == "fp16"
            else None
        )
        self.state = TrainState()
        data_state = self._load_checkpoint()
        self.train_data = self.recipe.train_data(self.ctx, self.model, data_state) if with_data else None
        self.run_dir = (t.log_dir or self.cfg.checkpoint.save) if with_data else None
        # files are created by the first record: a run refused before its first step leaves nothing behind
        self.logger = MetricsLogger(self.run_dir, enabled=self.is_main, quiet=quiet, resume_step=self.state.step)
        self.flops_per_token = flops_per_token(self.cfg.model, self.cfg.data.seq_length)
        self.peak_flops = device_peak_flops(self.device.type, t.peak_flops)
        self.last_saved: Optional[Path] = None
        self._saved_step = -1

    # ------------------------------------------------------------------------------------------- set-up

    @property
    def fused_loss(self) -> bool:
        """The output projection runs inside the loss, chunk by chunk, so the [tokens, vocab] logits never exist
        whole: when the recipe's loss can take hidden states and the layout keeps the output weight whole on each
        rank during the forward (data parallelism: FSDP gathers it, the loss runs inside the model's forward; not
        tp, which splits it by vocabulary, nor pp / cp, whose schedules and ring attention take logits)."""
        d = self.dims
        return self.loss.fusable and d.tp == d.pp == d.cp == 1

    def _build_model(self):
        model = build_model(self.cfg.model, device=self.device, seed=self.cfg.train.seed)
        model = self.recipe.prepare_model(self.ctx, model)
        return parallelize_model(model, self.dims, self.cfg, device=self.device)

    def _load_checkpoint(self) -> dict:
        """Restore from --load; returns the data state (empty for a new run or --finetune)."""
        if self.parent_ckpt is None:
            return {}

        if self.resume_ckpt is None:  # --finetune: weights only, a new run
            self.recipe.load_weights(self.ctx, self.model, self.parent_ckpt)
            return {}
        manifest = load_checkpoint(self.resume_ckpt, self.model, self.optimizer, load_optim=True, load_rng=True)
        ts = manifest.get("trainer_state") or {}
        self.schedule.check_resumable(ts.get("schedule", {}))
        scaler_state = ts.get("loss_scaler")
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        self.state.load_state_dict(manifest)
        return dict(manifest.get("data_state") or {})

    # ------------------------------------------------------------------------------------------- one step

    def next_microbatches(self, it, split: str = "train") -> list[dict]:
        out = []
        for _ in range(self.num_microbatches):
            try:
                mb = next(it)
            except StopIteration:
                raise DataError(
                    f"the {split} split ran out of samples; check --split {self.cfg.data.split} and the data size"
                ) from None
            self._check_token_ids(mb)
            out.append({k: v.to(self.device, non_blocking=True) for k, v in mb.items()})
        return out

    def _check_token_ids(self, mb: dict) -> None:
        """Ids beyond the model's vocabulary would index out of the embedding: say which data and which vocab."""
        top = int(torch.maximum(mb["tokens"].max(), mb["labels"].max()))
        vocab = self.cfg.model.vocab_size
        if top >= vocab:
            tok = f" (tokenizer {self.tokenizer.path}: {self.tokenizer.vocab_size} tokens)" if self.tokenizer else ""
            data = " ".join(self.cfg.data.data_path) or "the training data"
            raise DataError(
                f"{data} holds token id {top}, but model.vocab_size = {vocab}{tok}: the data was tokenized with "
                "another tokenizer, or model.vocab_size is too small"
            )

    def train_step(self, microbatches: list[dict]) -> dict:
        """Accumulate gradients over the micro-batches, then one update unless the loss or gradients are non-finite."""
        scale = self.scaler.scale_loss if self.scaler else None
        result = train_step(self.model, microbatches, self.dims, self.loss, self.ctx.autocast, scale,
                            fused=self.fused_loss)
        self.recipe.before_update(self.ctx)
        loss_value = result.loss.item()
        out = {"loss": loss_value, "skipped": 0, "grad_norm": float("nan"), **result.metrics}
        if result.units == 0 and self.recipe.empty_batches:
            return self._skip(out, nan=False)
        if not math.isfinite(loss_value):
            return self._skip(out, nan=True)
        if self.scaler is not None:
            found_inf = self.scaler.unscale_(self.params)
            self.scaler.update(found_inf)
            if found_inf:
                return self._skip(out, nan=False)
        grad_norm = clip_grad_norm_(self.model, self.cfg.optim.clip_grad, self.dims).item()
        out["grad_norm"] = grad_norm
        if not math.isfinite(grad_norm):
            return self._skip(out, nan=True)
        self.state.nan_in_row = 0
        out["lr"] = self.schedule.lr_at(self.state.updates + 1)
        set_lr(self.optimizer, out["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if result.expert_load:  # aux-loss-free MoE balancing: once per global batch, after the update
            update_expert_biases(self.model, result.expert_load)
        self.state.updates += 1
        return out

    def _skip(self, out: dict, nan: bool) -> dict:
        """Drop this step's gradients; non-finite losses count towards train.max_nan_skips (fp16 overflows don't)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.state.skipped_steps += 1
        out["skipped"] = 1
        out["lr"] = self.schedule.lr_at(self.state.updates + 1)
        if nan:
            self.state.nan_in_row += 1
            limit = self.cfg.train.max_nan_skips
            if self.state.nan_in_row >= limit:
                raise TrainingError(
                    f"the loss was not finite (nan/inf) for {self.state.nan_in_row} steps in a row up to step "
                    f"{self.state.step + 1} (train.max_nan_skips = {limit}): lower --lr, check the data (a batch "
                    "where no token counts towards the loss is non-finite too), or use bf16"
                )
        return out

    # ------------------------------------------------------------------------------------------- the loop

    def train(self) -> dict:
        t, ckpt, st = self.cfg.train, self.cfg.checkpoint, self.state
        tokens_per_step = t.global_batch_size * self.cfg.data.seq_length
        self._announce()
        window = Window()
        if self.resume_ckpt is not None and st.step >= self.train_iters:
            self.logger.print(f"{self.resume_ckpt} already finished {st.step} of {self.train_iters} steps: nothing to do")
            self.last_saved = self.resume_ckpt
            self.logger.close()
            return self._summary(window, "")
        it = iter(self.train_data)
        stopped_by, started = "", time.monotonic()
        signals = StopRequest() if t.exit_signal_handler else StopRequest(signals=())
        try:
            with signals as stop, self._progress() as progress:
                task = progress.add_task(self.recipe.stage, total=self.train_iters, completed=st.step) if progress else None
                while st.step < self.train_iters:
                    t0 = time.perf_counter()
                    out = self.train_step(self.next_microbatches(it))
                    st.step += 1
                    st.tokens_seen += tokens_per_step
                    window.add(out, tokens_per_step, time.perf_counter() - t0)
                    if progress:
                        progress.update(task, advance=1)
                    if st.step % t.log_interval == 0 or st.step == self.train_iters:
                        self._log(window.flush(), out)
                    stopped_by = self._exit_reason(stop, started)
                    if stopped_by or st.step == self.train_iters:
                        break
                    if t.eval_interval and st.step % t.eval_interval == 0:
                        self.evaluate(stop=stop)
                    if ckpt.save_interval and st.step % ckpt.save_interval == 0:
                        self.save()
                    stopped_by = self._exit_reason(stop, started)
                    if stopped_by:
                        break
                # the final evaluation and save run with the signal handlers still in place: a signal now cuts the
                # evaluation short and never interrupts the save
                if not stopped_by and t.eval_iters > 0:
                    self.evaluate(stop=stop)
                if self._saved_step != st.step:
                    self.save()
                stopped_by = stopped_by or stop.name  # a signal during the final evaluation or save
            if stopped_by:
                self.logger.print(f"[yellow]stopped by {stopped_by} after step {st.step}[/]")
            return self._summary(window, stopped_by)
        finally:
            self.logger.close()

    def _exit_reason(self, stop: StopRequest, started: float) -> str:
        """Why the run stops after this step ('' to go on); the same answer on every rank."""
        t = self.cfg.train
        if t.exit_interval and self.state.step >= t.exit_interval:
            return f"--exit-interval {t.exit_interval}"
        overtime = t.exit_duration_in_mins is not None and time.monotonic() - started >= 60 * t.exit_duration_in_mins
        if stop.requested(local=overtime):
            return stop.name or (f"--exit-duration-in-mins {t.exit_duration_in_mins:g}" if overtime else
                                 "a stop request on another rank")
        return ""

    def _announce(self) -> None:
        m = self.cfg.model
        resumed = f", resuming from {self.resume_ckpt} at step {self.state.step}" if self.resume_ckpt else ""
        self.logger.print(
            f"[bold]{self.recipe.stage}[/] {count_params(self.model):,} parameters ({m.num_layers} layers, "
            f"h{m.hidden_size}, vocab {m.vocab_size}), {self.train_iters} steps x {self.cfg.train.global_batch_size} x "
            f"{self.cfg.data.seq_length} tokens, {self.num_microbatches} micro-batch(es) per step, "
            f"{self.cfg.train.precision}, layout {self.dims.describe()}{resumed}"
        )
        for line in describe_optimizer(self.optimizer):
            self.logger.print(f"  {line}")

    def _progress(self):
        if self.logger.quiet:
            return contextlib.nullcontext(None)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        return Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeRemainingColumn(), console=self.logger.console, transient=True,
        )

    def _log(self, w: dict, last: dict) -> None:
        tps = w["tokens"] / w["time"] if w["time"] > 0 else 0.0
        record = {
            "step": self.state.step,
            "loss": w["loss"],
            "lr": last["lr"],
            "grad_norm": last["grad_norm"],
            "tokens_per_s": tps,
            "mfu": mfu(tps / self.dist.world_size, self.flops_per_token, self.peak_flops),
            "skipped": w["skipped"],
            "tokens_seen": self.state.tokens_seen,
            **w["metrics"],
            **self.recipe.metrics(self.ctx),
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.scale
        self.logger.log(record)

    @torch.no_grad()
    def evaluate(self, split: str = "valid", stop: Optional[StopRequest] = None) -> dict:
        """Token-weighted loss over train.eval_iters global batches from the start of the split (the same ones every
        time); a stop request cuts it short (nothing is recorded then)."""
        it = self.recipe.eval_data(self.ctx, split)
        if it is None:
            return {}

        total = units = 0.0
        sums: dict[str, float] = {}  # the loss's metrics (e.g. a reward model's preference accuracy)
        for _ in range(self.cfg.train.eval_iters):
            if stop is not None and stop.requested():
                return {}
            r = eval_step(self.model, self.next_microbatches(it, split), self.dims, self.loss, self.ctx.autocast,
                          fused=self.fused_loss)
            if r.units:
                total, units = total + r.loss.item() * r.units, units + r.units
                for k, v in r.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * r.units
        loss = total / units if units else float("nan")
        result = {"step": self.state.step, "loss": loss, **{k: v / units for k, v in sums.items()}}
        if self.loss.token_nll:
            result["ppl"] = math.exp(min(loss, 50.0))
        self.state.last_eval = {"loss": loss, "ppl": result.get("ppl"), "step": self.state.step}
        self.logger.log(result, kind=split)
        return result

    def save(self) -> Optional[Path]:
        ckpt = self.cfg.checkpoint
        if ckpt.save is None:
            return None

        state = self.state.state_dict()
        state["trainer_state"].update(schedule=self.schedule.state_dict(),
                                      loss_scaler=self.scaler.state_dict() if self.scaler else None)
        manifest = {
            "stage": self.recipe.stage,
            "model": self.cfg.model,
            "layout": {"world_size": self.dist.world_size, "parallel": self.dims.describe()},
            "parent": str(self.parent_ckpt) if self.parent_ckpt else None,
            "data_state": self.train_data.state_dict() if self.train_data is not None else {},
            **state,
            "config": to_dict(self.cfg),
            **self.recipe.manifest(self.ctx),
        }
        self.last_saved = save_checkpoint(
            ckpt.save, self.state.step, self.model, self.optimizer, manifest=manifest,
            tokenizer=self.recipe.tokenizer_files(self.ctx), keep_last=ckpt.keep_last,
        )
        self._saved_step = self.state.step
        self.logger.print(f"saved checkpoint {self.last_saved}")
        return self.last_saved

    def _summary(self, window: Window, stopped_by: str) -> dict:
        st = self.state
        summary = {
            "steps": st.step,
            "tokens_seen": st.tokens_seen,
            "skipped_steps": st.skipped_steps,
            "final_loss": window.last_loss,
            "tokens_per_s": window.total_tokens / window.total_time if window.total_time else 0.0,
            "eval_loss": st.last_eval.get("loss"),
            "eval_ppl": st.last_eval.get("ppl"),
            "checkpoint": str(self.last_saved) if self.last_saved else None,
            "stopped_by": stopped_by or None,
            "optimizer": describe_optimizer(self.optimizer),
            **self.recipe.summary(self.ctx),
        }
        if not self.logger.quiet:
            from rich.table import Table

            table = Table(title=f"{self.recipe.stage} summary", show_header=False)
            for k, v in summary.items():
                table.add_row(k, f"{v:.4f}" if isinstance(v, float) else "\n".join(v) if isinstance(v, list) else str(v))
            self.logger.console.print(table)
        return summary
