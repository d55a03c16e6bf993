"""`megapipe posttrain rl` end to end on a tiny random model: every per-step metric of a real run, the lineage in
the manifest and in `checkpoint inspect`, the weight check and the mismatch check firing on a desynchronised engine,
and an empty batch (every group dropped) skipped without an update.

The reward is the user function tests.helpers.rl:has_e (1 for a completion with an "e"), which a random model earns
about half the time, so every batch has a learning signal."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megapipe.cli import main
from tests.helpers.rl import make_config, records, train

EVERY_STEP = ("loss", "pg_loss", "entropy", "clip_low", "clip_high", "kl", "reward", "reward_std", "accuracy",
              "reward/has_e", "reward/has_e_std", "reward/format", "reward/format_std", "completion_len",
              "completion_len_max", "truncated", "groups_dropped", "mismatch_mean", "mismatch_max", "mismatch_kl",
              "weight_sync_s", "rollout_s", "logprob_s", "rollout_tokens_per_s")

HAS_E = dict(reward=["tests.helpers.rl:has_e"])


def test_a_run_through_the_cli_logs_every_metric_and_its_lineage(rl_base, tmp_path, capsys):
    """Truncated sampling (temperature, top-k, top-p) included: the mismatch compares raw log-probs on both sides,
    so it stays at fp32 round-off."""
    run = tmp_path / "run"
    args = ["posttrain", "rl", "--load", str(rl_base), "--save", str(run), "--task", "arithmetic", "--reward",
            "tests.helpers.rl:has_e", "format=0.5", "--format-regex", "o", "--prompts-per-step", "4",
            "--group-size", "4", "--max-completion-tokens", "8", "--max-prompt-tokens", "48", "--micro-batch-size",
            "4", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1", "--precision", "fp32", "--kl-coef",
            "0.1", "--dynamic-sampling", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--quiet"]
    assert main(args) == 0
    recs = [r for r in records(run) if r["kind"] == "train"]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        missing = [k for k in EVERY_STEP if k not in r]
        assert not missing, (r["step"], missing)
        assert 0 <= r["reward/has_e"] <= 1 and 0 <= r["reward/format"] <= 1
        assert r["reward"] == pytest.approx(r["reward/has_e"] + 0.5 * r["reward/format"])
        assert 0 < r["completion_len"] <= r["completion_len_max"] <= 8
        assert 0 <= r["groups_dropped"] <= 1 and 0 <= r["clip_low"] <= 1 and 0 <= r["clip_high"] <= 1
        assert r["mismatch_max"] < 1e-5 and r["mismatch_kl"] < 1e-10 and r["entropy"] > 0
        assert math.isfinite(r["loss"]) and r["skipped"] == 0
    assert recs[0]["kl"] == 0.0 and recs[-1]["kl"] > 0  # the policy leaves the reference after the first update
    assert any((run / "tensorboard").iterdir())

    m = json.loads((run / "step_00000003" / "megapipe.json").read_text())
    assert m["stage"] == "rl" and m["parent"] == str(rl_base) and m["posttrain_start"] == str(rl_base.absolute())
    assert m["rl"]["rewards"] == ["tests.helpers.rl:has_e", "format"] and m["data_state"] == {"consumed_prompts": 12}
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "rl@3" in out and "<- pretrain@0" in out

    from megapipe.plot import plot_runs

    figures = plot_runs([run], tmp_path / "plots")["figures"]
    assert [s["key"] for s in figures["reward"]["series"]] == ["reward", "accuracy"]
    assert [s["key"] for s in figures["length"]["series"]] == ["completion_len"]
    assert [s["key"] for s in figures["mismatch"]["series"]] == ["mismatch_kl", "mismatch_max"]
    assert figures["kl"]["series"][0]["values"] == [r["kl"] for r in recs]
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0


def _run_until_error(cfg, monkeypatch, corrupt):
    """Train with the engine's load_weights replaced by ``corrupt(engine, original, state)``."""
    from megapipe.inference.engine import LLMEngine

    original = LLMEngine.load_weights
    calls = []

    def load_weights(engine, state):
        calls.append(1)
        if len(calls) == 1:  # the first sync (before step 1) is a real one
            return original(engine, state)
        return corrupt(engine, original, state)

    monkeypatch.setattr(LLMEngine, "load_weights", load_weights)
    return train(cfg)


