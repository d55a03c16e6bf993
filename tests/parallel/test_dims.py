"""Layout validation (one clear ConfigError per impossible layout), layout strings, stage placement, zig-zag
chunks, launcher detection: all single-process and fast."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig, ParallelConfig, TrainConfig
from megapipe.errors import ConfigError
from megapipe.parallel.cp import shard_sequence, unshard_sequence, zigzag_indices
from megapipe.parallel.dims import ParallelDims, parse_layout
from megapipe.parallel.distributed import detect_env, first_slurm_host
from megapipe.parallel.pp import layer_split, stage_ids

MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=256)
TRAIN = TrainConfig(micro_batch_size=1, global_batch_size=8)


def dims(world, model=MODEL, train=TRAIN, seq=32, **kw):
    return ParallelDims.from_config(ParallelConfig(**kw), world, train, model, seq)


def test_dp_shard_fills_the_rest_and_sizes():
    d = dims(16, tp=2, pp=2)
    assert (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp) == (1, 4, 1, 2, 2)
    assert d.dp_size == 4 and d.fsdp_enabled and d.describe() == "dp_shard4,tp2,pp2"
    assert d.num_microbatches(TRAIN) == 2
    assert dims(1).trivial and dims(1).describe() == "single" and dims(1).build_mesh() is None
    ddp = dims(4, dp_mode="ddp")
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.fsdp_enabled) == (4, 1, False)


@pytest.mark.parametrize(
    "world, kw, model, seq, message",
    [
        (6, dict(tp=4), MODEL, 32, "world size 6 is not divisible by tp*pp*cp*dp_replicate"),
        (8, dict(tp=2, dp_shard=2), MODEL, 32, "does not match the world size 8"),
        (4, dict(tp=4), MODEL, 32, "model.num_kv_heads = 2 is not divisible by parallel.tp = 4"),
        (2, dict(tp=2), ModelConfig(**{**MODEL.__dict__, "vocab_size": 255}), 32, "model.vocab_size = 255"),
        (2, dict(cp=2), MODEL, 30, "data.seq_length = 30 is not divisible by 2*parallel.cp = 4"),
        (4, dict(tp=4), ModelConfig(**{**MODEL.__dict__, "num_kv_heads": 4}), 30, "data.seq_length / parallel.cp = 30"),
        (2, dict(pp=2, pp_layer_split=[1, 2]), MODEL, 32, "sums to 3, not model.num_layers = 4"),
        (2, dict(pp=2, pp_layer_split=[4]), MODEL, 32, "has 1 entries but there are pp*pp_virtual_stages = 2"),
        (4, dict(pp=4, pp_virtual_stages=2, pp_schedule="Interleaved1F1B"), MODEL, 32, "smaller than"),
        (2, dict(pp=2, pp_schedule="ZBVZeroBubble"), MODEL, 32, "runs 2 stage(s) per rank"),
        (2, dict(pp=2, pp_schedule="Interleaved1F1B"), MODEL, 32, "needs parallel.pp_virtual_stages >= 2"),
        (1, dict(pp_virtual_stages=2), MODEL, 32, "needs parallel.pp > 1"),
        (2, dict(tp=2, dp_mode="ddp"), MODEL, 32, "combines with data and context parallelism only"),
        (4, dict(pp=2, pp_schedule="ZBVZeroBubble", pp_virtual_stages=2), MODEL, 32, "loses the last stage"),
        (2, dict(pp=2, pp_schedule="DualPipeV", pp_virtual_stages=2), ModelConfig(**{**MODEL.__dict__,
         "mtp_num_layers": 1}), 32, "model.mtp_num_layers = 1 is not supported with parallel.pp_schedule = 'DualPipeV'"),
    ],
)
def test_impossible_layouts_are_refused_with_the_reason(world, kw, model, seq, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        dims(world, model=model, seq=seq, **kw)


def test_deepseek_v4_layouts():
    """Its heads and output groups split over TP (its one KV head stays whole); its hash-routed layers, which route
    by token ids, on the first pipeline stage."""
    from tests.dist.parallel_cases import MODELS

    v4 = ModelConfig(**MODELS["dsv4"])  # 4 heads in 2 output groups, layer 0 hash-routed
    assert dims(2, model=v4, seq=16, tp=2).tp == 2 and dims(2, model=v4, seq=16, pp=2).pp == 2
    with pytest.raises(ConfigError, match=r"model.o_groups = 2 is not divisible by parallel.tp = 4"):
        dims(4, model=v4, seq=16, tp=4)
    with pytest.raises(ConfigError, match=r"model.moe_hash_layers = 1: the hash-routed layers \(up to layer 0\) must "
                                          r"all sit on the first pipeline stage, which holds 0 layer\(s\)"):
        dims(2, model=v4, seq=16, pp=2, pp_layer_split=[0, 4])


def test_batch_and_microbatch_rules():
    with pytest.raises(ConfigError, match="global_batch_size = 8 is not divisible by train.micro_batch_size"):
        dims(16, train=TrainConfig(micro_batch_size=1, global_batch_size=8))
    with pytest.raises(ConfigError, match="needs at least 2 micro-batches"):
        dims(2, pp=2, train=TrainConfig(micro_batch_size=4, global_batch_size=4))
    with pytest.raises(ConfigError, match="compile"):
        dims(2, pp=2, pp_schedule="DualPipeV", pp_virtual_stages=2,
             train=TrainConfig(micro_batch_size=1, global_batch_size=8, compile=True))


def test_parse_layout():
    assert parse_layout("tp2,pp2") == {"tp": 2, "pp": 2}
    assert parse_layout("dp2xcp2") == {"dp_shard": 2, "cp": 2}
    assert parse_layout("dp_replicate2,dp_shard4") == {"dp_replicate": 2, "dp_shard": 4}
    assert parse_layout("single") == {}
    with pytest.raises(ConfigError, match="layout part 'xp2'"):
        parse_layout("tp2,xp2")


def test_layer_split_and_stage_placement():
    assert layer_split(8, 4) == [2, 2, 2, 2]
    assert layer_split(10, 4) == [2, 3, 3, 2]  # extra layers go to the middle stages first
    assert layer_split(7, 2, [3, 4]) == [3, 4]
    assert stage_ids(0, 2, 1, "1F1B") == [0]
    assert stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert stage_ids(1, 4, 2, "ZBVZeroBubble") == [1, 6] and stage_ids(0, 2, 2, "DualPipeV") == [0, 3]


def test_zigzag_chunks_balance_causal_work_and_round_trip():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(2, 12)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    assert torch.equal(unshard_sequence(parts), x)
    work = [sum(int(i) + 1 for i in zigzag_indices(12, 3, r)) for r in range(3)]
    assert len(set(work)) == 1  # every rank attends to the same number of (query, key) pairs


def test_launcher_detection():
    assert detect_env({}).world_size == 1
    t = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (t.rank, t.world_size, t.local_rank, t.launcher) == (3, 8, 1, "torchrun")
    s = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"})
    assert (s.rank, s.world_size, s.local_rank, s.launcher) == (5, 16, 1, "slurm")
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"  # sbatch shell, not srun
    assert first_slurm_host("node[003-005,007],gpu1") == "node003"
    assert first_slurm_host("gpu17") == "gpu17"


MOE = ModelConfig(**{**MODEL.__dict__, "num_experts": 8, "moe_router_topk": 2})


def test_expert_parallel_layouts():
    d = dims(16, model=MOE, tp=2, ep=4)
    assert (d.dp_shard, d.ep, d.world_size) == (8, 4, 16) and d.describe() == "dp_shard8,tp2,ep4"
    assert parse_layout("ep2,tp2") == {"ep": 2, "tp": 2}
    from megapipe.parallel.dims import apply_layout, layout_world_size

    assert layout_world_size({"ep": 2, "tp": 2}) == 4 and layout_world_size({"ep": 2, "dp_shard": 4}) == 4
    pc = apply_layout(ParallelConfig(), {"ep": 2, "pp": 2})
    assert (pc.dp_shard, pc.ep, pc.pp) == (2, 2, 2)


@pytest.mark.parametrize("world, kw, model, message", [
    (4, dict(ep=2), MODEL, "parallel.ep = 2 needs an MoE model"),
    (4, dict(ep=3), MOE, "parallel.ep = 3 must divide parallel.dp_shard = 4"),
    (4, dict(ep=2, dp_mode="ddp"), MOE, "parallel.ep = 2 needs parallel.dp_mode = 'fsdp'"),
    (4, dict(ep=4), ModelConfig(**{**MOE.__dict__, "num_experts": 6}), "model.num_experts = 6 is not divisible"),
    (4, dict(ep=0), MOE, "parallel.ep = 0 must be >= 1"),
])
def test_impossible_expert_parallel_layouts(world, kw, model, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims(world, model=model, **kw)
