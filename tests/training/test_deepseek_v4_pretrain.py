"""`megapipe pretrain --model deepseek-v4-tiny --mtp-num-layers 1` (compressed attention, hyper-connections,
hash-routed MoE, an MTP module; Muon by default) runs a few steps through the CLI, loss finite and falling, the MTP
loss logged, and its checkpoint exports as a DeepseekV4ForCausalLM (the MTP module under ``mtp.0.*``) that
transformers loads to the same logits; the layouts and packing it does not declare are refused in one sentence."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megapipe.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pretrain_deepseek_v4_tiny_with_muon_then_export(pretrain_data, tmp_path, capsys):
    import transformers

    from megapipe.checkpoint.hf.bridge import load_hf_model

    prefix, tokenizer = pretrain_data
    run = tmp_path / "run"
    args = ["pretrain", "--data-path", str(prefix), "--tokenizer", str(tokenizer), "--model", "deepseek-v4-tiny",
            "--seq-length", "40", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--lr", "3e-3", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1",
            "--split", "100,0,0", "--mtp-num-layers", "1", "--save", str(run), "--quiet"]
    assert main(args) == 0
    manifest = json.loads((run / "step_00000004" / "megapipe.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    mtp = [r["mtp/loss_1"] for r in records if r["kind"] == "train"]
    assert all(math.isfinite(x) for x in mtp) and mtp[-1] < mtp[0]
    assert manifest["model"]["arch"] == "deepseek_v4" and manifest["config"]["optim"]["optimizer"] == "muon"
    out = tmp_path / "hf"
    assert main(["export", "hf", str(run), str(out), "--dtype", "fp32", "--quiet"]) == 0
    loaded = load_hf_model(out)
    assert loaded.cfg.mtp_depth == 1 and json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ours = loaded.model.eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(36)[None] % 64
    with torch.no_grad():
        got, want = ours(tokens), theirs(tokens).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    capsys.readouterr()
    assert main([*args[:-3], "--reset-attention-mask", "--save", str(tmp_path / "packed")]) != 0
    assert "DeepSeek-V4" in capsys.readouterr().err and not (tmp_path / "packed").exists()
