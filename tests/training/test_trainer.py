"""The training loop in-process on real data: loss falls, NaN skip/abort, fp16 overflow recovery, vocab checks, the
fused loss path against the logits path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megapipe.config import load_config
from megapipe.errors import ConfigError, DataError
from megapipe.models.objective import TokenCrossEntropy
from megapipe.training.lr import LRSchedule
from megapipe.training.recipes import PretrainRecipe
from megapipe.training.run import padded_vocab_size
from megapipe.training.trainer import Trainer, TrainingError, TrainState


@pytest.fixture
def make(tiny_overrides):
    def build(pretrain_data, extra=None, recipe=None):
        return Trainer(load_config(None, tiny_overrides(*pretrain_data, extra)), recipe, quiet=True)

    return build


def test_the_train_state_is_saved_where_checkpoints_always_kept_it():
    """``state_dict()``: ``step`` and ``tokens_seen`` at the manifest's top level, the other counters in
    ``trainer_state``; ``load_state_dict`` reads such a manifest back whole (the trainer's other entries in
    ``trainer_state`` left alone), and a manifest that lacks a counter leaves it at its default."""
    last_eval = {"loss": 2.5, "ppl": 12.18, "step": 5}
    state = TrainState(step=7, updates=5, tokens_seen=896, skipped_steps=2, nan_in_row=1, last_eval=last_eval)
    counters = {"updates": 5, "skipped_steps": 2, "nan_in_row": 1, "last_eval": last_eval}
    assert state.state_dict() == {"step": 7, "tokens_seen": 896, "trainer_state": counters}
    manifest = {"step": 7, "tokens_seen": 896, "data_state": {"consumed_samples": 28},
                "trainer_state": {**counters, "schedule": {"decay_iters": 10}, "loss_scaler": None}}
    restored = TrainState(step=99, nan_in_row=3)
    restored.load_state_dict(manifest)
    assert restored == state
    restored.load_state_dict({"step": 4, "trainer_state": {"updates": 4}})
    assert restored == TrainState(step=4, updates=4)


def records(run_dir, kind="train"):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == kind]


def test_loss_falls_on_real_text_and_metrics_are_written(make, pretrain_data, tmp_path):
    trainer = make(pretrain_data, {"train.train_iters": 60, "train.eval_interval": 30, "train.log_dir": str(tmp_path)})
    summary = trainer.train()
    train, valid = records(tmp_path), records(tmp_path, "valid")
    assert [r["step"] for r in train] == list(range(1, 61))
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-10:]) / 10
    assert first == pytest.approx(math.log(512), abs=0.3)  # starts near uniform over the vocabulary
    assert last < first - 0.8
    assert [r["step"] for r in valid] == [30, 60] and valid[1]["loss"] < valid[0]["loss"] < first - 0.8
    assert valid[1]["ppl"] == pytest.approx(math.exp(valid[1]["loss"]))
    assert summary["eval_loss"] == valid[1]["loss"] and summary["steps"] == 60 and summary["checkpoint"] is None
    sched = LRSchedule.from_train_config(trainer.cfg.train, 60)
    assert [r["lr"] for r in train] == [sched.lr_at(n) for n in range(1, 61)]
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["mfu"] is None for r in train)
    assert train[-1]["tokens_seen"] == 60 * 4 * 32
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


class NaNAt(PretrainRecipe):
    """Fault injection: the loss of the steps listed in ``nan_steps`` (1-based) is NaN."""

    nan_steps: set = set()

    def __init__(self):
        super().__init__()
        self.steps_done = 0

    def before_update(self, ctx):
        self.steps_done += 1

    def loss(self):
        recipe, base = self, TokenCrossEntropy()

        class Faulty(TokenCrossEntropy):
            def __call__(self, out, batch):
                result = base(out, batch)
                if recipe.steps_done + 1 in recipe.nan_steps:
                    result.total = result.total * float("nan")
                return result

        return Faulty()


def test_nan_steps_are_skipped_and_counted(make, pretrain_data, tmp_path):
    NaNAt.nan_steps = {3, 4, 7}
    trainer = make(pretrain_data, {"train.train_iters": 8, "train.max_nan_skips": 3, "train.log_dir": str(tmp_path)},
                   recipe=NaNAt())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    summary = trainer.train()
    train = records(tmp_path)
    assert [r["skipped"] for r in train] == [0, 0, 1, 1, 0, 0, 1, 0]
    assert summary["skipped_steps"] == 3 and trainer.state.updates == 5
    assert all(math.isfinite(r["loss"]) for i, r in enumerate(train, 1) if i not in NaNAt.nan_steps)
    assert all(r["loss"] is None for i, r in enumerate(train, 1) if i in NaNAt.nan_steps)  # nan -> null in JSON
    # the schedule's clock counts updates only: step 5 (after two skips) used the rate of update 3
    sched = LRSchedule.from_train_config(trainer.cfg.train, 8)
    assert train[4]["lr"] == sched.lr_at(3)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_too_many_nans_in_a_row_abort_with_a_clear_message(make, pretrain_data, tmp_path):
    NaNAt.nan_steps = set(range(2, 100))
    trainer = make(pretrain_data, {"train.train_iters": 20, "train.max_nan_skips": 3}, recipe=NaNAt())
    with pytest.raises(TrainingError, match=r"not finite \(nan/inf\) for 3 steps in a row up to step 4 "
                                            r"\(train.max_nan_skips = 3\)"):
        trainer.train()


def test_fp16_loss_scale_recovers_from_overflow(make, pretrain_data, tmp_path):
    """A too-large initial scale overflows fp16 gradients: those steps are skipped and the scale halves until the
    gradients fit; then training proceeds and the scale doubles after each clean window."""
    trainer = make(pretrain_data, {
        "train.train_iters": 40, "train.precision": "fp16", "train.initial_loss_scale": 2.0**30,
        "train.loss_scale_window": 8, "train.log_dir": str(tmp_path),
    })
    trainer.train()
    train = records(tmp_path)
    skipped = [r["skipped"] for r in train]
    scales = [r["loss_scale"] for r in train]
    n_over = skipped.index(0)
    assert n_over >= 1 and all(skipped[:n_over])  # overflowed at first, every one halved the scale
    assert scales[:n_over] == [2.0**30 / 2 ** (i + 1) for i in range(n_over)]
    assert sum(skipped[n_over:]) <= (40 - n_over) // 4  # then mostly clean steps (an overflow now and then)
    doubled = [i for i in range(1, 40) if scales[i] == 2 * scales[i - 1]]
    assert doubled and all(not any(skipped[i - 7 : i + 1]) for i in doubled)  # x2 only after 8 clean steps
    assert all(scales[i] == scales[i - 1] / 2 for i in range(1, 40) if skipped[i])
    assert sum(r["loss"] for r in train[-5:]) / 5 < train[n_over]["loss"] - 0.5
    assert trainer.scaler.state_dict()["scale"] == scales[-1]


def test_vocab_size_comes_from_the_tokenizer_padded(make, pretrain_data):
    assert padded_vocab_size(512, 128) == 512 and padded_vocab_size(513, 128) == 640 and padded_vocab_size(7, 1) == 7
    trainer = make(pretrain_data, {"train.train_iters": 1, "model.make_vocab_size_divisible_by": 100})
    assert trainer.cfg.model.vocab_size == 600 and trainer.model.tok_embeddings.weight.shape[0] == 600


def test_model_vocab_smaller_than_the_tokenizer_is_refused(make, pretrain_data):
    with pytest.raises(ConfigError, match=r"model.vocab_size = 256 is smaller than the tokenizer's vocabulary "
                                          r"\(512 tokens"):
        make(pretrain_data, {"train.train_iters": 1, "model.vocab_size": 256})


def test_data_ids_beyond_the_model_vocab_are_refused(make, pretrain_data, tmp_path, shakespeare_excerpt):
    """Data tokenized with the 512-token tokenizer, trained with a model sized for a 300-token one."""
    from megapipe.data.readers import iter_texts
    from megapipe.data.tokenizer import train_tokenizer

    small = tmp_path / "small_tok"
    train_tokenizer(iter_texts([shakespeare_excerpt], "text"), 300, small)
    prefix, _ = pretrain_data
    with pytest.raises(DataError, match=rf"was tokenized with tokenizer .* not with {small} \(300 tokens\)"):
        make((prefix, small), {"train.train_iters": 2, "model.make_vocab_size_divisible_by": 1})
    # told to go on anyway, the first batch still stops at the first id the model cannot embed
    trainer = make((prefix, small), {"train.train_iters": 2, "model.make_vocab_size_divisible_by": 1,
                                     "data.allow_tokenizer_mismatch": True})
    assert trainer.cfg.model.vocab_size == 300
    with pytest.raises(DataError, match=rf"holds token id \d+, but model.vocab_size = 300 \(tokenizer {small}: "
                                        r"300 tokens\)"):
        trainer.train()


def test_train_tokens_sets_the_number_of_steps(make, pretrain_data):
    trainer = make(pretrain_data, {"train.train_tokens": 1000})  # 4 x 32 tokens per step -> ceil(1000 / 128)
    assert trainer.train_iters == 8


def test_activation_recompute_leaves_the_losses_unchanged(make, pretrain_data, tmp_path):
    runs = {}
    for mode in ("none", "full", "selective"):
        make(pretrain_data, {"train.train_iters": 4, "train.recompute": mode, "train.log_dir": str(tmp_path / mode),
                             "train.eval_iters": 0}).train()
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in records(tmp_path / mode)]
    assert runs["full"] == runs["none"] == runs["selective"]


class LogitsCrossEntropy(TokenCrossEntropy):
    """The same cross-entropy, declared not fusable: the trainer then keeps the logits path."""

    fusable = False


class UnfusedRecipe(PretrainRecipe):
    def loss(self):
        return LogitsCrossEntropy()


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_losses_are_unchanged_by_the_fused_path(tied, tiny_overrides, pretrain_data):
    """3 steps of 2 micro-batches each, AdamW, fp32: the recipe's loss declares whether it can be fused."""
    losses = {}
    for recipe in (PretrainRecipe(), UnfusedRecipe()):
        extra = {"train.train_iters": 3, "model.tie_embeddings": tied, "train.eval_iters": 0}
        trainer = Trainer(load_config(None, tiny_overrides(*pretrain_data, extra)), recipe, quiet=True)
        fused = type(recipe) is PretrainRecipe
        assert trainer.fused_loss == fused
        it = iter(trainer.train_data)
        losses[fused] = [trainer.train_step(trainer.next_microbatches(it))["loss"] for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-6)
    assert losses[True][2] < losses[True][0]
