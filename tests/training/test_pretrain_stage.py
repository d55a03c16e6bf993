"""The `megapipe pretrain` command in-process: flags, blends, --finetune, user mistakes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megapipe.cli import main
from megapipe.errors import MegapipeError

TINY = ["--model", "tiny", "--set", "model.num_layers=2", "--set", "model.hidden_size=64", "--set",
        "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
        "--eval-iters", "1", "--log-interval", "1", "--quiet"]


def test_blend_run_then_finetune_from_it(pretrain_data, tmp_path):
    prefix, tok = pretrain_data
    other = tmp_path / "copy_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, str(other) + ext)
    run = tmp_path / "run"
    args = ["pretrain", "--data-path", "0.7", prefix, "0.3", str(other), "--tokenizer", str(tok), *TINY]
    assert main([*args, "--train-iters", "3", "--save", str(run)]) == 0
    base = json.loads((run / "step_00000003" / "megapipe.json").read_text())
    assert base["step"] == 3 and base["parent"] is None
    assert base["config"]["data"]["data_path"] == ["0.7", prefix, "0.3", str(other)]

    ft = tmp_path / "ft"  # no --tokenizer: the checkpoint's own is used (and copied into the new checkpoints)
    assert main(["pretrain", "--data-path", prefix, *TINY, "--train-iters", "2", "--save", str(ft), "--load", str(run),
                 "--finetune", "--lr", "0"]) == 0  # lr 0: the weights must come through unchanged
    assert (ft / "step_00000002" / "tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    m = json.loads((ft / "step_00000002" / "megapipe.json").read_text())
    assert m["step"] == 2 and m["parent"] == str((run / "step_00000003").absolute())
    assert m["trainer_state"]["updates"] == 2 and m["data_state"] == {"consumed_samples": 8}  # a new run

    from megapipe.checkpoint import load_model_for_inference

    a, _, _ = load_model_for_inference(run / "step_00000003")
    b, _, _ = load_model_for_inference(ft / "step_00000002")
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("extra, message", [
    (["--bf16", "--fp16"], "--bf16 and --fp16 are both given"),
    (["--train-iters", "1", "--set", "model.vocab_size=100"], "model.vocab_size = 100 is smaller than the tokenizer"),
    ([], "neither train.train_iters (--train-iters) nor train.train_tokens"),
    (["--train-iters", "1", "--load", "/nonexistent/run"], "/nonexistent/run does not exist"),
    (["--train-iters", "1", "--save", __file__], f"cannot create the run directory {__file__}: File exists"),
])
def test_mistakes_are_one_clear_error(pretrain_data, tmp_path, capsys, extra, message):
    prefix, tok = pretrain_data
    code = main(["pretrain", "--data-path", prefix, "--tokenizer", str(tok), *TINY, *extra])
    assert code == MegapipeError.exit_code
    assert message in " ".join(capsys.readouterr().err.split())
