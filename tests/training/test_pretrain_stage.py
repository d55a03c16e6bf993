"""The `megapipe pretrain` command in-process: flags, blends, --finetune, user mistakes."""

from __future__ import annotations

import json

import pytest
import torch

from megapipe.cli import main
from megapipe.errors import MegapipeError

TINY = ["--model", "tiny", "--set", "model.num_layers=2", "--set", "model.hidden_size=64", "--set",
        "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
        "--eval-iters", "1", "--log-interval", "1", "--quiet"]


BLEND_TOKEN = 300  # every token of the second dataset: a sample says which dataset it came from


def test_blend_run_then_finetune_from_it(pretrain_data, tmp_path):
    """A 0.7/0.3 blend of two different datasets: the run's samples come 70/30 from them (the blend index the run
    built and cached, and the samples' tokens), then a finetune starts from its weights."""
    import numpy as np

    from megapipe.data.gpt_dataset import build_gpt_datasets
    from megapipe.data.indexed import IndexedDatasetWriter

    prefix, tok = pretrain_data
    other = tmp_path / "other_text_document"
    with IndexedDatasetWriter(other, np.uint16) as w:
        for n in np.random.default_rng(0).integers(20, 90, 120):
            w.add_document(np.full(n, BLEND_TOKEN))
    run = tmp_path / "run"
    args = ["pretrain", "--data-path", "0.7", prefix, "0.3", str(other), "--tokenizer", str(tok), *TINY]
    assert main([*args, "--train-iters", "25", "--save", str(run)]) == 0
    base = json.loads((run / "step_00000025" / "megapipe.json").read_text())
    assert base["step"] == 25 and base["parent"] is None
    data = base["config"]["data"]
    assert data["data_path"] == ["0.7", prefix, "0.3", str(other)]

    # the blend the run trained on (a cache hit: rebuilt from nothing would not be)
    train = build_gpt_datasets(data["data_path"], data["split"], data["seq_length"], {"train": 100, "valid": 4},
                               base["config"]["train"]["seed"], data["cache_dir"])["train"]
    assert train.cache_hit and len(train) == 100
    from_other = train.dataset_index == 1
    assert int(from_other.sum()) == 30 and int(from_other[:50].sum()) == 15  # 0.3 of them, spread evenly
    for i in range(len(train)):
        assert bool((train[i] == BLEND_TOKEN).all()) == bool(from_other[i]), i

    ft = tmp_path / "ft"  # no --tokenizer: the checkpoint's own is used (and copied into the new checkpoints)
    assert main(["pretrain", "--data-path", prefix, *TINY, "--train-iters", "2", "--save", str(ft), "--load", str(run),
                 "--finetune", "--lr", "0"]) == 0  # lr 0: the weights must come through unchanged
    assert (ft / "step_00000002" / "tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    m = json.loads((ft / "step_00000002" / "megapipe.json").read_text())
    assert m["step"] == 2 and m["parent"] == str((run / "step_00000025").absolute())
    assert m["trainer_state"]["updates"] == 2 and m["data_state"] == {"consumed_samples": 8}  # a new run

    from megapipe.checkpoint.load import load_model

    a = load_model(run / "step_00000025").model
    b = load_model(ft / "step_00000002").model
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
