"""HF bridge parity: tiny random HF models (made here) -> import -> megapipe logits == transformers logits ->
export -> transformers reloads identical tensors and logits; plus sharding and every refused input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from megapipe.checkpoint import read_manifest  # noqa: E402
from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.cli import main  # noqa: E402
from megapipe.data.tokenizer import train_tokenizer  # noqa: E402
from tests.helpers.torchrun import failure  # noqa: E402

VOCAB = 320
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|endoftext|>{% endfor %}"
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
CASES = {
    "llama3": ("LlamaConfig", dict(
        LLAMA, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    "llama-tied-bias": ("LlamaConfig", dict(LLAMA, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                            head_dim=24)),
    "qwen2": ("Qwen2Config", dict(LLAMA, tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(LLAMA, head_dim=32, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(LLAMA, sliding_window=8, head_dim=16)),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                layer_norm_epsilon=1e-5)),
}


# config.json fields that change the weights' shapes or the maths
MATTERS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
           "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
           "use_sliding_window", "layer_types", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
           "layer_norm_epsilon", "activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx"}


def hf_config(directory: Path) -> dict:
    config = transformers.AutoConfig.from_pretrained(directory).to_dict()
    if config.get("model_type") == "gpt2" and config["n_inner"] is None:
        config["n_inner"] = 4 * config["n_embd"]
    return config


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    texts = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 50
    train_tokenizer(texts, vocab_size=300, output=out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def make_hf_model(case: str, directory: Path, tokenizer_dir: Path, **save_kw):
    """A random HF model of the case's architecture (norms and biases random too), saved with save_pretrained."""
    cls_name, kw = CASES[case]
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory, **save_kw)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return model


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def cli(*args) -> int:
    return main([str(a) for a in args])


def tokens(seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_parity(case, tmp_path, tokenizer_dir):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    hf_model = make_hf_model(case, hf_dir, tokenizer_dir)
    ids = tokens()
    with torch.no_grad():
        want = hf_model(ids).logits

    assert cli("import", "hf", hf_dir, ckpt) == 0
    manifest = read_manifest(ckpt)
    assert manifest["stage"] == "import-hf" and manifest["parent"] == str(hf_dir.absolute())
    model = load_model(ckpt).model
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-5

    assert cli("export", "hf", ckpt, out, "--dtype", "fp32") == 0
    source, exported = tensors_of(hf_dir), tensors_of(out)
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    original, again = hf_config(hf_dir), hf_config(out)
    for key in MATTERS & set(original):
        assert again[key] == original[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, want)


def test_tokenizer_and_generation_config(tmp_path, tokenizer_dir):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    make_hf_model("qwen2", hf_dir, tokenizer_dir)
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    config_file = hf_dir / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **sampling}))
    assert cli("import", "hf", hf_dir, ckpt) == 0
    assert cli("export", "hf", ckpt, out) == 0  # default dtype: the source's (fp32 here)
    source = transformers.AutoTokenizer.from_pretrained(hf_dir)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy dog packs five jugs"
    assert exported(text)["input_ids"] == source(text)["input_ids"]
    assert exported.eos_token == source.eos_token == "<|endoftext|>" and exported.pad_token == "<|pad|>"
    messages = [{"role": "user", "content": "the fox"}]
    assert exported.apply_chat_template(messages, tokenize=False) == source.apply_chat_template(messages, tokenize=False)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0 and generation["pad_token_id"] == 1
    assert {k: generation[k] for k in sampling} == sampling  # the sampling defaults come through too
    assert tensors_of(out)["model.embed_tokens.weight"].dtype == torch.float32


def test_bf16_source_roundtrips_bit_identically(tmp_path, tokenizer_dir):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    make_hf_model("mistral", tmp_path / "fp32", tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    model.save_pretrained(hf_dir)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, hf_dir / f.name)
    assert cli("import", "hf", hf_dir, ckpt) == 0
    assert cli("export", "hf", ckpt, out) == 0  # no --dtype: the source's
    source, exported = tensors_of(hf_dir), tensors_of(out)
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype == torch.bfloat16 and torch.equal(tensor, exported[name]), name
    assert hf_config(out)["dtype"] == "bfloat16"


