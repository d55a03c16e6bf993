"""The pretraining loop: data -> forward/backward over micro-batches -> clip -> update, with eval, metrics,
checkpoints, exact resume, NaN skipping, fp16 loss scaling and a graceful stop on SIGTERM/SIGINT.

Exact resume: everything a step depends on (weights, optimizer moments, schedule position, loss scale, data
position, RNG) is in the checkpoint, and nothing in the loop depends on wall-clock or process state, so an fp32 run
killed and resumed reproduces the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megapipe.config import Config, ModelConfig, from_dict, to_dict
from megapipe.errors import ConfigError, DataError, MegapipeError
from megapipe.models import build_model, count_params, flops_per_token
from megapipe.training.cpu_memory import keep_freed_memory
from megapipe.training.lr import LRSchedule
from megapipe.training.metrics import MetricsLogger, device_peak_flops, mfu
from megapipe.training.optim import build_optimizer, set_lr
from megapipe.training.precision import DynamicLossScaler, autocast
from megapipe.training.signals import StopRequest


class TrainingError(MegapipeError):
    """Training cannot continue (e.g. the loss stays NaN); the message says why and what to change."""


@dataclass
class TrainState:
    """The loop's own counters; saved in every checkpoint's manifest (trainer_state)."""

    step: int = 0  # iterations done (skipped ones included: they consume data)
    updates: int = 0  # successful optimizer updates (the LR schedule's clock, as in Megatron)
    tokens_seen: int = 0
    skipped_steps: int = 0
    nan_in_row: int = 0
    last_eval: dict = field(default_factory=dict)


def padded_vocab_size(vocab: int, multiple: int) -> int:
    multiple = max(1, multiple)
    return -(-vocab // multiple) * multiple


def resolve_vocab(model_cfg: ModelConfig, tokenizer) -> ModelConfig:
    """vocab_size None -> the tokenizer's, padded; a model vocab smaller than the tokenizer's is an error."""
    if tokenizer is None:
        if model_cfg.vocab_size is None:
            raise ConfigError("model.vocab_size is not set and no --tokenizer was given to take it from")
        return model_cfg
    tv = tokenizer.vocab_size
    if model_cfg.vocab_size is None:
        return replace(model_cfg, vocab_size=padded_vocab_size(tv, model_cfg.make_vocab_size_divisible_by))
    if model_cfg.vocab_size < tv:
        raise ConfigError(
            f"model.vocab_size = {model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tv} tokens, {tokenizer.path}); raise model.vocab_size or leave it unset"
        )
    return model_cfg


def resolve_train_iters(cfg: Config) -> int:
    t = cfg.train
    if t.train_iters is not None:
        return t.train_iters
    if t.train_tokens is not None:
        return max(1, math.ceil(t.train_tokens / (t.global_batch_size * cfg.data.seq_length)))
    raise ConfigError("neither train.train_iters (--train-iters) nor train.train_tokens (--train-tokens) is set")


def find_checkpoint(c) -> tuple[Optional[Path], Optional[Path]]:
    """(checkpoint to resume from, checkpoint the run descends from) for CheckpointConfig ``c``; --finetune
    resumes nothing."""
    if c.load is None:
        return None, None
    from megapipe.checkpoint import find_latest, resolve_checkpoint

    ckpt = find_latest(c.load) if Path(c.load).exists() else None
    if ckpt is None and c.save is not None and Path(c.load).absolute() == Path(c.save).absolute():
        return None, None  # --save X --load X on a fresh run dir: start, and resume on the next launch
    ckpt = resolve_checkpoint(c.load)  # raises a CheckpointError saying what is wrong
    return (None if c.finetune else ckpt), ckpt


def base_model_config(m: ModelConfig, parent_ckpt: Optional[Path]) -> ModelConfig:
    """Loading a checkpoint with no model given (no preset, defaults untouched): take its model config."""
    if parent_ckpt is None or m != ModelConfig():
        return m
    from megapipe.checkpoint import read_manifest

    return from_dict(ModelConfig, read_manifest(parent_ckpt)["model"], "model.")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """``Trainer(cfg).train()``. Subclasses may override ``loss_fn`` (e.g. other objectives, fault injection)."""

    def __init__(self, cfg: Config, quiet: bool = False, with_data: bool = True):
        """``with_data=False`` builds model, optimizer and step only (benchmarks feed their own batches)."""
        from megapipe.parallel.distributed import init_distributed
        from megapipe.parallel.parallelize import setup_parallel

        self.cfg = cfg
        t = cfg.train
        self.dist = init_distributed(cfg)
        self.device = torch.device(self.dist.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.is_main = self.dist.rank == 0
        seed_everything(t.seed)

        self.resume_ckpt, self.parent_ckpt = self._find_checkpoint()
        self.tokenizer = self._load_tokenizer()
        cfg.model = resolve_vocab(self._model_config(), self.tokenizer)
        self.train_iters = resolve_train_iters(cfg)
        _, self.dims = setup_parallel(cfg, self.device.type)
        self.num_microbatches = self.dims.num_microbatches(t)

        self.model = self._build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, cfg.optim, t.lr)
        self.schedule = LRSchedule.from_train_config(t, self.train_iters)
        self.scaler = (
            DynamicLossScaler(t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window)
            if t.precision == "fp16"
            else None
        )
        self.state = TrainState()
        data_state = self._load_checkpoint()

        self.datasets, self.train_loader = {}, None
        if with_data:
            self.datasets = self._build_datasets()
            self.train_loader = self._loader(self.datasets["train"], data_state.get("consumed_samples", 0))
        self.run_dir = (t.log_dir or cfg.checkpoint.save) if with_data else None
        self.logger = MetricsLogger(self.run_dir, enabled=self.is_main, quiet=quiet, resume_step=self.state.step)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_length)
        self.peak_flops = device_peak_flops(self.device.type, t.peak_flops)
        self.last_saved: Optional[Path] = None

    # ------------------------------------------------------------------------------------------- set-up

    def _load_tokenizer(self):
        """--tokenizer, else the one inside the checkpoint given to --load, else none (model.vocab_size must be set)."""
        from megapipe.data.tokenizer import load_tokenizer

        path = self.cfg.data.tokenizer
        if path is None and self.parent_ckpt is not None and (self.parent_ckpt / "tokenizer").is_dir():
            # a private copy: pruning old checkpoints (keep_last) may delete this one while we still copy from it
            self._tokenizer_copy = tempfile.TemporaryDirectory(prefix="megapipe-tokenizer-")
            path = shutil.copytree(self.parent_ckpt / "tokenizer", Path(self._tokenizer_copy.name) / "tokenizer")
        return load_tokenizer(path) if path is not None else None

    def _find_checkpoint(self):
        return find_checkpoint(self.cfg.checkpoint)

    def _model_config(self) -> ModelConfig:
        return base_model_config(self.cfg.model, self.parent_ckpt)

    def _build_model(self):
        from megapipe.parallel.parallelize import parallelize_model
        from megapipe.training.loss import FusedLinearCrossEntropy

        model = build_model(self.cfg.model, device=self.device, seed=self.cfg.train.seed)
        d = self.dims
        if type(self).loss_fn is Trainer.loss_fn and d.tp == d.pp == d.cp == d.dp_size == 1:
            # the output projection runs inside the loss, chunk by chunk: the [tokens, vocab] logits never exist
            # whole (a subclass with its own loss_fn gets logits)
            model.return_hidden = True
            self.loss = FusedLinearCrossEntropy(model.output_weight)
        elif self.cfg.train.compile and d.tp == 1:
            # --compile covers the loss too: log-softmax, NLL and their backward fuse into few passes over the
            # logits (the largest tensors of a small model). Vocabulary-sharded DTensor logits (TP) stay eager.
            self.loss = torch.compile(self.loss_fn)
        else:
            self.loss = self.loss_fn
        return parallelize_model(model, self.dims, self.cfg, loss_fn=self.loss, device=self.device)

    def _load_checkpoint(self) -> dict:
        """Restore from --load; returns the data-loader state (empty for a new run or --finetune)."""
        if self.parent_ckpt is None:
            return {}
        from megapipe.checkpoint import load_checkpoint

        if self.resume_ckpt is None:  # --finetune: weights only, a new run
            load_checkpoint(self.parent_ckpt, self.model, optimizer=None, load_optim=False, load_rng=False)
            return {}
        manifest = load_checkpoint(self.resume_ckpt, self.model, self.optimizer, load_optim=True, load_rng=True)
        ts = dict(manifest.get("trainer_state") or {})
        self.schedule.check_resumable(ts.pop("schedule", {}))
        scaler_state = ts.pop("loss_scaler", None)
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        known = TrainState.__dataclass_fields__
        self.state = TrainState(**{k: v for k, v in ts.items() if k in known})
        self.state.step = int(manifest.get("step", self.state.step))
        self.state.tokens_seen = int(manifest.get("tokens_seen", self.state.tokens_seen))
        return dict(manifest.get("data_state") or {})

    def _build_datasets(self) -> dict:
        from megapipe.data.gpt_dataset import build_gpt_datasets, parse_split

        d, t = self.cfg.data, self.cfg.train
        if not d.data_path:
            raise ConfigError("data.data_path (--data-path) is not set: give the PREFIX of a .bin/.idx pair")
        gbs = t.global_batch_size
        has_valid = parse_split(d.split)[1] > 0
        num_samples = {"train": self.train_iters * gbs, "valid": t.eval_iters * gbs if has_valid else 0}
        return build_gpt_datasets(d.data_path, d.split, d.seq_length, num_samples, t.seed, d.cache_dir)

    def _loader(self, dataset, consumed_samples: int = 0):
        from megapipe.data.loader import PretrainingLoader

        t = self.cfg.train
        return PretrainingLoader(
            dataset, t.micro_batch_size, t.global_batch_size, self.dims.dp_rank, self.dims.dp_size, consumed_samples
        )

    # ------------------------------------------------------------------------------------------- one step

    def _next_microbatches(self, it, split: str) -> list[dict]:
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
            raise DataError(
                f"the data {' '.join(self.cfg.data.data_path)} holds token id {top}, but model.vocab_size = {vocab}"
                f"{tok}: the data was tokenized with another tokenizer, or model.vocab_size is too small"
            )

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32 math; vocabulary-sharded logits under TP)."""
        from megapipe.parallel.tp import cross_entropy

        return cross_entropy(logits, labels)

    def _autocast(self):
        return autocast(self.cfg.train.precision, self.device.type)

    def train_step(self, microbatches: list[dict]) -> dict:
        """Accumulate gradients over the micro-batches, then one update unless the loss or gradients are non-finite."""
        from megapipe.parallel.step import clip_grad_norm_, train_step

        scale = self.scaler.scale_loss if self.scaler else None
        loss = train_step(self.model, microbatches, self.dims, self.loss, self._autocast, scale)
        loss_value = loss.item()
        out = {"loss": loss_value, "skipped": 0, "grad_norm": float("nan")}
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
                    f"{self.state.step + 1} (train.max_nan_skips = {limit}): lower --lr, check the data, or use bf16"
                )
        return out

    # ------------------------------------------------------------------------------------------- the loop

    def train(self) -> dict:
        t, ckpt = self.cfg.train, self.cfg.checkpoint
        st = self.state
        tokens_per_step = t.global_batch_size * self.cfg.data.seq_length
        self._announce()
        window = _Window()
        if self.resume_ckpt is not None and st.step >= self.train_iters:
            self.logger.print(f"{self.resume_ckpt} already finished {st.step} of {self.train_iters} steps: nothing to do")
            self.last_saved = self.resume_ckpt
            self.logger.close()
            return self._summary(window, "")
        it = iter(self.train_loader)
        stopped_by = ""
        with StopRequest() as stop, self._progress() as progress:
            task = progress.add_task("pretrain", total=self.train_iters, completed=st.step) if progress else None
            while st.step < self.train_iters:
                t0 = time.perf_counter()
                out = self.train_step(self._next_microbatches(it, "train"))
                st.step += 1
                st.tokens_seen += tokens_per_step
                window.add(out, tokens_per_step, time.perf_counter() - t0)
                if progress:
                    progress.update(task, advance=1)
                if st.step % t.log_interval == 0 or st.step == self.train_iters:
                    self._log(window.flush(), out)
                if t.eval_interval and st.step % t.eval_interval == 0 and st.step < self.train_iters:
                    self.evaluate()
                if ckpt.save_interval and st.step % ckpt.save_interval == 0 and st.step < self.train_iters:
                    self.save()
                if stop.requested():
                    stopped_by = stop.name or "a signal on another rank"
                    break
        if not stopped_by and t.eval_iters > 0:
            self.evaluate()
        if self.last_saved is None or self._saved_step != st.step:
            self.save()
        if stopped_by:
            self.logger.print(f"[yellow]stopped by {stopped_by} after step {st.step}[/]")
        summary = self._summary(window, stopped_by)
        self.logger.close()
        return summary

    def _announce(self) -> None:
        m = self.cfg.model
        resumed = f", resuming from {self.resume_ckpt} at step {self.state.step}" if self.resume_ckpt else ""
        self.logger.print(
            f"[bold]pretrain[/] {count_params(self.model):,} parameters ({m.num_layers} layers, h{m.hidden_size}, "
            f"vocab {m.vocab_size}), {self.train_iters} steps x {self.cfg.train.global_batch_size} x "
            f"{self.cfg.data.seq_length} tokens, {self.num_microbatches} micro-batch(es) per step, "
            f"{self.cfg.train.precision}, layout {self.dims.describe()}{resumed}"
        )

    def _progress(self):
        import contextlib

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
        }
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.scale
        self.logger.log(record)

    @torch.no_grad()
    def evaluate(self, split: str = "valid") -> dict:
        """Mean loss over train.eval_iters global batches from the start of the split (the same ones every time)."""
        ds = self.datasets.get(split)
        if ds is None:
            return {}
        from megapipe.parallel.step import eval_step

        it = iter(self._loader(ds))
        n = self.cfg.train.eval_iters
        total = sum(
            eval_step(self.model, self._next_microbatches(it, split), self.dims, self.loss, self._autocast).item()
            for _ in range(n)
        )
        loss = total / n
        result = {"step": self.state.step, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
        self.state.last_eval = {"loss": loss, "ppl": result["ppl"], "step": self.state.step}
        self.logger.log(result, kind=split)
        return result

    _saved_step = -1

    def save(self) -> Optional[Path]:
        ckpt = self.cfg.checkpoint
        if ckpt.save is None:
            return None
        from megapipe.checkpoint import save_checkpoint

        st = self.state
        trainer_state = {
            "updates": st.updates, "skipped_steps": st.skipped_steps, "nan_in_row": st.nan_in_row,
            "last_eval": st.last_eval, "schedule": self.schedule.state_dict(),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }
        manifest = {
            "stage": "pretrain",
            "model": self.cfg.model,
            "layout": {"world_size": self.dist.world_size, "parallel": self.dims.describe()},
            "parent": str(self.parent_ckpt) if self.parent_ckpt else None,
            "tokens_seen": st.tokens_seen,
            "data_state": self.train_loader.state_dict(),
            "trainer_state": trainer_state,
            "config": to_dict(self.cfg),
        }
        self.last_saved = save_checkpoint(
            ckpt.save, st.step, self.model, self.optimizer, manifest=manifest,
            tokenizer=self.tokenizer.path if self.tokenizer else None, keep_last=ckpt.keep_last,
        )
        self._saved_step = st.step
        self.logger.print(f"saved checkpoint {self.last_saved}")
        return self.last_saved

    def _summary(self, window: "_Window", stopped_by: str) -> dict:
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
        }
        if not self.logger.quiet:
            from rich.table import Table

            table = Table(title="pretrain summary", show_header=False)
            for k, v in summary.items():
                table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
            self.logger.console.print(table)
        return summary


class _Window:
    """Sums since the last log line (loss over non-skipped steps), plus run totals for the summary."""

    def __init__(self):
        self.total_tokens, self.total_time, self.last_loss = 0, 0.0, None
        self._reset()

    def _reset(self):
        self.loss_sum, self.loss_n, self.tokens, self.time, self.skipped = 0.0, 0, 0, 0.0, 0

    def add(self, out: dict, tokens: int, seconds: float) -> None:
        if math.isfinite(out["loss"]):
            self.loss_sum += out["loss"]
            self.loss_n += 1
            self.last_loss = out["loss"]
        self.skipped += out["skipped"]
        self.tokens += tokens
        self.time += seconds
        self.total_tokens += tokens
        self.total_time += seconds

    def flush(self) -> dict:
        w = {
            "loss": self.loss_sum / self.loss_n if self.loss_n else float("nan"),
            "tokens": self.tokens,
            "time": self.time,
            "skipped": self.skipped,
        }
        self._reset()
        return w

