"""`megapipe pretrain --model deepseek-v3-tiny` (multi-latent attention + DeepSeek's MoE) and `deepseek-v32-tiny` (with
the sparse attention's indexer, 8 keys of 32 per query) run a few steps through the CLI, loss finite and falling,
and their checkpoints export as the DeepseekV3ForCausalLM / DeepseekV32ForCausalLM that transformers loads."""

from __future__ import annotations

import json
import math

import pytest

from megapipe.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("preset, extra, architecture", [
    ("deepseek-v3-tiny", [], "DeepseekV3ForCausalLM"),
    ("deepseek-v32-tiny", ["--dsa-indexer-topk", "8"], "DeepseekV32ForCausalLM")])
def test_pretrain_deepseek_tiny_then_export(pretrain_data, tmp_path, preset, extra, architecture):
    prefix, tokenizer = pretrain_data
    run = tmp_path / "run"
    assert main(["pretrain", "--data-path", str(prefix), "--tokenizer", str(tokenizer), "--model", preset, *extra,
                 "--set", "model.num_layers=2", "--set", "model.hidden_size=64", "--set", "model.num_heads=4",
                 "--rotary-scaling-factor", "4", "--original-max-position-embeddings", "16", "--mscale-all-dim", "1",
                 "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                 "--lr", "3e-3", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1",
                 "--split", "100,0,0", "--save", str(run), "--quiet"]) == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert main(["export", "hf", str(run), str(tmp_path / "hf"), "--quiet"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["rope_parameters"]["rope_type"] == "yarn"
