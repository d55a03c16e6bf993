"""The loop takes a recipe: its stage name reaches the manifest, packed pretraining samples (Megatron's
--reset-attention-mask / --reset-position-ids / --eod-mask-loss), the exit flags, and a refused run leaves nothing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import load_config
from megapipe.errors import ConfigError, DataError
from megapipe.training.recipes import PretrainRecipe
from megapipe.training.recipes.pretrain import split_at_eod
from megapipe.training.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def config(tiny_overrides, pretrain_data, extra=None):
    return load_config(None, tiny_overrides(*pretrain_data, extra))


def test_split_at_eod_follows_megatron():
    """EOD = 0: it belongs to the document it ends; the next token starts a new document at position 0; the
    prediction made at the EOD token (of the next document's first token) does not count with --eod-mask-loss."""
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4]])
    out = split_at_eod({"tokens": tokens, "labels": tokens.roll(-1, 1)}, 0, True, True, True)
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert out["loss_mask"].tolist() == [[True, True, False, True, True, True, False, True]]
    plain = split_at_eod({"tokens": tokens, "labels": tokens}, 0, False, False, False)
    assert sorted(plain) == ["labels", "tokens"]


def test_packed_pretraining_loss_equals_each_document_alone(tiny_overrides, pretrain_data):
    """With the three flags, the loss of a micro-batch is the token mean of its documents' losses run one by one."""
    from megapipe.parallel.step import eval_step

    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 4, "data.reset_attention_mask": True,
                                                 "data.reset_position_ids": True, "data.eod_mask_loss": True,
                                                 "data.seq_length": 128})
    trainer = Trainer(cfg, quiet=True)
    it = iter(trainer.train_data)
    mb = next(b for _ in range(4) for b in trainer.next_microbatches(it) if b["document_ids"].max() > 1)
    packed = eval_step(trainer.model, [mb], trainer.dims, trainer.loss)
    model, eod = trainer.model, trainer.tokenizer.eod_id
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(mb["tokens"].shape[0]):
            for d in mb["document_ids"][row].unique():
                cols = (mb["document_ids"][row] == d).nonzero().flatten()
                tokens, labels = mb["tokens"][row, cols], mb["labels"][row, cols]
                keep = tokens != eod
                logits = model.logits(model(tokens[None], return_hidden=True))[0]
                total += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
                count += int(keep.sum())
    assert packed.units == count
    assert packed.loss.item() == pytest.approx(total / count, rel=1e-5)


def test_packed_sequences_are_refused_with_pipeline_and_context_parallelism(tiny_overrides, pretrain_data):
    from stages.pretrain import check_layout

    for layout in ({"parallel.pp": 2}, {"parallel.cp": 2}):
        cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "data.reset_attention_mask": True,
                                                     **layout})
        with pytest.raises(ConfigError, match="packed sequences .* not supported with parallel.pp"):
            check_layout(cfg, 2)
    check_layout(config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "data.reset_attention_mask": True,
                                                        "parallel.tp": 2}), 2)


class NamedRecipe(PretrainRecipe):
    stage = "unit-test-stage"

    def manifest(self, ctx):
        return {"recipe_note": "from the recipe"}


def test_the_recipe_names_the_stage_in_the_manifest(tiny_overrides, pretrain_data, tmp_path):
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "checkpoint.save": str(tmp_path / "a")})
    first = Trainer(cfg, NamedRecipe(), quiet=True).train()["checkpoint"]
    manifest = json.loads((tmp_path / "a" / "step_00000002" / "megapipe.json").read_text())
    assert first.endswith("step_00000002") and manifest["stage"] == "unit-test-stage"
    assert manifest["recipe_note"] == "from the recipe" and manifest["parent"] is None
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "checkpoint.save": str(tmp_path / "b"),
                                                 "checkpoint.load": first, "checkpoint.finetune": True})
    Trainer(cfg, quiet=True).train()
    child = json.loads((tmp_path / "b" / "step_00000002" / "megapipe.json").read_text())
    assert child["stage"] == "pretrain" and child["parent"] == first


def test_exit_interval_stops_with_a_checkpoint(tiny_overrides, pretrain_data, tmp_path):
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 10, "train.exit_interval": 3,
                                                 "checkpoint.save": str(tmp_path)})
    summary = Trainer(cfg, quiet=True).train()
    assert summary["steps"] == 3 and summary["stopped_by"] == "--exit-interval 3"
    assert summary["checkpoint"].endswith("step_00000003") and summary["eval_loss"] is None
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 10, "train.exit_duration_in_mins": 0.0,
                                                 "checkpoint.save": str(tmp_path / "d")})
    summary = Trainer(cfg, quiet=True).train()
    assert summary["steps"] == 1 and summary["stopped_by"] == "--exit-duration-in-mins 0"
    assert (tmp_path / "d" / "step_00000001" / "megapipe.json").is_file()


def test_a_run_refused_before_its_first_step_leaves_nothing(tiny_overrides, pretrain_data, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "model.vocab_size": 256,
                                                 "checkpoint.save": str(run_dir)})
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        Trainer(cfg, quiet=True)
    cfg = config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "checkpoint.save": str(run_dir)})
    trainer = Trainer(cfg, quiet=True)
    trainer.cfg.model.vocab_size = 100  # as if the data had been made with a larger tokenizer
    with pytest.raises(DataError, match="holds token id"):
        trainer.train()
    assert not run_dir.exists()


def test_seq_length_beyond_the_model_positions_is_refused(tiny_overrides, pretrain_data):
    with pytest.raises(ConfigError, match=r"= 32 is beyond the position limit .*max_position_embeddings = 16"):
        Trainer(config(tiny_overrides, pretrain_data, {"train.train_iters": 2, "model.max_position_embeddings": 16}))
