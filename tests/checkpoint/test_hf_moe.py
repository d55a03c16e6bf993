"""HF bridge for MoE models: Mixtral, Qwen2-MoE (shared expert + gate, dense layers in between) and Qwen3-MoE
(sparse step) made here at random -> import -> megapipe logits == transformers logits (fp32, 1e-5) -> export ->
the same per-expert tensors, bit for bit, under the Hub's names; export from an expert-parallel checkpoint gives
the same files; MoE settings HF cannot express are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megapipe.checkpoint import read_manifest  # noqa: E402
from megapipe.checkpoint.load import load_model  # noqa: E402
from tests.checkpoint.test_hf_bridge import (  # noqa: E402
    VOCAB,
    cli,
    hf_config,
    refused,
    tensors_of,
    tokens,
)
from tests.helpers.torchrun import failure  # noqa: E402

BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6)
CASES = {
    "mixtral": ("MixtralConfig", dict(BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(BASE, intermediate_size=48, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                         mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(BASE, intermediate_size=48, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
                                         decoder_sparse_step=2)),
}
MATTERS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
           "tie_word_embeddings", "sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
           "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "qkv_bias",
           "attention_bias", "router_aux_loss_coef"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from megapipe.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"] * 50,
                    vocab_size=300, output=out)
    return out


def make_moe(case: str, directory: Path, tokenizer_dir: Path):
    import shutil

    cls_name, kw = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kw),
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_moe_roundtrip_parity(case, tmp_path, tokenizer_dir):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    hf_model = make_moe(case, hf_dir, tokenizer_dir)
    ids = tokens()
    with torch.no_grad():
        want = hf_model(ids).logits
    assert cli("import", "hf", hf_dir, ckpt) == 0
    model = load_model(ckpt).model
    kinds = [type(b).__name__ for b in model.layers.values()]
    assert kinds == {"mixtral": ["MoEBlock"] * 3, "qwen2_moe": ["MoEBlock", "TransformerBlock", "MoEBlock"],
                     "qwen3_moe": ["TransformerBlock", "MoEBlock", "TransformerBlock"]}[case]
    assert model.cfg.arch == case
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-5

    assert cli("export", "hf", ckpt, out, "--dtype", "fp32") == 0
    source, exported = tensors_of(hf_dir), tensors_of(out)
    assert source.keys() == exported.keys()
    assert any(".experts.3." in name for name in exported)  # per-expert names, as the Hub has them
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    original, again = hf_config(hf_dir), hf_config(out)
    original["head_dim"] = original.get("head_dim") or original["hidden_size"] // original["num_attention_heads"]
    for key in MATTERS & set(original):
        assert again[key] == original[key] or (key == "router_aux_loss_coef"
                                                and abs(again[key] - original[key]) < 1e-12), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, want)


def ep_worker(src: str, dst: str) -> None:
    """torchrun worker (2 processes): load ``src`` into the ep2 layout (experts DTensor-sharded over ep; the
    layout tests cover ep x edp) and save it to ``dst``."""
    from megapipe.checkpoint import load_checkpoint, save_checkpoint
    from megapipe.config import Config, ModelConfig
    from megapipe.models import build_model
    from megapipe.parallel.distributed import destroy_distributed
    from megapipe.parallel.parallelize import parallelize_model, setup_parallel

    manifest = read_manifest(src)
    cfg = Config(model=ModelConfig(**manifest["model"]))
    cfg.parallel.ep, cfg.data.seq_length, cfg.train.micro_batch_size = 2, 16, 2
    _, dims = setup_parallel(cfg, "cpu")
    assert dims.ep == 2 and dims.dp_shard == 2
    model = parallelize_model(build_model(cfg.model, seed=5), dims, cfg)
    assert model.layers["1"].moe.experts.w1.to_local().shape[0] == cfg.model.num_experts // 2  # experts sharded
    load_checkpoint(src, model, load_rng=False)
    save_checkpoint(dst, 3, model, manifest={**manifest, "stage": "test-ep", "parent": src},
                    tokenizer=Path(src) / "tokenizer")
    destroy_distributed()


@pytest.mark.dist
def test_export_from_an_expert_parallel_checkpoint_is_identical(tmp_path, tokenizer_dir):
    hf_dir, ckpt, sharded = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "ep"
    make_moe("qwen3_moe", hf_dir, tokenizer_dir)
    assert cli("import", "hf", hf_dir, ckpt) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, str(ckpt), str(sharded)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)
    assert len(list((sharded / "step_00000003" / "model").glob("*.distcp"))) == 2
    assert cli("export", "hf", ckpt, tmp_path / "a") == 0
    assert cli("export", "hf", sharded, tmp_path / "b") == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def edit_manifest_model(ckpt: Path, **changes) -> None:
    path = ckpt / "megapipe.json"
    manifest = json.loads(path.read_text())
    manifest["model"].update(changes)
    path.write_text(json.dumps(manifest))


def test_refuses_what_the_hf_architecture_cannot_express(tmp_path, tokenizer_dir, capsys):
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    make_moe("mixtral", hf_dir, tokenizer_dir)
    assert cli("import", "hf", hf_dir, ckpt) == 0
    edit_manifest_model(ckpt, moe_router_score_function="sigmoid")
    err = refused(capsys, "export", "hf", ckpt, tmp_path / "o1")
    assert "model.moe_router_score_function = 'sigmoid' cannot be expressed in a Hugging Face MixtralForCausalLM" in err
    edit_manifest_model(ckpt, moe_router_score_function="softmax", arch="llama")
    err = refused(capsys, "export", "hf", ckpt, tmp_path / "o2")
    assert "model.num_experts = 4" in err and "LlamaForCausalLM" in err
    # training-only settings export: they do not change what the model computes
    edit_manifest_model(ckpt, arch="mixtral", moe_expert_capacity_factor=1.5, moe_z_loss_coeff=0.01)
    assert cli("export", "hf", ckpt, tmp_path / "o3") == 0
    config = json.loads((hf_dir / "config.json").read_text())
    config["router_jitter_noise"] = 0.1
    (hf_dir / "config.json").write_text(json.dumps(config))
    err = refused(capsys, "import", "hf", hf_dir, tmp_path / "ckpt2")
    assert "router_jitter_noise = 0.1 cannot be represented by megapipe" in err


@pytest.mark.parametrize("preset", ["tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_presets_read_back_through_transformers(preset):
    import dataclasses

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.checkpoint.hf.base import UNMAPPED_FIELDS, canonical
    from megapipe.checkpoint.hf.bridge import normalise_hf_config
    from megapipe.config import ModelConfig, from_dict

    cfg = from_dict(ModelConfig, {"preset": preset, "vocab_size": 50304})
    adapter = adapter_for_arch(cfg.arch)
    normalised = normalise_hf_config(adapter.hf_config(cfg), adapter, preset)
    back = ModelConfig(**adapter.config_from_hf(normalised, preset))
    for f in dataclasses.fields(ModelConfig):
        if f.name not in UNMAPPED_FIELDS:
            assert canonical(f.name, getattr(back, f.name), back) == canonical(f.name, getattr(cfg, f.name), cfg), f.name


if __name__ == "__main__":
    ep_worker(sys.argv[1], sys.argv[2])
