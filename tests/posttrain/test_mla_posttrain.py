"""`posttrain sft` and `distill` on DeepSeek-V3 (multi-latent attention + MoE) through the CLI, as imported from
Hugging Face: full fine-tuning of a model with its MTP layer (the MTP loss logged beside the LM loss, the MTP layer
exported back), LoRA on every MLA projection peft can hold, whose adapters peft loads onto transformers'
DeepseekV3ForCausalLM with our logits (fp32), and distillation from an MLA teacher into an MLA student (also
DeepSeek-V3.2's)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from megapipe.errors import ConfigError
from tests.helpers.hf_mtp import MTP, make_mtp_dir
from tests.helpers.hf_tiny import make_hf_dir

FIXTURES = Path(__file__).parents[1] / "fixtures"
CHAT = FIXTURES / "chat_answer_format.jsonl"
TOKENS = torch.tensor([[5, 17, 9, 33, 2, 71, 8, 19, 44, 3]])


def cli(*args) -> int:
    return main([str(a) for a in args])


def sft(ckpt: Path, run: Path, *extra) -> list[dict]:
    assert cli("posttrain", "sft", "--load", ckpt, "--data", CHAT, "--seq-length", "64", "--micro-batch-size", "2",
               "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--lr-warmup-iters", "0",
               "--eval-iters", "0", "--log-interval", "1", "--save", run, "--precision", "fp32", "--quiet",
               *extra) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    return train


def test_full_sft_of_an_mla_model_with_its_mtp_layer(tmp_path):
    from safetensors.torch import load_file

    hf_dir, _, _ = make_mtp_dir(tmp_path / "hf")
    ckpt, run, out = tmp_path / "ckpt", tmp_path / "run", tmp_path / "out"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    train = sft(ckpt, run)
    assert all(math.isfinite(r["mtp/loss_1"]) for r in train)
    assert cli("export", "hf", run / "step_00000002", out, "--dtype", "fp32", "--quiet") == 0
    source, tuned = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == tuned.keys()
    assert not torch.equal(source[MTP + "eh_proj.weight"], tuned[MTP + "eh_proj.weight"])  # the MTP layer trained
    assert torch.equal(tuned[MTP + "shared_head.head.weight"], tuned["lm_head.weight"])


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_bottleneck", "plain_q"])
def test_lora_on_mla_matches_peft_on_transformers(tmp_path, q_lora_rank):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megapipe.checkpoint.hf.peft import peft_targets
    from megapipe.checkpoint.load import load_model

    hf_dir, _ = make_hf_dir(tmp_path / "hf", "deepseek_v3", q_lora_rank=q_lora_rank)
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    cfg = load_model(ckpt).model.cfg
    targets = peft_targets(cfg)
    want = ["q", "o", "kv_a", "kv_b"] + (["q_a"] if q_lora_rank else [])
    assert sorted(targets) == sorted(want)
    sft(ckpt, run, "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ",".join(targets))

    step, base_hf, adapter = run / "step_00000002", tmp_path / "base_hf", tmp_path / "adapter"
    assert cli("export", "hf", ckpt, base_hf, "--dtype", "fp32", "--quiet") == 0
    assert cli("export", "hf", step, adapter, "--lora-adapter-only", "--quiet") == 0
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "kv_b_proj" in modules and "kv_a_proj_with_mqa" in modules and r"mlp\.experts" not in modules
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_hf), adapter).eval()
        merged = load_model(step).model.eval()  # the adapters folded into the weights
        base = load_model(ckpt).model.eval()
        got, unmerged = merged(TOKENS), peft_model(TOKENS).logits
        folded = peft_model.merge_and_unload()(TOKENS).logits  # peft's merge: the same arithmetic as ours
    assert not torch.allclose(got, base(TOKENS), atol=1e-3)  # the adapters moved the logits
    torch.testing.assert_close(got, folded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, unmerged, atol=1e-4, rtol=1e-4)  # x W + (x A) B rounds otherwise


def test_mla_lora_target_names_are_checked():
    from megapipe.config import ModelConfig, resolve_preset
    from megapipe.models.lora import parse_targets

    mla = ModelConfig(**resolve_preset("deepseek-v3-tiny"))
    assert parse_targets("all-linear", mla) == ("q", "o", "q_a", "kv_a", "kv_b")
    assert parse_targets("all-linear", dataclasses.replace(mla, q_lora_rank=None)) == ("q", "o", "kv_a", "kv_b")
    for wrong in ("k", "gate"):  # MLA has no k; peft retargets DeepSeek-V3's MLP names to its fused experts
        with pytest.raises(ConfigError, match=rf"names '{wrong}', which DeepSeek-V3 .* \(theirs: q,o,q_a,kv_a,kv_b\)"):
            parse_targets(f"q,{wrong}", mla)
    with pytest.raises(ConfigError, match=r"names 'kv_b', which Llama models do not have"):
        parse_targets("kv_b", ModelConfig(arch="llama"))


@pytest.mark.parametrize("arch, student", [("deepseek_v3", dict(q_lora_rank=None)), ("deepseek_v32", {})])
def test_distill_an_mla_teacher_into_an_mla_student(tmp_path, arch, student):
    """DeepSeek-V3, and DeepSeek-V3.2 (its sparse attention in teacher and student)."""
    teacher_hf, _ = make_hf_dir(tmp_path / "teacher_hf", arch)
    student_hf, _ = make_hf_dir(tmp_path / "student_hf", arch, seed=1, hidden_size=32, **student)
    teacher, student, run, data = (tmp_path / n for n in ("teacher", "student", "run", "data"))
    assert cli("import", "hf", teacher_hf, teacher, "--quiet") == 0
    assert cli("import", "hf", student_hf, student, "--quiet") == 0
    assert cli("preprocess", "--input", FIXTURES / "shakespeare_excerpt.jsonl", "--output-prefix", data, "--tokenizer",
               teacher_hf, "--append-eod", "--quiet") == 0
    assert cli("posttrain", "distill", "--teacher", teacher, "--student", student, "--data-path",
               f"{data}_text_document", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
               "--split", "90,10,0", "--train-iters", "2", "--lr", "1e-2", "--eval-iters", "1", "--log-interval", "1",
               "--save", run, "--precision", "fp32", "--quiet") == 0
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["kd_loss"]) for r in train)
