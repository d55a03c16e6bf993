"""The decoder-only transformer: Llama 2/3, Qwen2/3, Mistral and GPT-2 are shapes of it (see ModelConfig).

Plain PyTorch with torchtitan-like names; parallelism is applied from outside (megapipe.parallel). The forward
tolerates pipeline stages: without ``tok_embeddings`` (or given float input) it takes hidden states, and without
``norm`` it returns hidden states. ``return_hidden=True`` makes the last stage return the final normed hidden
states instead of logits, for a loss that applies the output projection itself (``output_weight()``).
``mtp`` (the optional multi-token prediction modules, megapipe.models.mtp) runs only when a forward asks for it
(``mtp=True``, what a training loss does); generation never pays for it and can call ``mtp_step`` to draft.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.models.attention import Attention, DocumentMask, positions_from_documents
from megapipe.models.blocks import block_spec
from megapipe.models.compressed_attention import CompressedAttention, Compressor, v4_positions
from megapipe.models.hyper_connections import HyperConnection, HyperHead, expand_streams
from megapipe.models.mamba import Mamba2Mixer, scale_by
from megapipe.models.moe import MoE
from megapipe.models.mtp import MTPModule, tokens_ahead
from megapipe.models.norms import RMSNorm, build_norm, init_norm
from megapipe.models.rope import model_inv_frequencies, model_rope

# initialised with std / sqrt(2 * num_layers) (the routed experts' w2 too, see MoE.init_weights)
OUTPUT_PROJECTIONS = ("attention.wo", "feed_forward.w2", "shared_experts.w2", "mixer.out_proj", "attention.wo_b")


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ConfigError("model.vocab_size is not set: give it, or build the model after loading the tokenizer")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        learned = cfg.position_embedding == "learned"
        self.pos_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned else None
        self.layers = nn.ModuleDict({str(i): block_spec(cfg, i).module(cfg, i) for i in range(cfg.num_layers)})
        self.norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.hc_head = HyperHead(cfg) if cfg.hc_mult else None  # the hyper-connection streams -> one, before norm
        # a reward model's scores (num_labels) come from an output projection of their own
        outputs = cfg.num_labels or cfg.vocab_size
        tied = cfg.tie_embeddings and not cfg.num_labels
        self.output = None if tied else nn.Linear(cfg.hidden_size, outputs, bias=False)
        depths = range(1, cfg.mtp_depth + 1)
        self.mtp = nn.ModuleList([MTPModule(cfg, k) for k in depths]) if cfg.mtp_depth else None
        if cfg.position_embedding == "rope":
            model_inv_frequencies(cfg)  # a bad rope_scaling fails here

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, cache=None,
                last_only: bool = False, return_hidden: bool = False,
                document_ids: Optional[torch.Tensor] = None, head: Optional[Callable] = None,
                prefix_ids: Optional[torch.Tensor] = None, mtp: bool = False,
                mtp_tokens: Optional[torch.Tensor] = None, mtp_input: bool = False):
        """tokens [B, S] ids (or [B, S, H] hidden states on a later pipeline stage); positions [S] or [B, S].

        ``document_ids`` [B, S]: packed sequences; attention stays within each document (block-diagonal causal) and
        positions, when not given, restart at every document. ``prefix_ids`` [B, S]: the document whose earlier
        tokens each token also sees (a shared prompt; DocumentMask), with explicit ``positions``.

        ``last_only``: logits of the last position only ([B, 1, V]), what a generation step needs.
        ``return_hidden``: the final normed hidden states [B, S, H] (times ``cfg.lm_head_multiplier``, so that the
        output projection of them gives the logits) instead of the logits (also what MTP depth 1 and
        ``mtp_step`` take: the main model's output as the head sees it, as vLLM feeds DeepSeek's MTP weights).
        ``head``: ``head(hidden, output_weight)`` is what the forward returns, computed inside it (a loss that applies
        the output projection itself, e.g. the fused output + cross-entropy: whatever wraps this module, FSDP, holds
        the whole output weight during its forward only).
        ``mtp``: also run the MTP modules; their outputs, one per depth, come as a second value (logits, or final
        normed hidden states with ``return_hidden``) or as ``head``'s third argument. ``mtp_tokens`` [B, S, N]: the
        tokens each depth embeds (``tokens_ahead``), where the forward cannot shift ``tokens`` itself (a pipeline
        stage that gets hidden states, a context-parallel chunk of the sequence). ``mtp_input`` (with
        ``return_hidden``, without ``mtp``): also what MTP depth 1 takes at every position, as a second value (the
        final normed hidden states; DeepSeek-V4: the last layer's streams), for drafting with ``mtp_step``.
        """
        if positions is None and document_ids is not None:
            positions = positions_from_documents(document_ids)
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        mask = None
        if document_ids is not None:
            if cache is not None:
                raise ValueError("document_ids (packed sequences) and a KV cache cannot be combined")
            mask = DocumentMask(document_ids, positions, None, prefix_ids)  # each layer applies its own window
        elif prefix_ids is not None:
            raise ValueError("prefix_ids name documents: give document_ids with them")
        if cache is not None:
            cache.advance(positions)
        if self.tok_embeddings is None or tokens.is_floating_point():
            h = tokens
        else:
            h = scale_by(self.tok_embeddings(tokens), self.cfg.embedding_multiplier)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(positions)
            if self.cfg.hc_mult:
                h = expand_streams(h, self.cfg.hc_mult)
        rope = self._rope(positions, h, None if tokens.is_floating_point() else tokens)
        for layer in self.layers.values():
            h = layer(h, rope, cache, mask)
        if self.norm is None:
            return h
        streams = h  # DeepSeek-V4's MTP depth 1 takes the last layer's hyper-connection streams
        if self.hc_head is not None:
            h = self.hc_head(h)
        # Falcon-H1's logit multiplier on the normed states: the output projection, wherever it is applied, is linear
        h = scale_by(self.norm(h[:, -1:] if last_only and not mtp else h), self.cfg.lm_head_multiplier)
        depth1 = streams if self.hc_head is not None else h
        extra = (self._mtp_states(tokens, depth1, rope, mask, mtp_tokens),) if mtp else ()
        if head is not None:
            return head(h, self.output_weight(), *extra)
        if not return_hidden:
            h, extra = self.logits(h), tuple([self.logits(s) for s in states] for states in extra)
        elif mtp_input:
            return h, depth1
        return (h, *extra) if mtp else h

    def _rope(self, positions: torch.Tensor, h: torch.Tensor, tokens: Optional[torch.Tensor] = None):
        """What every layer takes as its positions: (cos, sin), None, or DeepSeek-V4's ``V4Positions`` (both its
        ropes, the positions, the ``tokens`` its hash-routed layers route by)."""
        if self.cfg.position_embedding != "rope":
            return None
        if self.cfg.attention_layer_types is not None:
            return v4_positions(self.cfg, positions, h.dtype, h.device, tokens)
        return model_rope(self.cfg, positions, h.dtype, h.device)

    def _mtp_states(self, tokens: torch.Tensor, h: torch.Tensor, rope, mask,
                    ahead: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Each MTP depth's final normed hidden states [B, S, H] (index t predicts token t + depth + 1) from the
        token ids and the main model's final normed hidden states ``h`` (DeepSeek-V4: its last layer's streams);
        depth k > 1 takes depth k - 1's output before its norm."""
        if self.mtp is None:
            raise ValueError("mtp=True needs a model with multi-token prediction modules (model.mtp_num_layers)")
        if ahead is None:
            if tokens.is_floating_point():
                raise ValueError("multi-token prediction on hidden states needs mtp_tokens (it embeds the tokens ahead)")
            ahead = tokens_ahead(tokens, len(self.mtp))
        states = []
        for module in self.mtp:
            h, normed = module(h, self.tok_embeddings(ahead[..., module.depth - 1]), rope, None, mask)
            states.append(normed)
        return states

    def mtp_step(self, depth: int, hidden: torch.Tensor, next_token_ids: torch.Tensor, positions: torch.Tensor,
                 cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP depth on its own, for drafting: ``hidden`` [B, T, H] the previous depth's output at some
        positions (depth 1: ``forward(..., return_hidden=True)``, DeepSeek-V4's streams [B, T, n, H] from
        ``forward(..., return_hidden=True, mtp_input=True)``; depth k: what step k - 1 returned),
        ``next_token_ids`` [B, T] the tokens ``depth`` positions after each, ``positions`` [T] or [B, T] the
        positions of ``hidden`` (not of the tokens). Returns (logits [B, T, V] of the token depth + 1 ahead, this
        depth's hidden [B, T, H] for depth + 1). ``cache``: a KV cache as the main layers take it, holding layer
        ``num_layers + depth - 1`` (one ``advance`` per call); without it, T must cover every earlier position."""
        module = self.mtp[depth - 1]
        if cache is not None:
            cache.advance(positions)
        h, normed = module(hidden, self.tok_embeddings(next_token_ids), self._rope(positions, hidden), cache)
        return self.logits(normed), h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states [..., H] -> logits [..., V] (a reward model's scores [..., num_labels]; fp32
        unless autocast is on)."""
        if self.output is not None:
            logits = self.output(h)
        elif self.tok_embeddings is not None:
            logits = F.linear(h, self.tok_embeddings.weight)
        else:
            raise RuntimeError("the tied output projection needs tok_embeddings on the last pipeline stage")
        return logits if torch.is_autocast_enabled(logits.device.type) else logits.float()

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight [V, H]: ``output.weight``, or the embedding table when tied."""
        if self.output is not None:
            return self.output.weight
        if self.tok_embeddings is None:
            raise RuntimeError("the tied output projection needs tok_embeddings on the last pipeline stage")
        return self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, init_std); output projections std / sqrt(2 * num_layers); norms 1, biases 0; a Mamba mixer's
    convs, A, D and dt as Mamba2Mixer.init_weights."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, MoE):
                module.init_weights(std, out_std)
            if isinstance(module, Mamba2Mixer):
                module.init_weights()
            if isinstance(module, (Attention, CompressedAttention)) and module.sinks is not None:
                nn.init.zeros_(module.sinks)  # one extra logit 0 per row: a learned "attend to nothing"
            if isinstance(module, (HyperConnection, HyperHead)):
                module.init_weights(std)
            if isinstance(module, Compressor):
                nn.init.zeros_(module.position_bias)
            if isinstance(module, nn.Linear):
                scaled = name.endswith(OUTPUT_PROJECTIONS)
                nn.init.normal_(module.weight, 0.0, out_std if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                init_norm(module)


# models that wrap the decoder, by what asks for them ("vision": model.vision_depth > 0); their modules register
# here (megapipe.models.vision), the package's __init__ imports them
MODEL_CLASSES: dict[str, type] = {}


def build_model(cfg: ModelConfig, device="cpu", seed: Optional[int] = None) -> Transformer:
    """Build on the meta device (no memory), materialise on ``device``, initialise (from ``seed`` if given)."""
    with torch.device("meta"):
        model = (MODEL_CLASSES["vision"] if cfg.vision_depth else Transformer)(cfg)
    device = torch.device(device)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    if seed is None:
        model.init_weights()
    else:
        on_cpu = device.type == "cpu"
        with torch.random.fork_rng(devices=[] if on_cpu else [device], device_type="cuda" if on_cpu else device.type):
            torch.manual_seed(seed)
            model.init_weights()
    return model


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of parameters (tied weights once); ``exclude_embeddings`` drops token and position tables."""
    skip = set()
    if exclude_embeddings:
        for name in ("tok_embeddings", "pos_embeddings"):
            mod = getattr(model, name, None)
            if mod is not None:
                skip.add(id(mod.weight))
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: all linear layers incl. the output head (tied or not); in an
    MoE layer the router, the shared experts and the k experts a token is routed to (the active parameters)."""
    return sum(layer_matmul_params(cfg)) + cfg.hidden_size * (cfg.num_labels or cfg.vocab_size)


def layer_matmul_params(cfg: ModelConfig) -> list[int]:
    """``matmul_params`` of each layer (the output head apart)."""
    hd, h = cfg.dim_per_head, cfg.hidden_size
    attn = h * (cfg.num_heads + 2 * cfg.kv_heads) * hd + cfg.num_heads * hd * h
    if cfg.multi_latent_attention:
        attn = mla_matmul_params(cfg)
    if cfg.attention_layer_types is not None:
        return [compressed_matmul_params(cfg, kind) + moe_matmul_params(cfg) for kind in cfg.attention_layer_types]
    mlp = (3 if cfg.activation == "swiglu" else 2) * h * cfg.intermediate_size
    moe = moe_matmul_params(cfg)
    if cfg.layer_kinds is not None:  # hybrid: one mixer per layer
        per_kind = {"M": mamba_matmul_params(cfg), "*": attn, "-": mlp, "E": moe}
        per_kind["P"] = per_kind["M"] + attn + mlp  # Falcon-H1: Mamba and attention side by side, then the MLP
        return [per_kind[k] for k in cfg.layer_kinds]
    moe_layers = set(cfg.moe_layers)
    return [attn + (moe if i in moe_layers else mlp) for i in range(cfg.num_layers)]


def moe_matmul_params(cfg: ModelConfig) -> int:
    """One MoE layer's active matmul weights: the router, the shared experts, k routed experts (0: a dense model)."""
    if not cfg.is_moe:
        return 0
    h, shared = cfg.hidden_size, cfg.moe_shared_expert_intermediate_size or 0
    moe = h * cfg.num_experts + 3 * h * (cfg.moe_router_topk * cfg.expert_ffn + shared)
    return moe + (h if (shared and cfg.moe_shared_expert_gate) else 0)


def compressed_matmul_params(cfg: ModelConfig, kind: str) -> int:
    """One DeepSeek-V4 attention layer's matmul weights per token: queries, the key = value head, the grouped output
    projection, and a compressed layer's compressor (CSA: two series, and the indexer's compressor, queries and head
    weights)."""
    h, q, n, hd = cfg.hidden_size, cfg.q_lora_rank, cfg.num_heads, cfg.dim_per_head
    total = h * q + q * n * hd + h * hd + n * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h
    if kind == "heavily_compressed_attention":
        total += 2 * h * hd
    elif kind == "compressed_sparse_attention":
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        total += 4 * h * hd + 4 * h * ihd + q * ih * ihd + h * ih
    return total


def compressed_attention_flops(cfg: ModelConfig, kind: str, seq_length: int) -> int:
    """One DeepSeek-V4 layer's score and value matmuls per token, forward + backward, as ``attention_flops_per_token``
    counts them (no causal discount): the window's keys, every HCA entry, or CSA's index_topk entries and the
    indexer's scores of every entry."""
    n, hd, s = cfg.num_heads, cfg.dim_per_head, seq_length
    keys = min(s, cfg.sliding_window)
    if kind == "heavily_compressed_attention":
        keys += s // cfg.hca_compress_rate
    elif kind == "compressed_sparse_attention":
        entries = s // cfg.csa_compress_rate
        keys += min(entries, cfg.index_topk)
        return 6 * n * 2 * hd * keys + 6 * cfg.index_n_heads * cfg.index_head_dim * entries
    return 6 * n * 2 * hd * keys


def layer_flops_per_token(cfg: ModelConfig, seq_length: int) -> list[int]:
    """Training FLOPs per token of each layer, what the pipeline split balances: ``flops_per_token``'s terms of the
    layer (its matmuls; the attention scores and values of a layer with attention) plus a Mamba layer's SSD scan
    (per head and token: the chunk's C.B and its weighting of x, the state's update and read-out; 6 FLOPs a
    multiply-add forward and backward), which MFU does not count."""
    if cfg.attention_layer_types is not None:
        return [6 * w + compressed_attention_flops(cfg, kind, seq_length)
                for w, kind in zip(layer_matmul_params(cfg), cfg.attention_layer_types, strict=True)]
    kinds = cfg.layer_kinds or "*" * cfg.num_layers
    q = min(cfg.mamba_chunk_size, seq_length)
    n, p = cfg.mamba_state_dim, cfg.mamba_head_dim
    scan = 6 * cfg.mamba_heads * (q * (n + p) + 2 * n * p) if set(kinds) & {"M", "P"} else 0
    extra = {"*": attention_flops_per_token(cfg, seq_length), "M": scan}
    extra["P"] = extra["*"] + scan  # Falcon-H1: both mixers in one layer
    return [6 * w + extra.get(k, 0) for w, k in zip(layer_matmul_params(cfg), kinds, strict=True)]


def mamba_matmul_params(cfg: ModelConfig) -> int:
    """One Mamba-2 mixer's projection weights (in: z, x, B, C, dt; out)."""
    h, inner = cfg.hidden_size, cfg.mamba_inner
    return h * (2 * inner + 2 * cfg.mamba_num_groups * cfg.mamba_state_dim + cfg.mamba_heads) + inner * h


def attention_layers(cfg: ModelConfig) -> int:
    """Layers with attention (all of them, but a hybrid model's '*' and 'P' layers only)."""
    kinds = cfg.layer_kinds
    return cfg.num_layers if kinds is None else kinds.count("*") + kinds.count("P")


def mla_matmul_params(cfg: ModelConfig) -> int:
    """One multi-latent attention layer's matmul weights (the decompressed form training runs)."""
    h, n, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    q = (h + n * qk) * cfg.q_lora_rank if cfg.q_lora_rank else h * n * qk
    return q + h * (r + cfg.qk_pos_emb_head_dim) + r * n * (cfg.qk_head_dim + cfg.v_head_dim) + n * cfg.v_head_dim * h


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(q/k dims, v dims) per head of the attention matmuls."""
    if cfg.multi_latent_attention:
        return cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    return cfg.dim_per_head, cfg.dim_per_head


def kv_cache_values_per_token(cfg: ModelConfig, context: Optional[int] = None) -> tuple[float, int]:
    """(values a KV cache stores per token over all layers, the same for the per-head keys and values attention
    reads): equal for multi-head / grouped-query attention; with MLA a latent cache stores kv_lora_rank + rope dims
    per layer (DeepSeek Sparse Attention: and the indexer's key), the decompressed form heads x (qk + v) dims (its
    GQA equivalent). DeepSeek-V4 at ``context`` tokens (default max_position_embeddings): ``compressed_kv_values``
    per token, against its one shared key = value head of every token (head_dim per layer)."""
    if cfg.attention_layer_types is not None:
        context = context or cfg.max_position_embeddings
        return compressed_kv_values(cfg, context) / context, cfg.num_layers * cfg.dim_per_head
    if cfg.multi_latent_attention:
        qk, v = attention_dims(cfg)
        index = cfg.dsa_indexer_head_dim if cfg.sparse_attention else 0
        latent = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim + index
        return cfg.num_layers * latent, cfg.num_layers * cfg.num_heads * (qk + v)
    per_token = attention_layers(cfg) * 2 * cfg.kv_heads * cfg.dim_per_head
    return per_token, per_token


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM / Megatron convention, for MFU.

    6 * N for the weight matmuls (N = ``matmul_params``: embedding lookups excluded, the output head included)
    plus 6 * L * heads * (qk_dim + v_dim) * S for the attention score and value matmuls (2 FLOPs x 3 for forward +
    backward; 12 * L * heads * head_dim * S when q/k and v heads are equally wide, MLA's differ), counted over the
    full S x S square as PaLM does, i.e. causal masking is not discounted. A hybrid model counts its attention
    layers only; the Mamba layers' scan (linear in S) is not counted, their projections are.
    """
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size is not set: flops_per_token needs it")
    if cfg.attention_layer_types is not None:  # DeepSeek-V4: each layer by its kind
        scores = sum(compressed_attention_flops(cfg, k, seq_length) for k in cfg.attention_layer_types)
        return float(6 * matmul_params(cfg) + scores)
    return float(6 * matmul_params(cfg) + attention_layers(cfg) * attention_flops_per_token(cfg, seq_length))


def attention_flops_per_token(cfg: ModelConfig, seq_length: int) -> int:
    """One attention layer's score and value matmuls per token, forward + backward, over the full S x S square."""
    qk, v = attention_dims(cfg)
    return 6 * cfg.num_heads * (qk + v) * seq_length


def compressed_kv_values(cfg: ModelConfig, context: int) -> int:
    """What DeepSeek-V4's compressed cache keeps for one sequence of ``context`` tokens, in values over all layers:
    every layer the last sliding_window tokens' key = value head (head_dim); an HCA layer one entry of head_dim per
    hca_compress_rate tokens; a CSA layer one of head_dim plus the indexer's key (index_head_dim) per
    csa_compress_rate tokens (the compressors' partial blocks, under 2 rates of tokens, left out)."""
    total = 0
    for kind in cfg.attention_layer_types:
        total += min(context, cfg.sliding_window) * cfg.dim_per_head
        if kind == "heavily_compressed_attention":
            total += context // cfg.hca_compress_rate * cfg.dim_per_head
        elif kind == "compressed_sparse_attention":
            total += context // cfg.csa_compress_rate * (cfg.dim_per_head + cfg.index_head_dim)
    return total
