"""Which block kind each layer is: the choice among the kinds that register a spec (megapipe.models.spec)."""

from __future__ import annotations

from megapipe.models.dense import DENSE
from megapipe.models.dsa import DSA, DSA_MOE
from megapipe.models.hybrid import HYBRID_BLOCKS
from megapipe.models.mla import MLA, MLA_MOE
from megapipe.models.moe import MOE
from megapipe.models.parallel_hybrid import PARALLEL_HYBRID
from megapipe.models.spec import BlockSpec


def block_spec(cfg, layer_id: int) -> BlockSpec:
    """The block kind of layer ``layer_id`` under ``cfg``: MoE on the layers ``cfg.moe_layers`` lists (every N-th
    or a pattern, after the first K dense ones), dense elsewhere; with multi-latent attention their MLA twins, with
    DeepSeek Sparse Attention their DSA ones. A
    hybrid model's layers are single mixers, by their symbol in ``cfg.layer_kinds`` (megapipe.models.hybrid), or
    Falcon-H1's parallel Mamba + attention layers (P, megapipe.models.parallel_hybrid)."""
    kinds = cfg.layer_kinds
    if kinds is not None:
        return PARALLEL_HYBRID if kinds[layer_id] == "P" else HYBRID_BLOCKS[kinds[layer_id]]
    moe = layer_id in cfg.moe_layers
    if cfg.sparse_attention:
        return DSA_MOE if moe else DSA
    if cfg.multi_latent_attention:
        return MLA_MOE if moe else MLA
    return MOE if moe else DENSE
