"""``megapipe checkpoint inspect`` and ``megapipe checkpoint convert --to safetensors``."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_checkpoint_dcp import Tiny, trained

from megapipe.checkpoint import save_checkpoint
from megapipe.cli import main
from megapipe.config import ModelConfig


def _saved(tmp_path):
    model, opt = trained()
    parent = save_checkpoint(tmp_path / "pre", 4, model, manifest={"stage": "pretrain"})
    ckpt = save_checkpoint(
        tmp_path / "run",
        7,
        model,
        opt,
        manifest={
            "model": ModelConfig(vocab_size=11, hidden_size=6),
            "stage": "sft",
            "parent": str(parent),
            "tokens_seen": 4096,
        },
    )
    return model, ckpt, parent


def test_inspect_json_and_table(tmp_path, capsys):
    model, ckpt, parent = _saved(tmp_path)
    assert main(["checkpoint", "inspect", "--json", str(tmp_path / "run")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == str(ckpt)
    assert info["step"] == 7 and info["stage"] == "sft" and info["tokens_seen"] == 4096
    assert info["parameters"] == sum(p.numel() for p in model.parameters()) == 11 * 6 + 6 * 6 + 6 + 6 + 6 + 6 * 11
    assert info["tensors"] == len(model.state_dict())
    assert info["optimizer_state"] is True and info["rng_ranks"] == 1
    assert info["layout"] == {"world_size": 1}
    assert info["size_bytes"] == sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    assert [(c["stage"], c["step"], c["path"]) for c in info["lineage"]] == [
        ("sft", 7, str(ckpt)),
        ("pretrain", 4, str(parent)),
    ]
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0
    table = capsys.readouterr().out
    assert "sft@7" in table and "pretrain@4" in table and "186" in table


def test_convert_to_safetensors_equals_state_dict(tmp_path, capsys):
    model, ckpt, _ = _saved(tmp_path)
    out = tmp_path / "st"
    assert main(["checkpoint", "convert", str(ckpt), "--to", "safetensors", str(out)]) == 0
    loaded = load_file(out / "model.safetensors")
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata()["step"] == "7"
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 6
    fresh = Tiny()
    fresh.load_state_dict(loaded)  # strict: the file is a complete state dict

    bf16 = tmp_path / "bf16"
    assert main(["checkpoint", "convert", str(ckpt), "--to", "safetensors", str(bf16), "--dtype", "bf16"]) == 0
    for k, v in load_file(bf16 / "model.safetensors").items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, expected[k].to(torch.bfloat16)), k


def test_convert_refuses_bad_format_and_existing_output(tmp_path, capsys):
    _, ckpt, _ = _saved(tmp_path)
    assert main(["checkpoint", "convert", str(ckpt), "--to", "gguf", str(tmp_path / "x")]) == 2
    assert "--to 'gguf' is not a supported format" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    assert main(["checkpoint", "convert", str(ckpt), "--to", "safetensors", str(tmp_path / "busy")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "busy" / "f").read_text() == "x"
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # an output whose parent is a file: one sentence naming the output, nothing left behind
    blocked = tmp_path / "busy" / "f" / "out"
    assert main(["checkpoint", "convert", str(ckpt), "--to", "safetensors", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert f"cannot create output {blocked}: Not a directory" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["f"]
