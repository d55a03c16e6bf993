"""The shared checkpoint format, single process: exact round trips, atomicity, pruning and clear errors."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megapipe.checkpoint import (
    find_latest,
    is_complete,
    lineage,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from megapipe.checkpoint.load import load_model
from megapipe.errors import CheckpointError


class Tiny(nn.Module):
    def __init__(self, vocab: int = 11, hidden: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(self.proj(self.emb(x))))


def trained(seed: int = 0, hidden: int = 6, steps: int = 2):
    torch.manual_seed(seed)
    model = Tiny(hidden=hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randint(0, 11, (2, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def assert_same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_round_trip_is_exact_model_optimizer_rng_and_resume(tmp_path):
    model, opt = trained()
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": {}}')
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    ckpt = save_checkpoint(
        tmp_path / "run",
        12,
        model,
        opt,
        extra_state={"scheduler": {"last_epoch": 12}},
        manifest={"stage": "pretrain", "tokens_seen": 1234, "data_state": {"consumed_samples": 48}},
        tokenizer=tok,
    )
    after_save = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    # the run continues one more step from here; a resumed run must do exactly the same
    x = torch.randint(0, 11, (2, 5))
    model(x).sum().backward()
    opt.step()

    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5e-1)  # a different lr: the checkpoint's must win
    manifest = load_checkpoint(tmp_path / "run", fresh, fresh_opt)
    assert (random.random(), np.random.rand(3).tolist()) == after_save[:2]
    assert torch.equal(torch.rand(3), after_save[2])
    fresh(x).sum().backward()
    fresh_opt.step()
    assert_same(model, fresh)
    assert_same_optim(opt, fresh_opt)

    assert ckpt == (tmp_path / "run" / "step_00000012").absolute()
    assert manifest["step"] == 12 and manifest["tokens_seen"] == 1234 and manifest["stage"] == "pretrain"
    assert manifest["data_state"] == {"consumed_samples": 48}
    assert manifest["trainer_state"] == {"scheduler": {"last_epoch": 12}}
    assert manifest["layout"] == {"world_size": 1}
    assert (ckpt / "tokenizer" / "tokenizer.json").read_text() == '{"model": {}}'
    assert manifest["tokenizer"]["path"] == "tokenizer"
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000012"
    assert not list((tmp_path / "run").glob("*.tmp-*"))


def test_finetune_loads_weights_only_and_inference_checkpoint_has_no_optim(tmp_path):
    model, opt = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)  # no optimizer: an inference-only checkpoint
    assert not (ckpt / "optim").exists()
    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match="no optimizer state.*--finetune"):
        load_checkpoint(ckpt, fresh, fresh_opt)
    load_checkpoint(ckpt, fresh, fresh_opt, load_optim=False)
    assert_same(model, fresh)
    assert fresh_opt.state_dict()["state"] == {}


def test_cut_off_checkpoints_are_skipped_for_the_previous_complete_one(tmp_path, caplog):
    model, opt = trained()
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, opt)
    good = save_checkpoint(run, 2, model, opt)
    # a save killed before its rename
    shutil.copytree(good, run / "step_00000003.tmp-deadbeef0000")
    # a renamed dir missing a shard, one with no manifest, one whose manifest says incomplete
    broken = shutil.copytree(good, run / "step_00000004")
    (broken / "optim" / "__0_0.distcp").unlink()
    nomani = shutil.copytree(good, run / "step_00000005")
    (nomani / "megapipe.json").unlink()
    marked = shutil.copytree(good, run / "step_00000006")
    m = json.loads((marked / "megapipe.json").read_text())
    m["complete"] = False
    (marked / "megapipe.json").write_text(json.dumps(m))
    nodcp = shutil.copytree(good, run / "step_00000007")
    (nodcp / "model" / ".metadata").unlink()
    (run / "latest").write_text("step_00000007\n")

    assert [is_complete(p) for p in (broken, nomani, marked, nodcp)] == [False] * 4
    assert find_latest(run) == good
    assert find_latest(broken) is None
    fresh = Tiny()
    with caplog.at_level("WARNING", logger="megapipe.checkpoint.manifest"):
        assert load_checkpoint(run, fresh)["step"] == 2
    # the fallback is said, naming the skipped checkpoint and why
    assert f"skipping {nodcp} ({nodcp}/model/.metadata is missing); using {good}" in caplog.text
    with pytest.raises(CheckpointError, match=r"step_00000004.*optim/__0_0\.distcp is missing"):
        load_checkpoint(broken, fresh)


def test_latest_pointer_and_keep_last_pruning(tmp_path):
    model, opt = trained()
    run = tmp_path / "run"
    stale = run / "step_00000000.tmp-0123456789ab"
    stale.mkdir(parents=True)
    for step in (10, 20, 30, 40):
        save_checkpoint(run, step, model, opt, keep_last=2)
        assert (run / "latest").read_text().strip() == f"step_{step:08d}"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    # saving the same step again replaces it atomically
    again = save_checkpoint(run, 40, model, opt, manifest={"stage": "again"}, keep_last=2)
    assert read_manifest(again)["stage"] == "again"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_00000030", "step_00000040"]
    assert find_latest(run) == again


def test_lineage_follows_parents(tmp_path):
    model, _ = trained()
    a = save_checkpoint(tmp_path / "pre", 5, model, manifest={"stage": "pretrain"})
    b = save_checkpoint(tmp_path / "sft", 2, model, manifest={"stage": "sft", "parent": str(a)})
    chain = lineage(b)
    assert [(c["stage"], c["step"]) for c in chain] == [("sft", 2), ("pretrain", 5)]


def test_corrupted_manifest_names_file_and_line(tmp_path):
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)
    text = (ckpt / "megapipe.json").read_text().splitlines()
    text[3] = text[3] + " oops"
    (ckpt / "megapipe.json").write_text("\n".join(text))
    with pytest.raises(CheckpointError, match=r"megapipe\.json:4: corrupted manifest, invalid JSON"):
        load_checkpoint(ckpt, Tiny())


def test_unsupported_format_version(tmp_path):
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)
    m = json.loads((ckpt / "megapipe.json").read_text())
    m["format_version"] = 99
    (ckpt / "megapipe.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="format_version = 99 is not supported"):
        read_manifest(ckpt)


def test_missing_path_and_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", Tiny())
    with pytest.raises(CheckpointError, match="not a megapipe checkpoint"):
        load_checkpoint(tmp_path, Tiny())


def test_missing_shard_file_is_named_even_without_the_manifest_list(tmp_path):
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)
    m = json.loads((ckpt / "megapipe.json").read_text())
    del m["files"], m["checksums"]  # so only DCP's own metadata can tell that a shard is gone
    (ckpt / "megapipe.json").write_text(json.dumps(m))
    (ckpt / "model" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"shard file .*model/__0_0\.distcp is missing"):
        load_checkpoint(ckpt, Tiny())


def test_shape_mismatch_names_parameter_and_both_shapes(tmp_path):
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)
    with pytest.raises(CheckpointError, match=r"'emb\.weight' has shape \[11, 6\] in the checkpoint but \[11, 8\]"):
        load_checkpoint(ckpt, Tiny(hidden=8))


def test_missing_and_unexpected_keys_are_named(tmp_path):
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)

    class Bigger(Tiny):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: extra\.bias, extra\.weight"):
        load_checkpoint(ckpt, Bigger())
    smaller = Tiny()
    smaller.out = None
    with pytest.raises(CheckpointError, match=r"in the checkpoint that the model lacks: out\.weight"):
        load_checkpoint(ckpt, smaller)


def test_wrong_optimizer_type_is_a_clear_error(tmp_path):
    model, opt = trained()
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    fresh = Tiny()
    with pytest.raises(CheckpointError, match=r"does not match the optimizer"):
        load_checkpoint(ckpt, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))


def test_metadata_with_code_is_refused(tmp_path):
    import os
    import pickle

    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 1, model)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(Evil()))
    m = json.loads((ckpt / "megapipe.json").read_text())
    del m["files"], m["checksums"]  # a crafted checkpoint comes with a manifest that matches it
    (ckpt / "megapipe.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"untrusted DCP metadata .*system is not allowed"):
        load_checkpoint(ckpt, Tiny())
    assert not (tmp_path / "pwned").exists()


def test_load_model_builds_from_manifest(tmp_path):
    from megapipe.config import ModelConfig

    cfg = ModelConfig(vocab_size=11, hidden_size=6)
    model, _ = trained()
    ckpt = save_checkpoint(tmp_path, 3, model, manifest={"model": cfg}, tokenizer=_tokenizer_dir(tmp_path))
    seen = {}

    def builder(c, device="cpu"):
        seen["cfg"] = c
        return Tiny(vocab=c.vocab_size, hidden=c.hidden_size).to(device)

    ready = load_model(ckpt, dtype=torch.bfloat16, builder=builder)
    loaded, manifest, tok = ready.model, ready.manifest, ready.tokenizer_dir
    assert seen["cfg"] == cfg
    assert manifest["model"]["hidden_size"] == 6
    assert tok == ckpt / "tokenizer" and (tok / "tokenizer.json").is_file()
    assert not loaded.training
    for k, v in model.state_dict().items():
        assert loaded.state_dict()[k].dtype == torch.bfloat16
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k


def _tokenizer_dir(root: Path) -> Path:
    tok = root / "tokenizer_src"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text("{}")
    return tok


def test_load_model_with_the_real_transformer(tmp_path):
    from megapipe.config import ModelConfig
    from megapipe.models import build_model

    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    model = build_model(cfg, seed=3)
    ckpt = save_checkpoint(tmp_path, 1, model, manifest={"model": cfg})
    ready = load_model(tmp_path)
    loaded, manifest, tok = ready.model, ready.manifest, ready.tokenizer_dir
    assert tok is None and manifest["model"]["num_kv_heads"] == 1
    tokens = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model.eval()(tokens))
    assert_same(model, loaded)
    assert ckpt == find_latest(tmp_path)


def test_failed_save_leaves_nothing_behind(tmp_path):
    model, opt = trained()
    run = tmp_path / "run"
    good = save_checkpoint(run, 1, model, opt)
    with pytest.raises(CheckpointError, match="tokenizer .*missing_tok does not exist"):
        save_checkpoint(run, 2, model, opt, tokenizer=tmp_path / "missing_tok")
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_00000001"]
    assert find_latest(run) == good


def test_pipeline_parts_save_and_load_across_splits(tmp_path):
    """Model parts (as pipeline stages hold them: same names as the full model) with one optimizer each. The parts
    start from other weights and empty optimizers, so only the load can make them equal to the saved model."""
    model, opt = trained()

    def split(seed: int):
        torch.manual_seed(seed)
        first, second = Tiny(), Tiny()
        first.out = None
        second.emb = second.proj = second.norm = None
        return [first, second]

    parts = split(seed=5)
    part_opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    names = [[n for n, _ in p.named_parameters()] for p in parts]
    assert names == [["emb.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias"], ["out.weight"]]
    assert not any(torch.equal(p.get_parameter(n), model.get_parameter(n)) for p, ns in zip(parts, names, strict=True)
                   for n in ns if "norm" not in n)  # (LayerNorm starts at ones/zeros in both)
    load_checkpoint(save_checkpoint(tmp_path / "full", 1, model, opt), parts, part_opts)  # 1 stage -> 2 stages
    for p, o, ns in zip(parts, part_opts, names, strict=True):
        assert len(o.state) == len(ns)  # every parameter got its AdamW state
        for name in ns:
            param = p.get_parameter(name)
            assert torch.equal(param, model.get_parameter(name)), name
            full_state = opt.state[model.get_parameter(name)]
            assert sorted(o.state[param]) == sorted(full_state) == ["exp_avg", "exp_avg_sq", "step"], name
            for k, v in full_state.items():
                assert torch.equal(o.state[param][k], v), (name, k)
        assert o.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

    ckpt = save_checkpoint(tmp_path / "parts", 2, parts, part_opts)  # 2 stages -> 1
    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-1)
    load_checkpoint(ckpt, fresh, fresh_opt)
    assert_same(model, fresh)
    assert_same_optim(opt, fresh_opt)


def test_non_tensor_values_are_read_with_weights_only(tmp_path):
    import io
    import os
    import pickle

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from megapipe.checkpoint.safe_dcp import StrictLoadPlanner

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    buf = io.BytesIO()
    torch.save(Evil(), buf)
    buf.seek(0)
    planner = StrictLoadPlanner("x", allow_unexpected=True)
    planner.flatten_state_dict = False
    planner.state_dict = {}
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("lr"),
        dest_offsets=torch.Size(),
        storage_index=MetadataIndex("lr"),
        storage_offsets=torch.Size(),
        lengths=torch.Size(),
    )
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)
    assert not (tmp_path / "pwned").exists()
    buf = io.BytesIO()
    torch.save((0.9, 0.95), buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
    assert planner.state_dict == {"lr": (0.9, 0.95)}


def test_compiled_and_recompute_wrapped_modules_keep_plain_names(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, opt = trained()
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    wrapped = Tiny()
    wrapped.proj = torch.compile(wrapped.proj)  # adds "_orig_mod." to state_dict keys; nothing is compiled here
    wrapped.norm = checkpoint_wrapper(wrapped.norm)
    wrapped_opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    load_checkpoint(ckpt, wrapped, wrapped_opt)
    again = save_checkpoint(tmp_path, 2, wrapped, wrapped_opt)
    fresh = Tiny()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(again, fresh, fresh_opt)
    assert_same(model, fresh)
    assert_same_optim(opt, fresh_opt)
