"""Multi-token prediction (MTP), as DeepSeek-V3 and Megatron-Core define it (``--mtp-num-layers N``).

N sequential modules; depth k (1..N) at position t predicts token t + k + 1. Its input at t is the previous depth's
hidden state at t (depth 1: the main model's final normed hidden state; depth k > 1: depth k - 1's block output
before its own final norm) and the embedding of token t + k (the main model's embedding table), each RMS-normed
(``hnorm``, ``enorm``), concatenated [embedding; hidden], projected 2H -> H (``eh_proj``), then one transformer
block of the kind the model's last layer has (built from its block spec: dense, MoE, ...), a final norm (``norm``)
and the model's output head (shared, never copied).

DeepSeek-V4 (model.hc_mult: hyper-connection streams [B, S, n, H] instead of one residual): the hidden input is the
previous block's streams (depth 1: the main model's last layer's, before its ``hc_head``), each stream RMS-normed;
the two halves of the projection are separate H -> H maps, ``e_proj`` of the normed embedding added to every
stream's ``h_proj`` (what a 2H -> H map of [embedding; stream] is); the block is DeepSeek-V4's (its attention
sliding-window only, its MoE not hash-routed, as the published configs have it), its streams collapsed by the
module's own ``hc_head`` (megapipe.models.hyper_connections.HyperHead) before ``norm``.

Positions: the block's rotary positions are the main stream's (index t keeps position t at every depth, as Megatron
passes the decoder's rotary embedding to its MTP layers), and the main model's document mask applies unchanged:
a token whose (t + k)-th successor lies in another document or beyond the row gets no label
(megapipe.models.objective.mtp_targets), so no labelled index sees across a document either.

Checkpoint names: DeepSeek-V3 publishes module k as decoder layer ``num_hidden_layers + k - 1``, DeepSeek-V4 as
``mtp.{k - 1}``; ``hf_mtp_names`` is the table from megapipe names to those.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import DocumentMask
from megapipe.models.blocks import block_spec
from megapipe.models.hyper_connections import HyperHead, hyper_tp_style
from megapipe.models.norms import build_norm
from megapipe.models.spec import replicated_style


class MTPModule(nn.Module):
    """One MTP depth. ``layer_id`` (num_layers + depth - 1) is its block's index for a KV cache and MoE statistics."""

    def __init__(self, cfg: ModelConfig, depth: int):
        super().__init__()
        self.depth = depth
        self.layer_id = cfg.num_layers + depth - 1
        h = cfg.hidden_size
        self.enorm = build_norm(cfg.norm_type, h, cfg.norm_eps)
        self.hnorm = build_norm(cfg.norm_type, h, cfg.norm_eps)
        self.eh_proj = self.e_proj = self.h_proj = self.hc_head = None
        if cfg.hc_mult:  # DeepSeek-V4
            self.e_proj, self.h_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
            self.hc_head = HyperHead(cfg)
        else:
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block_spec(cfg, cfg.num_layers - 1).module(cfg, self.layer_id)
        self.norm = build_norm(cfg.norm_type, h, cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: Optional[tuple], cache=None,
                mask: Optional[DocumentMask] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous depth's [B, S, H] (hyper-connections: streams [B, S, n, H]); embedded: the
        embeddings of the tokens k ahead [B, S, H] -> (this depth's block output before ``norm``, shaped as
        ``hidden``: the next depth's ``hidden``; after ``norm`` [B, S, H]: for the output head). The norm runs here,
        inside the module's forward, where FSDP holds its whole weight."""
        if self.eh_proj is not None:
            x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        else:
            x = self.e_proj(self.enorm(embedded)).unsqueeze(-2) + self.h_proj(self.hnorm(hidden))
        h = self.block(x, rope, cache, mask)
        return h, self.norm(h if self.hc_head is None else self.hc_head(h))


def shift_left(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x [B, S, ...] -> x[:, k:] followed by k entries of ``fill`` (the value k positions ahead of each index)."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


def tokens_ahead(tokens: torch.Tensor, depths: int) -> torch.Tensor:
    """tokens [B, S] -> [B, S, depths]: at index t, depth k's input token (t + k), 0 beyond the row. Computed on the
    whole sequence before a layout splits it (context-parallel chunks, pipeline stages that get hidden states)."""
    return torch.stack([shift_left(tokens, k, 0) for k in range(1, depths + 1)], dim=-1)


def mtp_tp_plan(module: MTPModule, sp: bool) -> dict:
    """An MTP module's tensor-parallel plan besides its block's (the block kind's own): the norms and the
    projections (``eh_proj``, or ``e_proj`` and ``h_proj``) replicated, a ``hc_head`` per token as the model's. With
    sequence parallelism they run on this rank's sequence shard (their weight gradients summed over the TP ranks)
    and hand the block its input as the layers get theirs (a local sequence shard); without it every rank computes
    them on the whole sequence."""
    from torch.distributed.tensor.parallel import SequenceParallel

    projections = [n for n in ("eh_proj", "e_proj", "h_proj") if getattr(module, n) is not None]
    head = {"hc_head": hyper_tp_style(sp)} if module.hc_head is not None else {}
    if not sp:
        return {**{name: replicated_style() for name in ("enorm", "hnorm", *projections, "norm")}, **head}
    return {"enorm": SequenceParallel(), "hnorm": SequenceParallel(), "norm": SequenceParallel(), **head,
            **{name: SequenceParallel(use_local_output=True) for name in projections}}


def hf_mtp_names(num_hidden_layers: int, depth: int, block_names: dict[str, str],
                 hyper_connections: bool = False) -> dict[str, str]:
    """megapipe's names of MTP module ``depth`` (under ``mtp.{depth - 1}.``) -> DeepSeek's checkpoint names.

    ``block_names``: the block kind's own HF names (its BlockSpec.hf_names[family], submodule -> HF submodule in a
    decoder layer). DeepSeek-V3 stores module k as ``model.layers.{num_hidden_layers + k - 1}`` with copies of the
    embedding table (``embed_tokens``) and of the output head (``shared_head.head``); megapipe shares both with the
    main model, so a bridge reads them from the main model's tensors on export and checks or drops the copies on
    import (the two entries "tok_embeddings" / "output", from the main model). DeepSeek-V4 (``hyper_connections``)
    stores it as ``mtp.{k - 1}`` beside the layers, the block's tensors under their layer names, no copies. Keys are
    module names (append ``.weight`` / ``.bias``) or whole tensors' names (V4's ``hc_head``).
    """
    ours = f"mtp.{depth - 1}"
    if hyper_connections:
        layer = ours
        names = {f"{ours}.{m}": f"{layer}.{m}" for m in ("enorm", "hnorm", "e_proj", "h_proj", "norm")}
        names.update({f"{ours}.hc_head.{p}": f"{layer}.hc_head_{p}" for p in ("fn", "base", "scale")})
    else:
        layer = f"model.layers.{num_hidden_layers + depth - 1}"
        names = {
            f"{ours}.enorm": f"{layer}.enorm",
            f"{ours}.hnorm": f"{layer}.hnorm",
            f"{ours}.eh_proj": f"{layer}.eh_proj",
            f"{ours}.norm": f"{layer}.shared_head.norm",
            "tok_embeddings": f"{layer}.embed_tokens",  # a copy of the main model's
            "output": f"{layer}.shared_head.head",  # a copy of the main model's
        }
    names.update({f"{ours}.block.{k}": f"{layer}.{v}" for k, v in block_names.items()})
    return names


def is_mtp_key(key: str) -> bool:
    """Whether a model or optimizer state-dict key belongs to the MTP modules (``mtp.*``, ``state.mtp.*``...)."""
    return key.startswith("mtp.") or ".mtp." in key
