"""`megapipe posttrain prune`: exact slicing (units that contribute nothing are found and removed without changing
the logits, GQA groups included), importance beats random at equal shape on a trained model, the pruned checkpoint
exports to Hugging Face with logit parity, impossible targets are clear errors, the before/after table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from megapipe.config import ModelConfig
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model
from megapipe.posttrain.prune import PruneTargets, plan_shape, prune_checkpoint, prune_model

MODEL = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=512,
             max_position_embeddings=256)
TINY = ["--model", "tiny", *[x for k, v in MODEL.items() if k != "vocab_size" for x in ("--set", f"model.{k}={v}")]]


def batches(n: int = 4, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 512, (2, 33), generator=g)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:]})
    return out


@torch.no_grad()
def test_units_that_contribute_nothing_are_removed_without_changing_the_logits():
    cfg = ModelConfig(**MODEL, tie_embeddings=True)
    model = build_model(cfg, seed=0)
    dead_ffn = [3, 50, 77]
    for block in model.layers.values():
        block.feed_forward.w1.weight[dead_ffn] = 0  # silu(0) * (w3 x) = 0: these neurons never fire
        block.attention.wv.weight[16:32] = 0  # KV group 1 sees zero values: its two query heads output 0
    tokens = batches(1)[0]["tokens"]
    new_cfg = plan_shape(cfg, PruneTargets(ffn=125, heads=2, kv_heads=1))
    pruned, imp, keep = prune_model(model, new_cfg, batches())
    assert all(not set(dead_ffn) & set(f.tolist()) for f in keep.ffn)
    assert [k.tolist() for k in keep.kv] == [[0]] * 4 and [h.tolist() for h in keep.heads] == [[0, 1]] * 4
    assert (pruned(tokens) - model(tokens)).abs().max() < 1e-5

    # depth: dropping the least important block equals running the model without it
    pruned, imp, keep = prune_model(model, plan_shape(cfg, PruneTargets(layers=3)), batches(), depth_metric="loss")
    gone = next(i for i in range(4) if i not in keep.layers)
    assert int(imp.layers.argmin()) == gone
    block = model.layers[str(gone)]
    model.layers[str(gone)] = type("Skip", (torch.nn.Module,), {"forward": lambda self, x, *a: x})()
    assert (pruned(tokens) - model(tokens)).abs().max() < 1e-5
    model.layers[str(gone)] = block


def test_gqa_selection_keeps_whole_groups_and_regular_query_counts():
    from megapipe.posttrain.prune import Importance, select

    cfg = ModelConfig(**{**MODEL, "num_heads": 8, "num_kv_heads": 4, "num_layers": 1})
    heads = torch.tensor([[1.0, 9, 2, 3, 8, 7, 0.5, 0.1]])  # groups (0,1) (2,3) (4,5) (6,7): sums 10 5 15 0.6
    imp = Importance(torch.rand(1, 128), heads, torch.rand(64), torch.ones(1), "bi")
    keep = select(imp, cfg, plan_shape(cfg, PruneTargets(heads=4, kv_heads=2)))
    assert keep.kv[0].tolist() == [0, 2] and keep.heads[0].tolist() == [0, 1, 4, 5]
    keep = select(imp, cfg, plan_shape(cfg, PruneTargets(heads=2, kv_heads=2)))
    assert keep.heads[0].tolist() == [1, 4]  # the best query head of each kept group


@pytest.mark.parametrize("targets, message", [
    (PruneTargets(), "give a target"),
    (PruneTargets(heads=5), "--heads 5 is more than the model has (num_heads = 4)"),
    (PruneTargets(ffn=0), "--ffn 0 must be >= 1"),
    (PruneTargets(heads=3, kv_heads=2), "--heads 3 is not a multiple of --kv-heads 2"),
    (PruneTargets(heads=1), "--heads 1 is not a multiple of the model's 2 KV groups (num_kv_heads)"),
    (PruneTargets(heads=4, kv_heads=1), "needs 4 query heads per KV group, but each group has 2"),
    (PruneTargets(layers=9), "--layers 9 is more than the model has (num_layers = 4)"),
    (PruneTargets(target_params=1.5e9), "must be below the model's"),
    (PruneTargets(target_params=float("nan")), "--target-params nan must be a finite fraction"),
    (PruneTargets(target_params=0.001), "cannot be reached by narrowing hidden and FFN sizes alone"),
    (PruneTargets(target_params=0.5, hidden=32), "--target-params chooses --hidden and --ffn itself"),
])
def test_impossible_targets_are_clear_errors(targets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_shape(ModelConfig(**MODEL), targets)


def test_the_architectures_head_dim_rule_is_kept():
    gpt2 = ModelConfig(arch="gpt2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, vocab_size=512,
                       norm_type="layernorm", activation="gelu_tanh", position_embedding="learned", qkv_bias=True,
                       attn_out_bias=True, mlp_bias=True, max_position_embeddings=64)
    with pytest.raises(ConfigError, match="--hidden 48 --heads 4: a gpt2 model keeps head_dim = hidden_size / "
                                          "num_heads = 16"):
        plan_shape(gpt2, PruneTargets(hidden=48))
    assert plan_shape(gpt2, PruneTargets(hidden=48, heads=3)).dim_per_head == 16
    llama = plan_shape(ModelConfig(**MODEL), PruneTargets(hidden=48))  # Llama states head_dim in its config
    assert (llama.head_dim, llama.dim_per_head) == (16, 16)
    fit = plan_shape(ModelConfig(**MODEL), PruneTargets(target_params=0.6))
    from megapipe.posttrain.prune import param_count

    assert 0.5 < param_count(fit) / param_count(ModelConfig(**MODEL)) <= 0.6


def test_importance_beats_random_pruning_to_the_same_shape(sft_model, chat_data, tmp_path):
    """On a trained model (conftest.sft_model), every width dimension at once and the depth alone."""
    common = dict(calib_data=str(chat_data), calib_samples=32, valid_samples=32, seq_length=128, split="90,10,0",
                  chat_template="chatml", cache_dir=str(tmp_path / "cache"))
    for targets in (PruneTargets(hidden=48, ffn=64, heads=2, kv_heads=1), PruneTargets(layers=1)):
        ours = prune_checkpoint(sft_model, tmp_path / "ours", targets, overwrite=True, **common)
        randoms = [prune_checkpoint(sft_model, tmp_path / "random", targets, importance="random", seed=s,
                                    overwrite=True, **common) for s in (1, 2)]
        assert ours["valid_loss_before"] < ours["valid_loss_after"]
        for r in randoms:
            assert r["parameters_after"] == ours["parameters_after"]
            assert ours["valid_loss_after"] < r["valid_loss_after"], (targets, ours, r)


@pytest.fixture(scope="module")
def trained(pretrain_data, tmp_path_factory) -> Path:
    """A small model pretrained on the Shakespeare excerpt (a few steps: its shape and lineage matter here)."""
    prefix, tok = pretrain_data
    run = tmp_path_factory.mktemp("prune") / "run"
    assert main(["pretrain", "--data-path", prefix, "--tokenizer", str(tok), *TINY, "--seq-length", "64",
                 "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-2",
                 "--split", "90,10,0", "--eval-iters", "0", "--save", str(run), "--quiet"]) == 0
    return run / "step_00000005"


def test_the_command_writes_a_checkpoint_every_stage_loads_and_hf_export_matches(trained, pretrain_data, tmp_path,
                                                                               capsys):
    from transformers import AutoModelForCausalLM

    from megapipe.checkpoint import lineage
    from megapipe.checkpoint.load import load_model

    prefix, _ = pretrain_data
    out = tmp_path / "pruned"
    args = ["posttrain", "prune", str(trained), "--output", str(out), "--calib-data", prefix, "--calib-samples", "16",
            "--valid-samples", "16", "--seq-length", "64", "--split", "90,10,0", "--data-cache-path",
            str(tmp_path / "cache")]
    assert main([*args, "--target-params", "0.5", "--layers", "3"]) == 0
    table = capsys.readouterr().out
    for row in ("parameters", "validation loss", "validation ppl", "3 layers, hidden"):
        assert row in table
    m = json.loads((out / "megapipe.json").read_text())
    assert m["stage"] == "prune" and m["parent"] == str(trained)
    assert m["prune"]["parameters_after"] <= 0.5 * m["prune"]["parameters_before"]
    assert [c["stage"] for c in lineage(out)] == ["prune", "pretrain"]

    assert main(["export", "hf", str(out), str(tmp_path / "hf"), "--dtype", "fp32", "--quiet"]) == 0
    model = load_model(out).model
    tokens = batches(1)[0]["tokens"]
    with torch.no_grad():
        ours, theirs = model(tokens), AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5

    assert main([*args, "--heads", "3"]) == MegapipeError.exit_code  # an existing output is not overwritten...
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--heads", "3", "--overwrite"]) == MegapipeError.exit_code  # ...and 3 is no multiple of 2
    assert "--heads 3 is not a multiple of the model's 2 KV groups" in capsys.readouterr().err
    assert json.loads((out / "megapipe.json").read_text()) == m  # nothing half-written


@pytest.mark.parametrize("case", ["moe", "micro-batch 0", "valid 0", "heads 1", "another tokenizer"])
def test_mistakes_are_one_sentence_before_any_work(trained, pretrain_data, chat_tokenizer, tmp_path, capsys,
                                                   monkeypatch, case):
    """Each is refused with exit 2, one line naming the culprit, nothing written; the MoE refusal comes from the
    capability table before any weight is read."""
    from tests.posttrain.conftest import write_model

    prefix, _ = pretrain_data
    ckpt, extra, message = trained, [], None
    if case == "moe":
        ckpt = write_model(tmp_path / "moe", chat_tokenizer, vocab_size=512, num_experts=4, moe_ffn_hidden_size=32)
        import megapipe.posttrain.prune as prune

        monkeypatch.setattr(prune, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
        message = "prune does not support Llama (MoE) models"
    elif case == "another tokenizer":
        ckpt = write_model(tmp_path / "other", chat_tokenizer, vocab_size=512)
        message = f"data {prefix} was tokenized with tokenizer"
    else:
        extra, message = {"micro-batch 0": (["--micro-batch-size", "0"], "--micro-batch-size 0 must be >= 1"),
                          "valid 0": (["--valid-samples", "0"], "--valid-samples 0 must be >= 1"),
                          "heads 1": (["--heads", "1"], "--heads 1 is not a multiple of the model's 2 KV groups")}[case]
    out = tmp_path / "pruned"
    args = ["posttrain", "prune", str(ckpt), "--output", str(out), "--calib-data", prefix, "--calib-samples", "4",
            "--valid-samples", "4", "--seq-length", "64", "--split", "90,10,0", "--data-cache-path",
            str(tmp_path / "cache"), "--layers", "1", *extra]
    assert main(args) == MegapipeError.exit_code
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