def test_sharded_import_and_export(tmp_path, tokenizer_dir):
    hf_dir, ckpt, out, ckpt2 = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export", tmp_path / "ckpt2"
    make_hf_model("llama3", hf_dir, tokenizer_dir, max_shard_size="40KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    assert cli("import", "hf", hf_dir, ckpt) == 0
    assert cli("export", "hf", ckpt, out, "--dtype", "bf16", "--max-shard-size", "30KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(s.stat().st_size < 30_000 + 2 * 96 * 64 * 2 for s in shards)  # one tensor may overflow a shard
    exported = tensors_of(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in exported.values())
    for name, tensor in tensors_of(hf_dir).items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # the sharded bf16 export imports again, to the same (bf16-rounded) weights
    assert cli("import", "hf", out, ckpt2) == 0
    a = load_model(ckpt).model
    b = load_model(ckpt2).model
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x.to(torch.bfloat16).float(), y), name


def test_original_gpt2_naming_imports(tmp_path, tokenizer_dir):
    """The first GPT-2 checkpoints name tensors without ``transformer.`` and carry attn.bias mask buffers."""
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    hf_model = make_hf_model("gpt2", hf_dir, tokenizer_dir)
    tensors = tensors_of(hf_dir)
    old = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    old["lm_head.weight"] = tensors["transformer.wte.weight"].clone()  # a tied head saved anyway
    save_file(old, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    assert cli("import", "hf", hf_dir, ckpt) == 0
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32") == 0
    exported = tensors_of(out)
    assert exported.keys() == tensors.keys() and all(torch.equal(exported[k], v) for k, v in tensors.items())
    model = load_model(ckpt).model
    with torch.no_grad():
        assert (model(tokens()) - hf_model(tokens()).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b", "qwen2.5-0.5b", "gpt2-124m", "nemotron-h-tiny", "nemotron-h-8b"])
def test_presets_read_back_through_transformers(preset):
    """Each preset's config.json, as transformers reads it, maps back to the same ModelConfig."""
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


# --------------------------------------------------------------------------------------------------- finetune

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_pretrain_finetune_from_an_import(tmp_path, tokenizer_dir):
    """`pretrain --finetune` starts from the imported weights (its first loss is transformers' loss on the same
    batch) and trains on the real corpus; the result exports back to transformers."""
    import torch.nn.functional as F

    from megapipe.data.gpt_dataset import build_gpt_datasets
    from megapipe.data.loader import PretrainingLoader

    hf_dir, ckpt, run = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "run"
    hf_model = make_hf_model("qwen2", hf_dir, tokenizer_dir)
    assert cli("import", "hf", hf_dir, ckpt) == 0
    prefix = tmp_path / "shk"
    assert cli("preprocess", "--input", FIXTURES / "shakespeare_excerpt.jsonl", "--output-prefix", prefix,
               "--tokenizer", ckpt / "tokenizer", "--append-eod", "-q") == 0
    data, iters, batch = f"{prefix}_text_document", 12, 4
    assert cli("pretrain", "--load", ckpt, "--finetune", "--data-path", data, "--tokenizer", ckpt / "tokenizer",
               "--split", "100,0,0", "--seq-length", 32, "--micro-batch-size", batch, "--global-batch-size", batch,
               "--train-iters", iters, "--lr", 3e-3, "--lr-warmup-iters", 0, "--seed", 7, "--log-interval", 1,
               "--save", run, "-q") == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "train"]
    assert len(losses) == iters and sum(losses[-3:]) / 3 < losses[0] * 0.95

    datasets = build_gpt_datasets([data], "100,0,0", 32, {"train": iters * batch, "valid": 0}, 7, None)
    first = next(iter(PretrainingLoader(datasets["train"], batch, batch, 0, 1)))
    with torch.no_grad():
        logits = hf_model(first["tokens"]).logits
    want = F.cross_entropy(logits.flatten(0, 1), first["labels"].flatten()).item()
    assert abs(losses[0] - want) <= 1e-5 * want

    manifest = read_manifest(run / "step_00000012")
    assert manifest["parent"] == str(ckpt.absolute())
    assert cli("export", "hf", run, tmp_path / "out", "--dtype", "fp32") == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    model = load_model(run).model
    ids = tokens()
    with torch.no_grad():
        assert (tuned(ids).logits - model(ids)).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------------------------------- layouts


def reshard_worker(src: str, dst: str) -> None:
    """torchrun worker (2 processes, gloo): load ``src`` into an FSDP2-sharded model (wq/wk/... split by rows over
    the ranks, uneven where they do not divide) and save it sharded to ``dst``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megapipe.checkpoint import load_checkpoint, save_checkpoint
    from megapipe.config import ModelConfig
    from megapipe.models import build_model
    from megapipe.parallel.distributed import destroy_distributed

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(ModelConfig(**read_manifest(src)["model"]), seed=123 + dist.get_rank())
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_checkpoint(src, model, load_rng=False)
    save_checkpoint(dst, 7, model, manifest={**read_manifest(src), "stage": "test-fsdp", "parent": src},
                    tokenizer=Path(src) / "tokenizer")
    destroy_distributed()


@pytest.mark.dist
def test_export_is_the_same_from_any_layout(tmp_path, tokenizer_dir):
    hf_dir, ckpt, sharded = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "fsdp"
    make_hf_model("qwen3", hf_dir, tokenizer_dir)
    assert cli("import", "hf", hf_dir, ckpt) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, str(ckpt), str(sharded)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)
    assert len(list((sharded / "step_00000007" / "model").glob("*.distcp"))) == 2
    assert cli("export", "hf", ckpt, tmp_path / "a", "--max-shard-size", "50KB") == 0
    assert cli("export", "hf", sharded, tmp_path / "b", "--max-shard-size", "50KB") == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir()) and "model.safetensors.index.json" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


# --------------------------------------------------------------------------------------------------- refusals


@pytest.fixture()
def llama_dir(tmp_path, tokenizer_dir) -> Path:
    make_hf_model("llama3", tmp_path / "hf", tokenizer_dir)
    return tmp_path / "hf"


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def refused(capsys, *args) -> str:
    capsys.readouterr()
    assert cli(*args) != 0
    out, err = capsys.readouterr()
    assert err.startswith("error:") and "Traceback" not in err
    assert out == ""  # no stray line from a progress bar on a pipe
    return " ".join(err.split())


def test_refuses_unsupported_architecture(llama_dir, tmp_path, capsys):
    edit_config(llama_dir, architectures=["FalconForCausalLM"], model_type="falcon")
    err = refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")
    assert "FalconForCausalLM is not supported" in err and "LlamaForCausalLM, MistralForCausalLM" in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                           "original_max_position_embeddings": 32}), "rope_parameters.rope_type = 'yarn'"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor = 0.5"),
])
def test_refuses_config_fields(llama_dir, tmp_path, capsys, change, words):
    edit_config(llama_dir, rope_scaling=None, **change)
    assert words in refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")


def test_refuses_mixed_sliding_window_layers(tmp_path, tokenizer_dir, capsys):
    make_hf_model("qwen2", tmp_path / "hf", tokenizer_dir)
    edit_config(tmp_path / "hf", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"])
    err = refused(capsys, "import", "hf", tmp_path / "hf", tmp_path / "ckpt")
    assert "layer_types = '1 sliding_attention + 1 other layers'" in err


def test_refuses_missing_and_unexpected_tensors(llama_dir, tmp_path, capsys):
    tensors = tensors_of(llama_dir)
    extra = {**tensors, "model.layers.0.self_attn.rotary_scale": torch.ones(2)}
    save_file(extra, str(llama_dir / "model.safetensors"), metadata={"format": "pt"})
    err = refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")
    assert "has no place for: model.layers.0.self_attn.rotary_scale" in err
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(llama_dir / "model.safetensors"), metadata={"format": "pt"})
    err = refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")
    assert "lack tensors that the LlamaForCausalLM config needs: model.layers.1.mlp.up_proj.weight" in err


def test_refuses_wrong_shape(llama_dir, tmp_path, capsys):
    edit_config(llama_dir, intermediate_size=80)
    assert "config.json implies [80, 64]" in refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")


def test_refuses_tokenizer_larger_than_embedding(llama_dir, tmp_path, capsys):
    edit_config(llama_dir, vocab_size=256)
    err = refused(capsys, "import", "hf", llama_dir, tmp_path / "ckpt")
    assert "the tokenizer has 300 tokens but the model's embedding has only 256 rows" in err


def test_refuses_existing_output_and_unexpressible_config(llama_dir, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "export"
    assert cli("import", "hf", llama_dir, ckpt) == 0
    assert "already exists" in refused(capsys, "import", "hf", llama_dir, ckpt)
    out.mkdir()
    assert "already exists" in refused(capsys, "export", "hf", ckpt, out)
    assert "--max-shard-size '5 parsecs'" in refused(capsys, "export", "hf", ckpt, tmp_path / "o2",
                                                      "--max-shard-size", "5 parsecs")
    manifest_path = ckpt / "megapipe.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model"]["qkv_bias"] = True  # Llama has one attention_bias flag for q/k/v and o together
    manifest_path.write_text(json.dumps(manifest))
    err = refused(capsys, "export", "hf", ckpt, tmp_path / "o3")
    assert ("model.attn_out_bias = False cannot be expressed in a Hugging Face LlamaForCausalLM config "
            "(it would read back as model.attn_out_bias = True)") in err
    assert not any(p.name.startswith("o3") for p in tmp_path.iterdir())


if __name__ == "__main__":
    reshard_worker(sys.argv[1], sys.argv[2])
