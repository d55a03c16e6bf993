"""`megapipe posttrain sft`: packing parity, LoRA against peft and its two exports, exact resume, lineage, the saved
chat template, user mistakes, and the demonstration (a model that learns the chat set's answer format)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapipe.cli import main
from megapipe.errors import MegapipeError
from tests.posttrain.conftest import SMALL

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", Path.home() / ".cache/megapipe/smollm2")).expanduser()
ANSWER = re.compile(r"^ANSWER: \S[^\n]*$")
HELD_OUT = ["What is 12 plus 30?", "What is the capital of Norway?", "Spell the word garden backwards.",
            "How many letters are in the word rocket?", "What is the opposite of fast?", "Add 7 and 13."]


def sft_args(base, data, run, *extra) -> list[str]:
    return ["posttrain", "sft", "--load", str(base), "--data", str(data), "--chat-template", "chatml",
            "--seq-length", "96", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
            "--lr", "5e-3", "--lr-warmup-iters", "1", "--eval-iters", "1", "--log-interval", "1", "--save", str(run),
            "--quiet", *extra]


def losses(run: Path, kind: str = "train") -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == kind}


def test_packed_loss_equals_each_conversation_alone(chat_tokenizer, chat_data, tmp_path):
    """Block-diagonal attention and restarted positions: a packed row's per-conversation losses are those of each
    conversation run alone (fp32, 1e-5)."""
    from megapipe.config import ModelConfig
    from megapipe.data.sft import ChatEncoder
    from megapipe.data.sft_dataset import build_sft_datasets, prepare_sft_index
    from megapipe.models import build_model
    from megapipe.parallel.step import model_output
    from tests.posttrain.conftest import SMALL

    index = prepare_sft_index([str(chat_data)], ChatEncoder(chat_tokenizer, "chatml"), cache_dir=str(tmp_path))
    rows = build_sft_datasets(index, "90,10,0", 160, {"train": 64}, 3, True, "truncate", 1)["train"]
    picked = [i for i in range(rows.per_epoch) if len(rows.members(i)) >= 3][:2]
    batch = {k: torch.from_numpy(np.stack([rows[i][k] for i in picked])) for k in rows[0]}
    model = build_model(ModelConfig(**SMALL), seed=1)
    with torch.no_grad():
        logits = model_output(model, batch).logits
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                                      reduction="none").view(batch["labels"].shape)
        for r, i in enumerate(picked):
            for d, c in enumerate(rows.members(i)):
                at = batch["document_ids"][r] == d
                packed = (per_token[r] * (at & batch["loss_mask"][r])).sum()
                tokens = torch.from_numpy(index.tokens[c].astype("int64"))[:160]
                mask = torch.from_numpy(index.mask[c][1:len(tokens)].astype(bool))
                alone = torch.nn.functional.cross_entropy(model(tokens[None, :-1])[0], tokens[1:], reduction="none")
                assert packed.item() == pytest.approx((alone * mask).sum().item(), rel=1e-5), (i, c)


@pytest.fixture(scope="module")
def lora_run(base_ckpt, chat_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lora") / "run"
    assert main(sft_args(base_ckpt, chat_data, run, "--train-iters", "3", "--lr", "2e-2", "--lora-rank", "4",
                         "--lora-alpha", "8", "--lora-targets", "all-linear")) == 0
    return run / "step_00000003"


def test_lora_trains_adapters_only_and_matches_peft_and_the_merged_export(lora_run, base_ckpt, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megapipe.checkpoint import load_checkpoint, read_manifest
    from megapipe.config import ModelConfig, from_dict
    from megapipe.models import build_model
    from megapipe.models.lora import LoRASpec, apply_lora, is_adapter, lora_layers

    manifest = read_manifest(lora_run)
    assert manifest["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
    cfg = from_dict(ModelConfig, manifest["model"], "model.")
    ours = apply_lora(build_model(cfg), LoRASpec.from_manifest(manifest["lora"]))  # the adapters unmerged
    load_checkpoint(lora_run, ours, load_rng=False)
    assert len(lora_layers(ours)) == 7 * cfg.num_layers
    assert all(m.lora_B.weight.abs().max() > 0 for _, m in lora_layers(ours))  # trained (B starts at zero)
    base = build_model(cfg)
    load_checkpoint(base_ckpt, base, load_rng=False)
    base_state = base.state_dict()
    for name, value in ours.state_dict().items():  # the base stayed frozen
        if not is_adapter(name):
            assert torch.equal(value, base_state[name]), name

    for args in (["export", "hf", str(base_ckpt), str(tmp_path / "base"), "--dtype", "fp32"],
                 ["export", "hf", str(lora_run), str(tmp_path / "adapter"), "--lora-adapter-only"],
                 ["export", "hf", str(lora_run), str(tmp_path / "merged"), "--dtype", "fp32"]):
        assert main([*args, "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").glob("adapter_*")) == ["adapter_config.json",
                                                                               "adapter_model.safetensors"]
    tokens = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(tokens)
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                               tmp_path / "adapter")
        got_peft = peft_model(tokens).logits
        got_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(tokens).logits
    assert (got_peft - want).abs().max() < 1e-5 and (got_merged - want).abs().max() < 1e-5
    assert (base(tokens) - want).abs().max() > 1e-2  # the adapters do change the model

    code = main(["export", "hf", str(base_ckpt), str(tmp_path / "x"), "--lora-adapter-only", "--quiet"])
    assert code == MegapipeError.exit_code and not (tmp_path / "x").exists()


def test_lora_targets_are_parsed_and_checked():
    from megapipe.config import ModelConfig
    from megapipe.errors import ConfigError
    from megapipe.models.lora import parse_targets

    llama, gpt2 = ModelConfig(), ModelConfig(arch="gpt2", activation="gelu_tanh")
    assert parse_targets("all-linear", llama) == ("q", "k", "v", "o", "gate", "up", "down")
    assert parse_targets("all-linear", gpt2) == ("q", "k", "v", "o", "gate", "down")
    assert parse_targets("v, q,down", llama) == ("q", "v", "down")
    with pytest.raises(ConfigError, match="unknown layer 'x'"):
        parse_targets("q,x", llama)
    with pytest.raises(ConfigError, match=r"names 'up', which GPT-2 models do not have as a LoRA target \(theirs: "
                                          "q,k,v,o,gate,down\\)"):
        parse_targets("up", gpt2)
    # MoE: attention and the shared expert (Qwen2-MoE); never the router or the routed experts
    mixtral = ModelConfig(arch="mixtral", num_experts=4)
    qwen2_moe = ModelConfig(arch="qwen2_moe", num_experts=4, moe_shared_expert_intermediate_size=32)
    assert parse_targets("all-linear", mixtral) == ("q", "k", "v", "o")
    assert parse_targets("all-linear", qwen2_moe) == ("q", "k", "v", "o", "gate", "up", "down")
    with pytest.raises(ConfigError, match=r"names 'gate', which Mixtral models do not have as a LoRA target"):
        parse_targets("q,gate", mixtral)


def test_lora_dropout_acts_as_peft_defines_it():
    """peft's LoRA output: W x + B A dropout(x) * alpha / rank, the dropout only while training (here: in train
    mode with gradients on); --lora-dropout reaches the layers through the run's config."""
    import torch.nn.functional as F

    from megapipe.config import load_config
    from megapipe.models import build_model
    from megapipe.models.lora import apply_lora
    from megapipe.posttrain.lora import lora_spec

    cfg = load_config(None, {**{f"model.{k}": v for k, v in SMALL.items()}, "lora.rank": 4, "lora.alpha": 8,
                             "lora.dropout": 0.5, "lora.targets": "q"})
    model = apply_lora(build_model(cfg.model, seed=0), lora_spec(cfg), seed=0)
    wq = model.layers["0"].attention.wq
    torch.nn.init.normal_(wq.lora_B.weight)
    x = torch.randn(2, 5, SMALL["hidden_size"])

    def formula(inp):
        return x @ wq.weight.t() + inp @ wq.lora_A.weight.t() @ wq.lora_B.weight.t() * (8 / 4)

    model.train()
    torch.manual_seed(7)
    got = wq(x)
    torch.manual_seed(7)
    want = formula(F.dropout(x, 0.5, training=True))
    assert (got - want).abs().max() < 1e-5 and (got - formula(x)).abs().max() > 1e-2
    with torch.no_grad():
        assert (wq(x) - formula(x)).abs().max() < 1e-5
    model.eval()
    assert (wq(x) - formula(x)).abs().max() < 1e-5