@pytest.mark.parametrize("case", ["skipped", "one tensor corrupted"])
def test_the_weight_check_names_what_the_sync_missed(rl_base, tmp_path, monkeypatch, case):
    from megapipe.posttrain.rl.engine_sync import WeightSyncError

    cfg = make_config(rl_base, tmp_path / "run", **HAS_E)
    if case == "skipped":
        def corrupt(engine, original, state):
            return None
        match = r"the rollout engine's weights are not the trainer's after the weight sync: \d+ of 22 tensors differ"
    else:
        def corrupt(engine, original, state):
            state = dict(state)
            w = state["layers.1.attention.wk.weight"].clone()
            w[0, 0] += 1e-3
            state["layers.1.attention.wk.weight"] = w
            return original(engine, state)
        match = (r"1 of 22 tensors differ \(layers.1.attention.wk.weight \(1 of 2048 values differ, by up to "
                 r"0.001\)\)")
    with pytest.raises(WeightSyncError, match=match):
        _run_until_error(cfg, monkeypatch, corrupt)
    assert [r["step"] for r in records(tmp_path / "run")] == [1]  # stopped before step 2 trained


def test_the_mismatch_check_stops_a_desynchronised_engine(rl_base, tmp_path, monkeypatch):
    """With the weight check off, an engine left on step 0's weights samples from another policy: the mismatch
    bound stops the run before that batch trains, saying by how much and what to look at."""
    from megapipe.posttrain.rl.rollout import MismatchError

    run = tmp_path / "run"
    cfg = make_config(rl_base, run, check_weights=False, mismatch_metric="max", max_mismatch=1e-4,
                      **{"train.lr": 1e-2}, **HAS_E)
    with pytest.raises(MismatchError, match=r"the rollout engine and the trainer disagree on the sampled tokens' "
                                            r"log-probs \(batch of prompts 4..7\): mismatch_max = \S+ > "
                                            r"--max-mismatch 0.0001"):
        _run_until_error(cfg, monkeypatch, lambda engine, original, state: None)
    recs = records(run)
    assert [r["step"] for r in recs] == [1] and recs[0]["mismatch_max"] < 1e-5
    assert not list(run.glob("step_*"))


