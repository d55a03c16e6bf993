"""`megapipe posttrain projector` (LLaVA's stage 1) on a tiny random Qwen2.5-VL and the bundled image-caption pairs
(pipelines/data/captions.jsonl): only the projector's weights change, the caption loss falls; a text-only model is
refused in one sentence; the bundled pairs are what tools/make_caption_fixture.py writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from tests.helpers.hf_vl import make_vl_dir

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
CAPTIONS = ROOT / "pipelines" / "data" / "captions.jsonl"
ARGS = ["--data", str(CAPTIONS), "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8",
        "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1", "--quiet"]


def test_only_the_projector_trains_and_the_caption_loss_falls(tmp_path, capsys, one_thread):
    from megapipe.checkpoint.load import load_model
    from megapipe.checkpoint.manifest import find_latest, read_manifest

    hf_dir, _ = make_vl_dir(tmp_path / "hf", chat=True)
    assert main(["import", "hf", str(hf_dir), str(tmp_path / "ckpt"), "--quiet"]) == 0
    run = tmp_path / "run"
    assert main(["posttrain", "projector", "--load", str(tmp_path / "ckpt"), "--save", str(run), "--train-iters",
                 "1", "--set", "lora.rank=4", *ARGS]) != 0
    assert "lora.rank = 4 does not apply" in " ".join(capsys.readouterr().err.split())
    assert main(["posttrain", "projector", "--load", str(tmp_path / "ckpt"), "--save", str(run), "--train-iters",
                 "12", "--data-cache-path", str(tmp_path / "cache"), *ARGS]) == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
    base, tuned = dict(load_model(tmp_path / "ckpt").model.named_parameters()), \
        dict(load_model(run).model.named_parameters())
    changed = {n for n in base if not torch.equal(base[n], tuned[n])}
    assert changed == {n for n in base if n.startswith("visual.merger.")}, sorted(changed)
    assert read_manifest(find_latest(run))["stage"] == "projector"


def test_a_text_only_model_is_refused(tmp_path, capsys):
    from tests.helpers.hf_tiny import make_hf_dir

    hf_dir, _ = make_hf_dir(tmp_path / "hf", "llama")
    assert main(["import", "hf", str(hf_dir), str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert main(["posttrain", "projector", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "run"),
                 "--train-iters", "1", *ARGS]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "posttrain projector trains a vision-language model's projector; this model has no vision tower" in err


def test_caption_tool_reproduces_the_bundled_pairs(tmp_path):
    out = tmp_path / "captions.jsonl"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_caption_fixture.py"), str(out)], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.read_bytes() == CAPTIONS.read_bytes()