def test_a_lora_rank_beyond_the_layers_width_is_refused(base_ckpt, chat_data, tmp_path, capsys):
    """The adapter B @ A of a 64 -> 32 layer (k: 2 KV heads of 16) has rank at most 32."""
    run = tmp_path / "run"
    args = ["posttrain", "sft", "--load", str(base_ckpt), "--data", str(chat_data), "--chat-template", "chatml",
            "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--lora-targets", "q,k", "--save", str(run), "--quiet"]
    assert main([*args, "--lora-rank", "100000"]) == MegapipeError.exit_code
    err = " ".join(capsys.readouterr().err.split())
    assert ("lora.rank (--lora-rank) = 100000 is more than the width of layers.0.attention.wk (64 -> 32): an "
            "adapter's rank is at most 32 there") in err
    assert not run.exists()
    assert main([*args, "--lora-rank", "32"]) == 0


def test_lora_on_moe_adapts_attention_and_the_shared_expert_never_the_router():
    from megapipe.config import ModelConfig
    from megapipe.models import build_model
    from megapipe.models.lora import LoRASpec, apply_lora, lora_layers

    cfg = ModelConfig(arch="qwen2_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=4, num_experts=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                      moe_shared_expert_gate=True, moe_layer_freq=[1, 0, 1])
    model = apply_lora(build_model(cfg, seed=0), LoRASpec(4, 8.0, 0.0, ("q", "gate", "down")))
    names = sorted(n for n, _ in lora_layers(model))
    assert names == ["layers.0.attention.wq", "layers.0.moe.shared_experts.w1", "layers.0.moe.shared_experts.w2",
                     "layers.1.attention.wq", "layers.1.feed_forward.w1", "layers.1.feed_forward.w2",
                     "layers.2.attention.wq", "layers.2.moe.shared_experts.w1", "layers.2.moe.shared_experts.w2"]
    assert not any(".moe.gate" in n or "shared_gate" in n or "experts.w" in n.replace("shared_experts", "")
                   for n in names)


def test_resume_is_exact_with_lineage_and_the_chat_template_saved(base_ckpt, chat_data, tmp_path):
    from megapipe.data.chat_template import CHATML

    extra = ["--packing", "--lora-rank", "4", "--train-iters", "4", "--eval-interval", "2", "--save-interval", "2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(sft_args(base_ckpt, chat_data, whole, *extra)) == 0
    assert main(sft_args(base_ckpt, chat_data, cut, *extra, "--exit-interval", "2")) == 0
    assert sorted(losses(cut)) == [1, 2]
    assert main(sft_args(base_ckpt, chat_data, cut, *extra)) == 0  # the same command again: resumes
    assert losses(cut) == losses(whole)  # bit for bit
    assert losses(cut, "valid")[4] == losses(whole, "valid")[4]

    out = subprocess.run([sys.executable, "-m", "megapipe.cli", "checkpoint", "inspect", str(cut), "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    lineage = [(c["stage"], c["step"]) for c in json.loads(out)["lineage"]]
    assert lineage == [("sft", 4), ("sft", 2), ("init", 0)]
    saved = cut / "step_00000004" / "tokenizer"
    assert (saved / "chat_template.jinja").read_text() == CHATML
    assert json.loads((saved / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    m = json.loads((cut / "step_00000004" / "megapipe.json").read_text())
    assert m["sft"]["packing"] and m["sft"]["chat_template"] == "chatml" and 0.9 < m["sft"]["packing_efficiency"] <= 1


@pytest.mark.parametrize("drop, add, message", [
    (["--data"], [], "sft.data (--data) is not set"),
    (["--chat-template"], [], "has no chat template: pass --chat-template"),
    ([], ["--lora-rank", "4", "--lora-targets", "q,x"], "lora.targets (--lora-targets) has unknown layer 'x'"),
    ([], ["--lora-rank", "4", "--lora-alpha", "0"], "lora.alpha = 0.0 must be > 0"),
    ([], ["--lora-rank", "4", "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"],
     "LoRA (--lora-rank) with tensor parallelism (--tensor-model-parallel-size 2) is not supported yet"),
    ([], ["--packing", "--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"], "packed sequences"),
    (["--load"], [], "posttrain sft starts from a checkpoint: give --load CKPT"),
    (["--data"], ["--data", "BAD"], "bad.jsonl:2: messages[1].role = 'robot' is not one of"),
])
def test_mistakes_are_one_clear_error_before_anything_runs(base_ckpt, chat_data, tmp_path, capsys, drop, add, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}\n')
    args = sft_args(base_ckpt, chat_data, tmp_path / "run", "--train-iters", "2")
    for flag in drop:
        i = args.index(flag)
        del args[i:i + 2]
    args += [str(bad) if a == "BAD" else a for a in add]
    assert main(args) == MegapipeError.exit_code
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run").exists()


def test_a_save_directory_of_another_run_is_not_resumed(base_ckpt, chat_tokenizer, chat_data, tmp_path, capsys):
    from tests.posttrain.conftest import write_model

    run = tmp_path / "run"
    assert main(sft_args(base_ckpt, chat_data, run, "--train-iters", "1")) == 0
    other = write_model(tmp_path / "other", chat_tokenizer, seed=9)
    assert main(sft_args(other, chat_data, run, "--train-iters", "2")) == MegapipeError.exit_code
    assert f"holds a run started from {base_ckpt}, not from {other}" in " ".join(capsys.readouterr().err.split())


def test_a_lora_checkpoint_is_not_silently_merged_into_a_new_run(lora_run, chat_data, tmp_path, capsys):
    assert main(sft_args(lora_run, chat_data, tmp_path / "run", "--train-iters", "1")) == MegapipeError.exit_code
    assert "holds LoRA adapters" in capsys.readouterr().err


def chat_prompts(tokenizer_dir: Path) -> list[str]:
    from megapipe.data.sft import ChatEncoder

    enc = ChatEncoder(tokenizer_dir)  # the template saved with the checkpoint
    return [enc.render([{"role": "user", "content": q}], add_generation_prompt=True) for q in HELD_OUT]


def generate(ckpt: Path, prompts: list[str]) -> list[str]:
    args = [sys.executable, "-m", "megapipe.cli", "generate", str(ckpt), "--max-new-tokens", "16", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [r["completion"] for r in json.loads(out.stdout)]


def test_sft_makes_generate_answer_in_the_trained_format(base_ckpt, sft_model):
    """The demonstration on a small model trained here (conftest.sft_model; tools/demo_sft.py runs it on
    SmolLM2-135M-Instruct): after SFT on the chat set, held-out questions rendered with the checkpoint's own chat
    template get one-line answers in the set's format, ``ANSWER: ...``, ended by the end-of-turn token; before,
    none."""
    prompts = chat_prompts(sft_model / "tokenizer")
    before, after = generate(base_ckpt, prompts), generate(sft_model, prompts)
    assert not any(ANSWER.match(b) for b in before), before
    assert all(ANSWER.match(a) for a in after), after


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                    reason=f"SmolLM2 not prepared at {SMOLLM2} (`make test` prepares it; or tools/prepare_smollm2.py)")
def test_a_short_sft_of_smollm2_answers_in_the_trained_format(chat_data, tmp_path):
    """The demonstration below, short enough for every run: SmolLM2-135M-Instruct imported, 3 LoRA steps on the
    chat set, then held-out questions through the engine with the checkpoint's chat template: the fine-tuned model
    answers each in the set's format, ``ANSWER: ...`` (the instruct model on its own answers in sentences)."""
    from megapipe.checkpoint.hf import import_hf
    from megapipe.checkpoint.load import load_model
    from megapipe.data.tokenizer import load_tokenizer
    from megapipe.inference import generate

    base, run = tmp_path / "base", tmp_path / "sft"
    import_hf(SMOLLM2, base)
    assert main(["posttrain", "sft", "--load", str(base), "--data", str(chat_data), "--seq-length", "64",
                 "--packing", "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3",
                 "--lr", "5e-3", "--lr-warmup-iters", "1", "--split", "95,5,0", "--eval-iters", "1",
                 "--lora-rank", "8", "--lora-alpha", "16", "--save", str(run), "--quiet"]) == 0
    loaded = load_model(run)
    answers = generate(loaded.model, load_tokenizer(loaded.tokenizer_dir), chat_prompts(loaded.tokenizer_dir)[:3], 12)
    assert all(ANSWER.match(a) for a in answers), answers


@pytest.mark.skipif(os.environ.get("MEGAPIPE_TEST_SMOLLM2") != "1" or not (SMOLLM2 / "config.json").is_file(),
                    reason="set MEGAPIPE_TEST_SMOLLM2=1 (and prepare SmolLM2) to run the demonstration on it (minutes)")
def test_sft_demonstration_on_smollm2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    out = subprocess.run([sys.executable, str(ROOT / "tools/demo_sft.py"), "--work", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
