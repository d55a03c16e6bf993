"""Parallel layouts of hybrid Transformer-Mamba models without processes: the pipeline split by layer cost, the TP
rules (Mamba heads and groups divisible by tp), the Mamba plan's parameter split, and context parallelism refused
by the capability table. The layouts themselves run in tests/parallel/test_dist_layouts.py (model=hybrid)."""

from __future__ import annotations

import itertools

import pytest

from megapipe.config import ModelConfig, ParallelConfig
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model
from megapipe.models.capabilities import family_row, requested_layouts, require
from megapipe.models.spec import tp_split_numel
from megapipe.models.transformer import layer_flops_per_token
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.pp import layer_split
from megapipe.presets import PRESETS
from tests.dist.parallel_cases import MODELS


def stage_costs(costs: list[int], counts: list[int]) -> list[int]:
    starts = list(itertools.accumulate([0, *counts]))
    return [sum(costs[a:b]) for a, b in itertools.pairwise(starts)]


def test_nemotron_h_8b_stages_balance_flops_not_layer_counts():
    """Nemotron-H-8B's 52 layers (24 Mamba, 4 attention, 24 MLP) at 8k tokens: an MLP layer costs 1.53x a Mamba
    layer, attention 0.95x. Eight stages by cost: every stage ends on an MLP layer, the costliest one 0.58% cheaper
    than the even count split's (its stage 3 holds four Mamba and three MLP layers, "M-M-M-M")."""
    cfg = ModelConfig(**PRESETS["nemotron-h-8b"])
    costs = layer_flops_per_token(cfg, 8192)
    per_kind = dict(zip(cfg.layer_kinds, costs, strict=True))
    assert per_kind == {"M": 688_914_432, "-": 1_056_964_608, "*": 654_311_424}
    split = layer_split(52, 8, costs=costs)
    assert split == [6, 7, 7, 6, 7, 6, 7, 6]
    even = layer_split(52, 8)
    assert even == [6, 7, 7, 7, 7, 6, 6, 6]
    assert max(stage_costs(costs, even)) / max(stage_costs(costs, split)) == pytest.approx(1.0058729, abs=1e-7)


def test_cost_split_is_the_best_contiguous_split():
    """Against every contiguous split of an irregular pattern: no split has a cheaper costliest stage, and of those
    that tie, none leaves less to the first and last stages."""
    pattern = "M-M*-MEE-M*MM-"
    cfg = ModelConfig(**{**MODELS["hybrid"], "num_layers": len(pattern), "hybrid_override_pattern": pattern})
    costs = layer_flops_per_token(cfg, 16)
    n = len(costs)
    for stages in (2, 3, 4):
        got = stage_costs(costs, layer_split(n, stages, costs=costs))
        options = []
        for cuts in itertools.combinations(range(1, n), stages - 1):
            c = stage_costs(costs, [b - a for a, b in itertools.pairwise((0, *cuts, n))])
            options.append((max(c), c[0] + c[-1]))
        assert (max(got), got[0] + got[-1]) == min(options)


def test_layers_of_one_cost_keep_the_count_rule():
    cfg = ModelConfig(**MODELS["base"])
    assert layer_split(4, 3, costs=layer_flops_per_token(cfg, 16)) == [1, 2, 1]
    assert layer_split(10, 4, costs=[5] * 10) == [2, 3, 3, 2]


def dims(tp: int, **model) -> ParallelDims:
    pcfg = ParallelConfig(tp=tp, dp_shard=1)
    return ParallelDims.from_config(pcfg, tp, model_cfg=ModelConfig(**{**MODELS["hybrid"], **model}))


def test_tp_needs_mamba_heads_and_groups_divisible():
    dims(2)
    with pytest.raises(ConfigError, match=r"^model.mamba_num_heads = 6 is not divisible by parallel.tp = 4 "):
        dims(4, mamba_num_heads=6, mamba_num_groups=1, num_heads=4, num_kv_heads=4)
    with pytest.raises(ConfigError, match=r"^model.mamba_num_groups = 2 is not divisible by parallel.tp = 4 "):
        dims(4, num_kv_heads=4)
    # a hybrid without MLP layers does not ask its (unused) intermediate size to split
    dims(2, intermediate_size=63, hybrid_override_pattern="M*MME")


def test_mamba_plan_splits_everything_but_the_block_norm():
    cfg = ModelConfig(**PRESETS["nemotron-h-tiny"], vocab_size=128)
    mamba = build_model(cfg, device="meta").layers["0"]
    split, rest = tp_split_numel(mamba)
    assert rest == cfg.hidden_size and split + rest == sum(p.numel() for p in mamba.parameters())


def test_context_parallelism_is_refused_for_mamba_layers():
    cfg = ModelConfig(**MODELS["hybrid"])
    with pytest.raises(MegapipeError, match=r"^pretrain of .*Mamba.* models does not support layouts cp "):
        require(cfg, "pretrain", layouts=requested_layouts(ParallelConfig(cp=2)))
    require(cfg, "pretrain", layouts=requested_layouts(ParallelConfig(tp=2, pp=2)))
    assert "cp" not in family_row("nemotron_h").layouts  # the support table's row, as the bridge imports it
