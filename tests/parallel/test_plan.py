"""The layout planner: exact parameter counts, activation formulas, layout ranking, the CLI and its errors, and the
memory model against a real CPU training step."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from megapipe.config import ModelConfig, load_config
from megapipe.errors import ConfigError
from megapipe.models import build_model, count_params
from megapipe.parallel import plan as P
from megapipe.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("check_plan_memory", ROOT / "tools" / "check_plan_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(**over):
    return load_config(None, over)


@pytest.mark.parametrize("preset", ["tiny", "llama3-1b", "llama3-8b", "llama3-70b", "qwen2.5-0.5b", "gpt2-124m"])
def test_param_counts_match_the_model(preset):
    cfg = load_config(None, {"model.preset": preset, "model.vocab_size": 4096} if preset == "tiny"
                      else {"model.preset": preset}).model
    assert P.param_counts(cfg).total == count_params(build_model(cfg, device="meta"))


def test_param_counts_with_biases_qk_norm_and_learned_positions():
    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                      num_kv_heads=2, qkv_bias=True, attn_out_bias=True, mlp_bias=True, qk_norm=True,
                      norm_type="layernorm", position_embedding="learned", max_position_embeddings=128)
    assert P.param_counts(cfg).total == count_params(build_model(cfg, device="meta"))


def test_params_per_rank_under_tp_pp_fsdp():
    cfg = _cfg(**{"model.preset": "llama3-8b", "train.global_batch_size": 16, "train.micro_batch_size": 1,
                  "data.seq_length": 4096, "parallel.tp": 2, "parallel.pp": 4})
    dims = ParallelDims.from_config(cfg.parallel, 16, cfg.train, cfg.model, 4096)
    assert dims.dp_shard == 2
    ranks = P.rank_memory(cfg, dims, 4096)
    pc = P.param_counts(cfg.model)
    assert [r.layers for r in ranks] == [8, 8, 8, 8]
    layer = pc.layer_tp // 2 + pc.layer_rep
    assert ranks[1].params == 8 * layer  # a middle stage: only its layers, split by tp
    assert ranks[0].params == 8 * layer + pc.embedding_tp // 2
    assert ranks[3].params == 8 * layer + pc.head_tp // 2 + pc.head_rep
    assert sum(r.params for r in ranks) == (pc.total - 32 * pc.layer_rep - pc.head_rep) // 2 + 32 * pc.layer_rep \
        + pc.head_rep
    r = ranks[0]
    assert r.params_sharded == -(-r.params // 2)  # FSDP over dp_shard = 2
    assert (r.weights, r.grads, r.optimizer) == (4 * r.params_sharded, 4 * r.params_sharded, 8 * r.params_sharded)


def test_muon_state_is_one_momentum_per_parameter_plus_adamw_on_embedding_and_output():
    over = {"model.preset": "llama3-8b", "train.global_batch_size": 16, "train.micro_batch_size": 1,
            "data.seq_length": 4096, "parallel.tp": 2, "parallel.pp": 4, "optim.optimizer": "muon"}
    cfg = _cfg(**over)
    ranks = P.rank_memory(cfg, ParallelDims.from_config(cfg.parallel, 16, cfg.train, cfg.model, 4096), 4096)
    pc = P.param_counts(cfg.model)
    first, middle, last = ranks[0], ranks[1], ranks[3]
    assert middle.optimizer == 4 * middle.params_sharded
    assert first.optimizer == 4 * first.params_sharded + 4 * math.ceil(pc.embedding_tp / 2 / 2)  # / tp / fsdp
    assert last.optimizer == 4 * last.params_sharded + 4 * math.ceil(pc.head_tp / 2 / 2)


def test_tied_output_keeps_an_embedding_copy_on_the_last_stage():
    cfg = _cfg(**{"model.preset": "llama3-1b", "train.global_batch_size": 4, "train.micro_batch_size": 1,
                  "parallel.pp": 2})
    dims = ParallelDims.from_config(cfg.parallel, 2, cfg.train, cfg.model, cfg.data.seq_length)
    pc = P.param_counts(cfg.model)
    first, last = P.rank_memory(cfg, dims, cfg.data.seq_length)
    assert first.params == 8 * pc.layer + pc.embedding
    assert last.params == 8 * pc.layer + pc.embedding + pc.head_rep


def test_layer_activation_bytes_hand_computed():
    # h 64, q 64 (4 heads x 16), kv 32, f 176, a 4
    m = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2)
    # fp32: 6 h-wide fp32 tensors, q after rope + attention output, k after rope + v, 4 f-wide, logsumexp, 2 rsqrt
    assert P.layer_activation_bytes(m, "fp32", "none") == 4 * (6 * 64 + 2 * 64 + 2 * 32 + 4 * 176 + 4) + 8 == 5144
    # bf16: 4 fp32 residual/norm tensors, 5 bf16 linear-input casts, bf16 attention/MLP tensors
    assert P.layer_activation_bytes(m, "bf16", "none") == 16 * 64 + 8 + 10 * 64 + 2 * (2 * 64 + 2 * 32) + 16 \
        + 8 * 176 == 3480
    assert P.layer_activation_bytes(m, "bf16", "full") == 4 * 64
    assert P.layer_activation_bytes(m, "fp32", "selective") == 4 * 64 + 4 * (2 * 64 + 2 * 32 + 2 * 176) + 16 \
        + 4 * 2 * 64
    # tp 4 with sequence parallelism: residual/norm terms and attention/MLP split, the gathered linear inputs not
    assert P.layer_activation_bytes(m, "bf16", "none", tp=4) == (16 * 64 + 8) / 4 + 10 * 64 \
        + (2 * (2 * 64 + 2 * 32) + 16 + 8 * 176) / 4
    # Llama-3-8B, bf16, per token and layer
    m8 = load_config(None, {"model.preset": "llama3-8b"}).model
    assert P.layer_activation_bytes(m8, "bf16", "none") == 26 * 4096 + 4 * 4096 + 4 * 1024 + 8 * 14336 + 128 + 8


def test_korthikanti_formulas_gpt3_175b():
    # GPT-3 175B (h 12288, a 96, s 2048, b 1), t 8: Korthikanti et al. 2022 Table 2, evaluated by hand
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert P.korthikanti_layer_bytes(s, b, h, a) == s * h * (34 + 80) == 2_868_903_936
    assert P.korthikanti_layer_bytes(s, b, h, a, t) == s * h * (10 + (24 + 80) / 8) == 578_813_952
    assert P.korthikanti_layer_bytes(s, b, h, a, t, sp=True) == 358_612_992
    assert P.korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="selective") == 106_954_752
    assert P.korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="full") == 2 * s * h / 8


def test_saved_activations_equal_the_formula_exactly():
    """What autograd really saves in one forward (saved-tensor hooks, distinct storages, parameters excluded)."""
    tool = _tool()
    model_over = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                      num_kv_heads=2)
    from megapipe.training.precision import autocast

    for precision in ("fp32", "bf16"):
        cfg = tool.build_cfg(precision, "none", 2, 2, model_over, seq=32)
        model = build_model(cfg.model, seed=0)
        tokens = torch.randint(0, 512, (2, 32))
        measured = tool._saved_bytes(model, (tokens,), lambda p=precision: autocast(p, "cpu"))
        predicted = tool.predict(cfg)["saved_activations"]
        # the only unmodelled saved tensors are RoPE's cos/sin tables (2 x S x head_dim fp32 = 4 KB here)
        assert abs(predicted - measured) <= 2 * 32 * 16 * 4, (precision, predicted, measured)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("recompute,micro,global_", [("none", 2, 4), ("full", 2, 2)])
def test_peak_memory_of_a_cpu_step_within_10_percent(recompute, micro, global_):
    """Predicted vs measured peak resident memory of two fp32 AdamW steps in a fresh process. 10%: the model
    counts tensors only; the resident set also holds allocator headers, page rounding and Python objects (a few
    hundred KB here), and the peak's timing inside backward (which layer's gradients exist yet) is approximated."""
    tool = _tool()
    model = dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2,
                 tie_embeddings=False)
    row = tool.compare(dict(name="t", precision="fp32", recompute=recompute, micro=micro, seq=256, model=model,
                            **{"global": global_}))
    assert abs(row["peak_error"]) < 0.10, row


def test_ranking_returns_valid_layouts_only():
    cfg = _cfg(**{"model.preset": "llama3-8b", "train.global_batch_size": 32, "train.micro_batch_size": 1,
                  "data.seq_length": 8192, "train.precision": "bf16", "train.recompute": "selective"})
    gpu = P.gpu_spec("h100")
    cands = P.candidate_layouts(cfg, 16)
    best, n_valid, n_fit = P.rank_layouts(cfg, 16, gpu, top=1000)
    assert n_valid == len(cands) and 0 < n_fit <= n_valid and len(best) == n_fit
    seen = set()
    for d in cands:
        lay = (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp)
        assert lay not in seen
        seen.add(lay)
        assert d.dp_replicate * d.dp_shard * d.cp * d.tp * d.pp == 16 and d.tp <= 8
        ParallelDims.from_config(cfg.parallel.__class__(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=d.cp,
                                                        tp=d.tp, pp=d.pp), 16, cfg.train, cfg.model, 8192)
    assert (1, 1, 1, 16, 1) not in seen  # tp across nodes
    assert all(b.memory_bytes <= gpu.memory_bytes for b in best)
    speeds = [b.tokens_per_s for b in best]
    assert speeds == sorted(speeds, reverse=True)
    # the layout with a 4-stage pipeline over 32/(4 dp) = 8 micro-batches carries its bubble (p-1)/(m+p-1)
    d = next(d for d in cands if (d.pp, d.dp_shard, d.tp) == (4, 4, 1))
    assert P.efficiency(d, d.num_pp_microbatches(cfg.train))["pp_bubble"] == pytest.approx(1 - 3 / 11)


def test_ranking_offers_only_the_layouts_the_architecture_declares():
    """Nemotron-H's Mamba layers take no context parallelism: no cp > 1 layout is ranked for it, while the same
    GPUs give a Llama of its size cp layouts."""
    opts = {"train.global_batch_size": 64, "train.micro_batch_size": 1, "data.seq_length": 8192}
    hybrid = P.candidate_layouts(_cfg(**{"model.preset": "nemotron-h-8b", **opts}), 8)
    dense = P.candidate_layouts(_cfg(**{"model.preset": "llama3-8b", **opts}), 8)
    assert hybrid and all(d.cp == 1 for d in hybrid)
    assert any(d.cp > 1 for d in dense)


def test_step_flops_and_time():
    cfg = _cfg(**{"model.preset": "llama3-8b", "train.global_batch_size": 64, "train.micro_batch_size": 1,
                  "data.seq_length": 8192, "train.precision": "bf16", "train.recompute": "full"})
    from megapipe.models import flops_per_token

    r = P.plan(cfg, 64, "h100", mfu=0.4)
    tokens = 64 * 8192
    assert r["flops"]["none"]["model_flops"] == flops_per_token(cfg.model, 8192) * tokens
    assert r["flops"]["full"]["hardware_flops"] == pytest.approx(r["flops"]["none"]["model_flops"] * 4 / 3)
    eff = r["efficiency"]["total"]
    assert r["step_time_s"] == pytest.approx(r["flops"]["full"]["hardware_flops"] / (64 * 989e12 * 0.4 * eff))


def test_cli_json_and_tables(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu-type", "h200", "--seq-length", "4096",
            "--micro-batch-size", "1", "--global-batch-size", "16", "--precision", "bf16", "--tp", "2"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["total"] == 8_030_261_248
    assert out["gpu"]["memory_bytes"] == 141e9 and out["layout"]["tp"] == 2 and out["layout"]["dp_shard"] == 4
    assert 0 < len(out["best_layouts"]) <= 5
    assert all(b["dp_replicate"] * b["dp_shard"] * b["cp"] * b["tp"] * b["pp"] == 8 for b in out["best_layouts"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "memory per rank" in text and "best layouts for 8 GPUs" in text


@pytest.mark.parametrize("extra,message", [
    (["--tp", "3"], "not divisible by tp*pp*cp*dp_replicate"),
    (["--tp", "2", "--pp", "2", "--dp-shard", "4"], "does not match the world size 8"),
    (["--tp", "16", "--gpus", "16"], "spans more than one node"),
    (["--gpu-type", "v100"], "allowed: a100, h100, h200"),
    (["--mfu", "1.5"], "--mfu = 1.5"),
    (["--set", "model.num_kv_heads=3"], "not divisible"),
])
def test_cli_bad_inputs(capsys, extra, message):
    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--micro-batch-size", "1", "--global-batch-size", "16"]
    if "--gpus" in extra:
        args = args[:3] + args[5:]
    assert main([*args, *extra]) != 0
    assert message in capsys.readouterr().err


def test_missing_vocab_size_is_a_clear_error():
    with pytest.raises(ConfigError, match="model.vocab_size is not set"):
        P.plan(_cfg(**{"model.preset": "tiny"}), 1)


def test_cli_reads_a_yaml_config_and_set_overrides(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  preset: llama3-1b\ntrain:\n  micro_batch_size: 2\n  global_batch_size: 32\n"
                   "  precision: bf16\nparallel:\n  tp: 2\n")
    assert main(["plan", "--config", str(cfg), "--gpus", "4", "--gpu-type", "A100", "--set", "data.seq_length=2048",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["tp"] == 2 and out["layout"]["dp_shard"] == 2 and out["gpu"]["peak_flops"] == 312e12
    loaded = load_config(cfg, ["data.seq_length=2048"])
    assert out["flops"]["none"]["tokens"] == 32 * 2048
    assert out["params"]["total"] == count_params(build_model(loaded.model, device="meta"))


def test_pipeline_activations_follow_1f1b_in_flight_counts():
    cfg = _cfg(**{"model.preset": "llama3-8b", "train.global_batch_size": 16, "train.micro_batch_size": 1,
                  "data.seq_length": 4096, "train.precision": "bf16", "parallel.tp": 2, "parallel.pp": 4})
    dims = ParallelDims.from_config(cfg.parallel, 16, cfg.train, cfg.model, 4096)
    m = dims.num_pp_microbatches(cfg.train)
    assert m == 8
    ranks = P.rank_memory(cfg, dims, 4096)
    layer = P.layer_activation_bytes(cfg.model, "bf16", "none", tp=2) * 4096
    stage_output = 4 * 4096 / 2 * 4096  # the last block's fp32 output (split by SP), in the schedule's forward cache
    for r in ranks[:3]:  # stage i holds pp - i micro-batches of its 8 layers
        assert r.activations["none"] == pytest.approx((8 * layer + stage_output) * (4 - r.pp_rank))
    kept, transient = P.head_activation_bytes(cfg.model, "bf16", tp=2)
    assert not P.PP_KEEPS_OUTPUTS  # megapipe.parallel.step passes return_outputs=False: no logits kept per micro-batch
    logits = 2 * 128256 / 2 * 4096  # but the in-flight micro-batch's bf16 logits stay in the forward cache
    assert ranks[3].activations["none"] == pytest.approx(8 * layer + logits + (kept + transient) * 4096)


# --------------------------------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("preset", ["tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3-tiny"])
def test_moe_param_counts_match_the_model(preset):
    cfg = load_config(None, {"model.preset": preset, "model.vocab_size": 32000}).model
    pc = P.param_counts(cfg)
    model = build_model(cfg, device="meta")
    assert pc.total == count_params(model)
    experts = sum(b.moe.experts.w1.numel() * 3 for b in model.layers.values() if hasattr(b, "moe"))
    assert pc.experts == experts
    assert pc.active == pc.total - round(experts * (1 - cfg.moe_router_topk / cfg.num_experts))
    kinds = pc.by_kind()
    assert sum(d["layers"] for d in kinds.values()) == cfg.num_layers
    assert sum(d["layers"] for kind, d in kinds.items() if kind in P.MOE_KINDS) == len(cfg.moe_layers)


def test_mixtral_total_and_active_parameters():
    pc = P.param_counts(load_config(None, {"model.preset": "mixtral-8x7b"}).model)
    assert round(pc.total / 1e9, 1) == 46.7 and round(pc.active / 1e9, 1) == 12.9  # Mixtral's 46.7 B / 12.9 B


def test_expert_memory_per_rank_and_all_to_all_volume():
    over = {"model.preset": "mixtral-8x7b", "train.global_batch_size": 64, "train.micro_batch_size": 1,
            "data.seq_length": 4096, "train.precision": "bf16", "parallel.pp": 2, "parallel.ep": 4}
    cfg = _cfg(**over)
    dims = ParallelDims.from_config(cfg.parallel, 32, cfg.train, cfg.model, 4096)
    assert (dims.dp_shard, dims.ep) == (16, 4)
    pc = P.param_counts(cfg.model)
    ranks = P.rank_memory(cfg, dims, 4096)
    per_layer_experts = pc.layers[0].experts
    for r in ranks:
        assert r.expert_params == 16 * per_layer_experts // 4  # 16 layers per stage, experts split by ep
        # FSDP shards the experts over the other dp_shard / ep = 4 ranks, everything else over 16
        assert r.expert_bytes == 16 * math.ceil(r.expert_params / 4)
        dense = r.params - r.expert_params
        assert r.params_sharded == math.ceil(dense / 16) + math.ceil(r.expert_params / 4)
        tokens = 4096 * dims.num_pp_microbatches(cfg.train)
        assert r.all_to_all_bytes == pytest.approx(4 * 16 * tokens * 2 * 4096 * 2 * 3 / 4)
    no_ep = P.rank_memory(_cfg(**{**over, "parallel.ep": 1}), ParallelDims.from_config(
        _cfg(**{**over, "parallel.ep": 1}).parallel, 32, cfg.train, cfg.model, 4096), 4096)
    # the sharded state is the same (experts / ep / (dp_shard / ep)); ep shrinks what FSDP gathers: a block's experts
    assert no_ep[0].all_to_all_bytes == 0 and no_ep[0].params_sharded == ranks[0].params_sharded
    assert no_ep[0].compute_copies > 3 * ranks[0].compute_copies


def test_moe_saved_activations_equal_the_formula():
    tool = _tool()
    from megapipe.training.precision import autocast

    model_over = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                      moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True, moe_z_loss_coeff=0.01,
                      moe_aux_loss_coeff=0.01, moe_layer_freq=[0, 1])
    for precision in ("fp32", "bf16"):
        cfg = tool.build_cfg(precision, "none", 2, 2, model_over, seq=32)
        model = build_model(cfg.model, seed=0)
        measured = tool._saved_bytes(model, (torch.randint(0, 512, (2, 32)),), lambda p=precision: autocast(p, "cpu"))
        predicted = tool.predict(cfg)["saved_activations"]
        assert abs(predicted - measured) <= 2 * 32 * 16 * 4 + 256, (precision, predicted, measured)


def test_moe_ranking_prefers_expert_parallelism_and_explains_the_time(capsys):
    cfg = _cfg(**{"model.preset": "mixtral-8x7b", "train.global_batch_size": 256, "train.micro_batch_size": 1,
                  "data.seq_length": 4096, "train.precision": "bf16", "train.recompute": "full"})
    best, n_valid, _ = P.rank_layouts(cfg, 64, P.gpu_spec("h100"), top=3)
    assert all(cfg.model.num_experts % b.dims.ep == 0 and b.dims.dp_shard % b.dims.ep == 0 for b in best)
    assert best[0].dims.ep > 1  # without ep every rank gathers all experts of a layer over the network
    assert "all_to_all_s" in best[0].efficiency
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--seq-length", "4096", "--micro-batch-size", "1",
                 "--global-batch-size", "64", "--precision", "bf16", "--recompute", "full", "--ep", "8"]) == 0
    text = capsys.readouterr().out
    assert "active per token" in text and "MoE all-to-all per step" in text and "ep8 within dp_shard" in text
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--ep", "3", "--micro-batch-size", "1",
                 "--global-batch-size", "64"]) != 0
    assert "parallel.ep = 3 must divide parallel.dp_shard = 16" in capsys.readouterr().err


def test_mtp_parameters_are_counted_apart(capsys):
    over = {"model.preset": "deepseek-v3-tiny", "model.vocab_size": 32000}
    without = P.param_counts(load_config(None, over).model)
    cfg = load_config(None, {**over, "model.mtp_num_layers": 2}).model
    pc = P.param_counts(cfg)
    model = build_model(cfg, device="meta")
    assert (pc.total, pc.active) == (without.total, without.active)  # the main model, as published figures count it
    assert pc.total + pc.mtp == count_params(model)
    experts = sum(m.block.moe.experts.w1.numel() * 3 for m in model.mtp)
    assert pc.mtp_active == pc.mtp - round(experts * (1 - cfg.moe_router_topk / cfg.num_experts))
    assert main(["plan", "--model", "deepseek-v3-tiny", "--set", "model.vocab_size=32000", "--set", "model.mtp_num_layers=2",
                 "--gpus", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["params"]
    assert out["total_with_mtp"] == count_params(model) and out["mtp"] == pc.mtp
    # pp2 x tp2: the last stage holds the MTP modules (blocks split by TP) and a replica of the embedding table
    full = load_config(None, {**over, "model.mtp_num_layers": 2, "parallel.pp": 2, "parallel.tp": 2})
    stages = P.rank_memory(full, ParallelDims.from_config(full.parallel, 4, full.train, full.model, 64), 64)
    plain = load_config(None, {**over, "parallel.pp": 2, "parallel.tp": 2})
    base = P.rank_memory(plain, ParallelDims.from_config(plain.parallel, 4, plain.train, plain.model, 64), 64)
    assert stages[0].params == base[0].params
    assert stages[1].params - base[1].params == (pc.mtp - pc.mtp_tp) + pc.mtp_tp // 2 + pc.embedding_tp // 2


_HYBRID_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2,
                    mamba_num_heads=8, mamba_head_dim=16, mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=8)
_HYBRIDS = {
    # Nemotron-H's kinds: Mamba-2 (norm of y * silu(z)), attention without positions, squared-ReLU MLP
    "nemotron": dict(_HYBRID_TINY, arch="nemotron_h", hybrid_override_pattern="M*-M", num_layers=4,
                     activation="relu2", position_embedding="none"),
    # Falcon-H1's parallel layer: norm before the gate, dt limits, muP input multipliers (each mixer its own copy)
    "falcon": dict(_HYBRID_TINY, arch="falcon_h1", num_layers=2, mamba_norm_before_gate=True, mamba_dt_limit_min=1e-3,
                   mamba_in_multiplier=0.5, attention_in_multiplier=2.0, mamba_proj_multipliers=[1, 2, 1, 1, 0.5]),
    "falcon, no gated norm": dict(_HYBRID_TINY, arch="falcon_h1", num_layers=2, mamba_gated_norm=False),
    # an MoE-only layer beside Mamba, LayerNorm
    "moe": dict(_HYBRID_TINY, hybrid_override_pattern="ME", num_layers=2, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=64, norm_type="layernorm"),
}


@pytest.mark.parametrize("name", list(_HYBRIDS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hybrid_block_activations_equal_what_autograd_saves(name, precision):
    """Each hybrid block kind's formula against the bytes its forward saves per token (saved-tensor hooks, batch 2
    minus batch 1, so weights and their casts drop out), exactly; RoPE's cos/sin tables, which the model computes
    once for all its layers, are the only other saved tensors."""
    from megapipe.models.spec import spec_for
    from megapipe.training.precision import autocast

    tool = _tool()
    cfg = tool.build_cfg(precision, "none", 2, 2, _HYBRIDS[name], seq=32)
    m = cfg.model
    model = build_model(m, seed=0)
    def rope(batch):
        return model._rope(torch.arange(32).expand(batch, 32), torch.zeros(1))

    seen = set()
    for block in model.layers.values():
        kind = spec_for(block).name
        if kind in seen:
            continue
        seen.add(kind)
        measured = tool.block_saved_bytes_per_token(block, m.hidden_size, 32, lambda: autocast(precision, "cpu"), rope)
        rope_tables = 2 * 4 * m.dim_per_head if m.position_embedding == "rope" and hasattr(block, "attention") else 0
        # the MoE router's k routing weights count 8k (a normalised top-k); this one's softmax over the top-k keeps 4k
        slack = 4 * m.moe_router_topk if kind == "moe_mlp" else 0
        predicted = P.block_activation_bytes(m, kind, precision, "none") + rope_tables
        assert predicted - slack == measured, (kind, measured, predicted)
    assert len(seen) == len(set(m.layer_kinds))


@pytest.mark.parametrize("name", ["nemotron", "falcon"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hybrid_selective_recompute_keeps_the_matmul_outputs(name, precision):
    """Selective recompute's formula per kind against what its policy keeps: the block input and the outputs of the
    matmuls and attention kernels the forward runs (recorded with a dispatch mode), exactly."""
    from megapipe.models.spec import spec_for
    from megapipe.training.precision import autocast

    tool = _tool()
    m = tool.build_cfg(precision, "selective", 2, 2, _HYBRIDS[name], seq=32).model
    model = build_model(m, seed=0)
    for kind, block in {spec_for(b).name: b for b in model.layers.values()}.items():
        kept = tool.selective_kept_bytes_per_token(block, m.hidden_size, 32, lambda: autocast(precision, "cpu"),
                                                   lambda batch: model._rope(torch.arange(32).expand(batch, 32),
                                                                             torch.zeros(1)))
        assert kept == P.block_activation_bytes(m, kind, precision, "selective"), kind


@pytest.mark.parametrize("name", ["nemotron", "falcon"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hybrid_model_saved_activations_equal_the_plan(name, precision):
    """The whole model: blocks + head + the compute copies autograd keeps (fp32: each Mamba mixer's concatenated
    in-projection weights; bf16: the weights' casts), within 1%: the convs' concatenated weights, A and the masks
    (per layer, large next to 32 tokens of a 64-wide model) and RoPE's tables are not modelled (-0.6% at most here)."""
    from megapipe.training.precision import autocast

    tool = _tool()
    cfg = tool.build_cfg(precision, "none", 2, 2, _HYBRIDS[name], seq=32)
    model = build_model(cfg.model, seed=0)
    measured = tool._saved_bytes(model, (torch.randint(0, 512, (2, 32)),), lambda: autocast(precision, "cpu"))
    assert tool.predict(cfg)["saved_activations"] == pytest.approx(measured, rel=1e-2)


def test_hybrid_kinds_tp_split_and_recompute():
    """Hand-computed per-token bytes of a Mamba layer (h 64, 8 heads x 16, 2 groups x 16 state, chunk 8), split by
    tp = 2 (heads and groups; five input casts where the projections run one by one); selective keeps the matmul
    outputs; full only the layer input."""
    m = load_config(None, {f"model.{k}": v for k, v in _HYBRIDS["nemotron"].items()}).model
    H, P_, N, Q, G, h = 4, 16, 16, 8, 1, 64  # per TP rank
    inner, gn, proj = H * P_, G * N, 2 * 64 + 2 * 16 + 4
    scan = 4 * H * P_ + 4 * H + 8 * gn + 4 * H * P_ * N / Q
    mixer = 10 * h + 2 * proj + 2 * (inner + 2 * gn) + 4 * inner + 8 * H + scan + 20 * inner + 4 * G
    assert P.block_activation_bytes(m, "mamba", "bf16", "none", tp=2) == (8 * h + 4) / 2 + mixer
    assert P.block_activation_bytes(m, "mamba", "bf16", "selective", tp=2) == \
        4 * h / 2 + 2 * proj + 4 * (H * Q + G * Q + 2 * H * P_ + H * P_ * N / Q) + 2 * h
    for kind in ("mamba", "attention", "mlp"):
        assert P.block_activation_bytes(m, kind, "bf16", "full", tp=2) == 4 * h / 2
    # a dense block is its attention-only and MLP-only halves, one layer input between them
    assert P.layer_activation_bytes(m, "fp32", "none") == P.block_activation_bytes(m, "attention", "fp32", "none") \
        + P.block_activation_bytes(m, "mlp", "fp32", "none")


def test_vision_flops_per_image_are_the_counted_flops():
    """plan's vision FLOPs per 448 x 448 image against torch's FlopCounterMode on the qwen2.5-vl-tiny tower's forward
    (the planner counts 6 per multiply-add for forward + backward, the counter 2 for the forward): our tower's
    matmuls (patch embedding, blocks, merger; the counter does not see CPU attention kernels) are transformers' own,
    and transformers' tower with eager attention, which attends within each window, counts the attention too."""
    pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from megapipe.config import from_dict

    m = from_dict(ModelConfig, {"preset": "qwen2.5-vl-tiny", "vocab_size": 64})
    grid = torch.tensor([[1, 448 // m.vision_patch_size, 448 // m.vision_patch_size]])
    pixels = torch.randn(int(grid.prod()), 3 * 2 * m.vision_patch_size ** 2)
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(
        depth=m.vision_depth, hidden_size=m.vision_hidden_size, intermediate_size=m.vision_intermediate_size,
        num_heads=m.vision_num_heads, out_hidden_size=m.hidden_size, patch_size=m.vision_patch_size,
        window_size=m.vision_window_size, fullatt_block_indexes=m.vision_fullatt_block_indexes),
        attn_implementation="eager")
    counted = {}
    for name, tower in (("ours", build_model(m, seed=0).visual), ("hf", hf)):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            tower(pixels, grid) if name == "ours" else tower(pixels, grid_thw=grid)
        counted[name] = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = counted["hf"].pop("aten.bmm")  # scores and values, window by window
    assert counted["ours"] == counted["hf"]  # aten.convolution, aten.addmm
    forward = sum(counted["hf"].values()) + attention
    assert P.vision_flops_per_image(m) / 3 == pytest.approx(forward, rel=0.01)
