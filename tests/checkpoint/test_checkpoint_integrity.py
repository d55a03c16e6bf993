"""Checksums: recorded per file while saving, verified before anything is loaded, `megapipe checkpoint verify`.

Damage is a flipped block inside a file of unchanged size (what a bad disk or a broken copy does): the sizes still
match, so only the checksums can tell.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint_dcp import Tiny, assert_same, trained

from megapipe.checkpoint import load_checkpoint, save_checkpoint
from megapipe.checkpoint.integrity import ALGORITHM, hash_file
from megapipe.checkpoint.load import load_model
from megapipe.cli import main
from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError
from megapipe.models import build_model

CFG = ModelConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)


def flip_block(path: Path, at: float = 0.5, length: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = min(int(len(data) * at), max(0, len(data) - length))
    for i in range(start, min(start + length, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path, tiny_tokenizer_dir):
    """A run with two checkpoints of a real transformer (model + AdamW + RNG + tokenizer)."""
    model = build_model(CFG, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 512, (2, 5))).sum().backward()
    opt.step()
    run = tmp_path / "run"
    first = save_checkpoint(run, 1, model, opt, manifest={"model": CFG}, tokenizer=tiny_tokenizer_dir)
    second = save_checkpoint(run, 2, model, opt, manifest={"model": CFG}, tokenizer=tiny_tokenizer_dir)
    return model, run, first, second


def test_every_file_has_the_checksum_of_its_bytes(saved):
    _, _, _, ckpt = saved
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    assert manifest["checksum_algorithm"] == ALGORITHM == "xxh3_128"
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "megapipe.json")
    assert sorted(manifest["checksums"]) == sorted(manifest["files"]) == on_disk
    assert {"model/.metadata", "model/__0_0.distcp", "optim/__0_0.distcp", "extra/rng_rank00000.safetensors",
            "tokenizer/tokenizer.json"} <= set(on_disk)
    for rel, digest in manifest["checksums"].items():  # the shards' digests were computed while writing
        assert hash_file(ckpt / rel) == digest, rel


@pytest.mark.parametrize("rel", ["model/__0_0.distcp", "model/.metadata", "optim/__0_0.distcp",
                                 "extra/rng_rank00000.safetensors"])
def test_a_flipped_block_is_refused_naming_the_file(saved, rel):
    model, _, _, ckpt = saved
    flip_block(ckpt / rel)
    fresh = build_model(CFG, seed=2)
    with pytest.raises(CheckpointError, match=rf"{ckpt / rel} is damaged \(its xxh3_128 checksum differs") as e:
        load_checkpoint(ckpt, fresh, torch.optim.AdamW(fresh.parameters()))
    assert "weights_only" not in str(e.value)
    assert any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(),
                                                     strict=True))  # nothing was loaded
    if rel.startswith("model/"):
        with pytest.raises(CheckpointError, match=rf"{ckpt / rel} is damaged"):
            load_model(ckpt)
    else:  # weights-only loads (--finetune, inference) do not read the damaged file, and work
        loaded = load_model(ckpt).model
        assert_same(model, loaded)


def test_a_lora_run_verifies_the_base_weights_it_starts_from(saved):
    """A LoRA run loads its base checkpoint without the new adapters, through the same checks as every load."""
    from megapipe.models.lora import LoRASpec, apply_lora, lora_layers
    from megapipe.posttrain.lora import load_base_weights

    model, _, first, second = saved
    spec = LoRASpec(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v"))
    fresh = apply_lora(build_model(CFG, seed=2), spec, seed=0)
    adapters = {n: m.lora_A.weight.clone() for n, m in lora_layers(fresh)}
    load_base_weights(first, fresh)
    state = fresh.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name
    assert all(torch.equal(m.lora_A.weight, adapters[n]) for n, m in lora_layers(fresh))  # new adapters kept

    rel = "model/__0_0.distcp"
    flip_block(second / rel)
    with pytest.raises(CheckpointError, match=rf"{second / rel} is damaged \(its xxh3_128 checksum differs"):
        load_base_weights(second, apply_lora(build_model(CFG, seed=2), spec))


def test_a_damaged_tokenizer_is_named_and_a_removed_one_is_replaced_by_tokenizer(saved, tiny_tokenizer_dir, tmp_path):
    _, _, _, ckpt = saved
    flip_block(ckpt / "tokenizer" / "tokenizer.json", length=8)
    with pytest.raises(CheckpointError, match=r"tokenizer of checkpoint .* is damaged: .*tokenizer\.json is damaged"):
        load_model(ckpt)
    shutil.rmtree(ckpt / "tokenizer")  # a checkpoint without its tokenizer is still this checkpoint, not step 1
    ready = load_model(ckpt.parent)
    manifest, tok = ready.manifest, ready.tokenizer_dir
    assert manifest["step"] == 2 and tok is None
    assert main(["export", "hf", str(ckpt.parent), str(tmp_path / "hf"), "--tokenizer", str(tiny_tokenizer_dir),
                 "-q"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2


def test_verify_command_reports_every_checkpoint_and_inspect_refuses_damage(saved, capsys):
    _, run, first, second = saved
    assert main(["checkpoint", "verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count("ok: 8 of 8 files by xxh3_128 checksum") == 2, out
    flip_block(second / "model" / "__0_0.distcp")
    flip_block(second / "optim" / "__0_0.distcp")
    assert main(["checkpoint", "verify", "--json", str(second)]) == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["checked"] == report["files"] == 8
    assert [p.split(" is ")[0] for p in report["problems"]] == [str(second / "model" / "__0_0.distcp"),
                                                                str(second / "optim" / "__0_0.distcp")]
    assert "optim/__0_0.distcp" in captured.err
    assert main(["checkpoint", "verify", str(run)]) == 2
    err = capsys.readouterr().err
    assert "1 of 2 checkpoint(s)" in err and "step_00000002/model/__0_0.distcp is damaged" in err
    assert main(["checkpoint", "inspect", str(second)]) == 2
    assert "model/__0_0.distcp is damaged" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", "--no-verify", "--json", str(second)]) == 0
    assert json.loads(capsys.readouterr().out)["integrity"] == "not checked (--no-verify)"
    assert main(["checkpoint", "inspect", "--json", str(first)]) == 0
    assert json.loads(capsys.readouterr().out)["integrity"] == "ok: 8 files match their xxh3_128 checksums"


def test_checkpoints_without_checksums_still_load_and_damage_never_suggests_weights_only(tmp_path, capsys):
    model, opt = trained()
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    del manifest["checksums"], manifest["checksum_algorithm"]  # as saved by an older megapipe
    manifest["format_version"] = 1
    (ckpt / "megapipe.json").write_text(json.dumps(manifest))
    fresh = Tiny()
    load_checkpoint(ckpt, fresh)
    assert_same(model, fresh)
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "by size only (no checksums recorded)" in capsys.readouterr().out
    flip_block(ckpt / "model" / "__0_0.distcp", at=0.0, length=256)  # the zip header of the first tensor
    with pytest.raises(CheckpointError, match=r"shards in .*model are damaged and cannot be read") as e:
        load_checkpoint(ckpt, Tiny())
    assert "weights_only" not in str(e.value) and "checkpoint verify" in str(e.value)


def test_verify_false_skips_the_checksums(saved):
    model, _, _, ckpt = saved
    flip_block(ckpt / "extra" / "rng_rank00000.safetensors", at=0.9, length=4)  # the tail: stays readable
    fresh = build_model(CFG, seed=3)
    load_checkpoint(ckpt, fresh, load_rng=False, verify=False)
    assert_same(model, fresh)


def edit_manifest(ckpt: Path, change) -> Path:
    path = ckpt / "megapipe.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return path


def test_a_checksummed_manifest_stripped_of_its_checksums_is_damaged(saved, capsys):
    """The size-only fallback is for format_version 1 (written before checksums existed); a format_version 2
    manifest without them has lost them, and a byte flipped after that must not pass."""
    _, run, _, ckpt = saved
    assert json.loads((ckpt / "megapipe.json").read_text())["format_version"] == 2
    path = edit_manifest(ckpt, lambda m: (m.pop("checksums"), m.pop("checksum_algorithm")))
    flip_block(ckpt / "model" / "__0_0.distcp", length=1)
    assert main(["checkpoint", "verify", str(ckpt)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{path}: corrupted manifest: its checksums are missing" in err, err
    with pytest.raises(CheckpointError, match="its checksums are missing"):
        load_model(ckpt)

    edit_manifest(ckpt, lambda m: m.update(format_version=1))  # as an older megapipe wrote it: sizes only
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "by size only (no checksums recorded)" in capsys.readouterr().out


def test_one_checksum_removed_is_damage(saved, capsys):
    _, _, _, ckpt = saved
    path = edit_manifest(ckpt, lambda m: m["checksums"].pop("model/__0_0.distcp"))
    assert main(["checkpoint", "verify", str(ckpt)]) == 2
    assert f"{path}: corrupted manifest: model/__0_0.distcp has no checksum" in capsys.readouterr().err


def test_a_save_without_checksums_says_sizes_only(tmp_path, capsys):
    model, opt = trained()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, checksums=False)
    assert json.loads((ckpt / "megapipe.json").read_text())["format_version"] == 1
    assert main(["checkpoint", "verify", str(ckpt)]) == 0
    assert "by size only" in capsys.readouterr().out


def test_a_run_whose_latest_names_a_missing_step_fails_verify(saved, capsys):
    _, run, _, _ = saved
    (run / "latest").write_text("step_00000009\n")
    assert main(["checkpoint", "verify", str(run)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{run / 'latest'} names 'step_00000009', which is not a checkpoint in {run}" in err, err
    (run / "latest").write_text("step_00000002\n")
    assert main(["checkpoint", "verify", str(run)]) == 0


@pytest.mark.parametrize("change, culprit", [
    (lambda m: m.update(files="model/__0_0.distcp"), "'files' is a str, not an object mapping each file to its size"),
    (lambda m: m["files"].update({"model/__0_0.distcp": "1234"}), "'files' gives 'model/__0_0.distcp' the size in "
                                                                   "bytes '1234'"),
    (lambda m: m["files"].update({"../../outside.bin": 3}), "'files' names '../../outside.bin', a path outside"),
    (lambda m: m["checksums"].update({"/etc/hostname": "00"}), "'checksums' names '/etc/hostname', a path outside"),
    (lambda m: m.update(checksums=["x"]), "'checksums' is a list, not an object"),
])
def test_a_malformed_file_list_is_one_sentence_naming_the_manifest(saved, tmp_path, capsys, change, culprit):
    _, run, _, ckpt = saved
    (tmp_path / "outside.bin").write_bytes(b"abc")  # what a ../ path would reach
    path = edit_manifest(ckpt, change)
    for argv in (["checkpoint", "verify", str(ckpt)], ["checkpoint", "inspect", str(ckpt)],
                 ["export", "hf", str(ckpt), str(tmp_path / "hf")]):
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert f"{path}: corrupted manifest: {culprit}" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()