def test_a_batch_with_every_group_dropped_is_skipped_without_an_update(rl_base, tmp_path):
    """A reward no completion can earn (a format regex that never matches): every reward is 0, every group is
    dropped by dynamic sampling; the steps are skipped (no update, not counted as non-finite losses) and the run
    ends normally."""
    from megapipe.checkpoint import load_checkpoint
    from megapipe.models import build_model

    run = tmp_path / "run"
    cfg = make_config(rl_base, run, dynamic_sampling=True, reward=["format"], format_regex="(?!)",
                      **{"train.train_iters": 2, "train.max_nan_skips": 1})
    summary, trainer = train(cfg)
    recs = records(run)
    assert [(r["skipped"], r["groups_dropped"], r["reward"]) for r in recs] == [(1, 1.0, 0.0), (1, 1.0, 0.0)]
    assert summary["skipped_steps"] == 2 and trainer.state.updates == 0
    base = build_model(trainer.cfg.model)
    load_checkpoint(rl_base, base, optimizer=None, load_optim=False, load_rng=False)
    for (name, p), q in zip(trainer.model.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_a_micro_batch_that_does_not_divide_the_rollout_batch_is_named_in_rl_terms(rl_base, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["posttrain", "rl", "--load", str(rl_base), "--save", str(run), "--task", "arithmetic",
                 "--prompts-per-step", "4", "--group-size", "6", "--micro-batch-size", "5"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert ("train.global_batch_size = 24 is not divisible by train.micro_batch_size = 5 (posttrain rl: the global "
            "batch is rl.prompts_per_step x rl.group_size = 4 x 6 sequences)") in err
    assert not run.exists()


@pytest.mark.parametrize("other", ["a separate scoring pass", "one row per completion"])
def test_the_on_policy_fast_path_trains_like_the_plain_one(rl_base, tmp_path, other):
    """One update per batch takes the old log-probs and the mismatch from the training forward, and packs each
    group's completions after their prompt: two steps of that equal two steps with a separate no-grad scoring pass,
    and two steps with one row per completion (same rollouts, loss and gradient norm within round-off, the same
    mismatch figures, and weights apart by far less than the updates: AdamW's lr 1e-3 step on an element whose
    gradient is round-off either way is round-off amplified, up to ~6e-5 here)."""
    from megapipe.training.recipes.rl import RLRecipe
    from megapipe.training.trainer import Trainer

    common = {**HAS_E, "train.train_iters": 2, "train.precision": "fp32", "temperature": 0.8}
    runs = {}
    for name in ("fast", other):
        cfg = make_config(rl_base, tmp_path / name.replace(" ", "-"), shared_prompts=name != "one row per completion",
                          **common)
        recipe = RLRecipe(cfg.rl)
        if name == "a separate scoring pass":
            recipe.meter = None  # the loss measures nothing, the rollout scores the batch
        trainer = Trainer(cfg, recipe, quiet=True)
        assert trainer.train_data.worker.on_policy == (name != "a separate scoring pass")
        trainer.train()
        runs[name] = (trainer.model.state_dict(), records(trainer.cfg.checkpoint.save))
    (fast, fast_recs), (slow, slow_recs) = runs["fast"], runs[other]
    for k, v in fast.items():
        torch.testing.assert_close(v, slow[k], rtol=0, atol=2e-4, msg=k)
    for a, b in zip(fast_recs, slow_recs, strict=True):
        assert (a["reward"], a["completion_len"]) == (b["reward"], b["completion_len"])
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["mismatch_max"] < 1e-5 and b["mismatch_max"] < 1e-5
        assert a["mismatch_mean"] == pytest.approx(b["mismatch_mean"], abs=1e-6)
    assert slow_recs[0]["logprob_s"] > 0 if other == "a separate scoring pass" else True


def _groups_and_greedy(rl_base, save, **rl):
    """The first rollout batch's completions sampled with the run's own sampling parameters, and the greedy
    (argmax) completion of each prompt by the same engine holding the same policy."""
    from dataclasses import replace

    from megapipe.posttrain.rl.engine_sync import full_state_dict
    from megapipe.posttrain.rl.rollout import prompt_seed, sample_groups
    from megapipe.training.recipes.rl import RLRecipe
    from megapipe.training.trainer import Trainer

    cfg = make_config(rl_base, save, **HAS_E, **rl)
    worker = Trainer(cfg, RLRecipe(cfg.rl), quiet=True).train_data.worker
    worker.sync(full_state_dict(worker.model))
    prompts = worker.prompts(0)
    ids = [worker.renderer.encode(p.prompt, p.where) for p in prompts]
    seeds = [prompt_seed(worker.seed, p.index) for p in prompts]
    params = worker.sampling_params()
    sampled = [[s.ids for s in g] for g in sample_groups(worker.engine, ids, seeds, params)]
    greedy = [g[0].ids for g in sample_groups(worker.engine, ids, seeds, replace(params, n=1, temperature=0.0))]
    return sampled, greedy


def test_top_p_restricts_sampling_to_the_nucleus(rl_base, tmp_path):
    """--top-p keeps the smallest set of most likely tokens whose mass reaches p (at least one token): with a tiny
    p only the argmax remains, so every completion of every group is the greedy decoding of the same policy; with
    p = 1 at the same temperature the completions of a group differ."""
    sampled, greedy = _groups_and_greedy(rl_base, tmp_path / "nucleus", temperature=1.5, top_p=1e-6)
    assert sampled == [[g] * 4 for g in greedy]
    sampled, greedy = _groups_and_greedy(rl_base, tmp_path / "full", temperature=1.5, top_p=1.0)
    assert all(len({tuple(c) for c in group}) > 1 for group in sampled)


@pytest.mark.parametrize("mask", [True, False])
def test_mask_truncated_takes_no_loss_on_completions_cut_at_the_limit(rl_base, tmp_path, mask):
    """With --min-completion-tokens = --max-completion-tokens no completion can end before the limit: all are
    truncated. Under --mask-truncated nothing is trained on (the step is skipped, the weights stay the base's);
    without it the same batch updates the weights."""
    from megapipe.checkpoint import load_checkpoint
    from megapipe.models import build_model

    cfg = make_config(rl_base, tmp_path / "run", mask_truncated=mask, min_completion_tokens=8,
                      **{**HAS_E, "train.train_iters": 1, "train.max_nan_skips": 1})
    _, trainer = train(cfg)
    rec, = records(tmp_path / "run")
    assert rec["truncated"] == 1.0 and rec["completion_len"] == 8
    base = build_model(trainer.cfg.model)
    load_checkpoint(rl_base, base, optimizer=None, load_optim=False, load_rng=False)
    same = [torch.equal(p, q) for p, q in zip(trainer.model.state_dict().values(), base.state_dict().values(),
                                               strict=True)]
    assert all(same) if mask else not any(same)
    assert rec["skipped"] == (1 if mask else 0)
