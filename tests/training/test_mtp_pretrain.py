"""`megapipe pretrain --mtp-num-layers`: per-depth MTP losses in metrics.jsonl, the reported LM loss untouched by
MTP, exact resume, a new pretraining run adding MTP to a checkpoint without."""

from __future__ import annotations

import json

import pytest

from megapipe.cli import main

SMALL = ["--model", "deepseek-v3-tiny", "--set", "model.num_layers=2", "--set", "model.hidden_size=64",
         "--set", "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=4",
         "--set", "model.moe_ffn_hidden_size=32", "--set", "model.moe_shared_expert_intermediate_size=32",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
         "--eval-iters", "1", "--log-interval", "1", "--lr", "3e-3", "--quiet"]


def run(pretrain_data, out, *extra) -> list[dict]:
    prefix, tok = pretrain_data
    assert main(["pretrain", "--data-path", prefix, "--tokenizer", str(tok), *SMALL, "--save", str(out),
                 *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def test_mtp_losses_are_logged_and_the_lm_loss_is_the_same(pretrain_data, tmp_path):
    with_mtp = train(run(pretrain_data, tmp_path / "mtp", "--train-iters", "4", "--mtp-num-layers", "2"))
    without = train(run(pretrain_data, tmp_path / "plain", "--train-iters", "1"))
    assert all("mtp/loss_1" in r and "mtp/loss_2" in r for r in with_mtp)
    assert "mtp/loss_1" not in without[0]
    assert with_mtp[0]["loss"] == pytest.approx(without[0]["loss"], rel=1e-6)  # step 1: before any update
    assert with_mtp[0]["mtp/loss_1"] > with_mtp[0]["loss"] * 0.5  # a cross-entropy per LM token, not a scaled one


def test_exact_resume_with_mtp(pretrain_data, tmp_path):
    common = ("--train-iters", "4", "--mtp-num-layers", "2", "--save-interval", "2")
    straight = train(run(pretrain_data, tmp_path / "a", *common))
    run(pretrain_data, tmp_path / "b", *common, "--exit-interval", "2")
    resumed = train(run(pretrain_data, tmp_path / "b", *common, "--load", str(tmp_path / "b")))
    keys = ("step", "loss", "mtp/loss_1", "mtp/loss_2", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed if r["step"] > 2] == [[r[k] for k in keys] for r in straight[2:]]


def test_a_new_pretraining_run_adds_mtp_and_a_resume_cannot(pretrain_data, tmp_path, capsys):
    run(pretrain_data, tmp_path / "base", "--train-iters", "1")
    base = str(tmp_path / "base")
    added = train(run(pretrain_data, tmp_path / "ft", "--train-iters", "1", "--mtp-num-layers", "1", "--load", base,
                      "--finetune"))
    assert "mtp/loss_1" in added[0]
    prefix, tok = pretrain_data
    code = main(["pretrain", "--data-path", prefix, "--tokenizer", str(tok), *SMALL, "--train-iters", "2",
                 "--mtp-num-layers", "1", "--load", base, "--save", base])
    assert code != 0 and "holds no multi-token prediction modules" in capsys.readouterr().err
