"""KV cache bytes per token of multi-latent attention against grouped-query attention of the same width, one run:

    PYTHONPATH=. .venv/bin/python tools/bench_mla_kv.py [--presets deepseek-v3 kimi-k2] [--engine-preset deepseek-v3-tiny]

For each preset at its published shape, in bf16:

- ``latent``: what megapipe's engine stores, kv_lora_rank + rope dims per layer, counted on the engine's own pool
  (``KVPool`` allocated as the engine allocates it, ``kv_layout``, for 4 blocks of 16 tokens: the bytes of its
  tensors over its tokens, the value tensor aliasing the key one counted once) and checked against ``plan``'s
  ``kv_cache`` (``kv_cache_bytes``);
- ``gqa``: grouped-query attention of the same widths (per kv head a qk-wide key and a v-wide value) with heads / 16
  kv heads (DeepSeek-V3's 128 query heads -> 8 kv heads, Llama-3-405B's grouping);
- ``decompressed``: the per-head keys and values of the same attention, heads x (qk + v) per layer (an MHA cache of
  it; the "GQA equivalent" of ``plan`` and of the engine's startup line).

Then one real engine on ``--engine-preset`` (random weights, CPU): its startup line (``kv_cache_line``) and how many
blocks the same ``--kv-cache-memory`` buys with the latent pool and would buy with the decompressed form.
"""

from __future__ import annotations

import argparse

import torch

from megapipe.config import ModelConfig
from megapipe.inference.kv_cache import KVPool, kv_layout
from megapipe.parallel.plan import kv_cache_bytes
from megapipe.presets import PRESETS

BLOCKS, BLOCK_SIZE, BF16 = 4, 16, 2


def pool_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes per token of the engine's pool for ``cfg`` (bf16), counted on the allocated tensors."""
    pool = KVPool(cfg.num_layers, BLOCKS, BLOCK_SIZE, dtype=torch.bfloat16, device="cpu", **kv_layout(cfg))
    tensors = {id(t): t for t in pool.k + pool.v}.values()
    return sum(t.numel() * t.element_size() for t in tensors) // (BLOCKS * BLOCK_SIZE)


def preset_row(name: str) -> dict:
    cfg = ModelConfig(**PRESETS[name])
    planned = kv_cache_bytes(cfg)
    latent = pool_bytes_per_token(cfg)
    if latent != planned["bytes_per_token"]:
        raise SystemExit(f"{name}: the engine's pool holds {latent} bytes/token, plan says {planned['bytes_per_token']}")
    qk = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    gqa = cfg.num_layers * max(1, cfg.num_heads // 16) * (qk + cfg.v_head_dim) * BF16
    return {"latent": latent, "gqa": gqa, "decompressed": planned["gqa_equivalent_bytes_per_token"]}


def engine_line(name: str, memory: int) -> str:
    from megapipe.inference.engine import EngineConfig, GiB, LLMEngine
    from megapipe.models import build_model

    cfg = ModelConfig(**{**PRESETS[name], "vocab_size": 512, "max_position_embeddings": 256})
    engine = LLMEngine(build_model(cfg, seed=0).to(torch.bfloat16), None,
                       EngineConfig(kv_cache_memory=memory, max_model_len=256), eos_token_ids=[])
    decompressed = kv_cache_bytes(cfg)["gqa_equivalent_bytes_per_token"] * BLOCK_SIZE
    return (f"{name} engine, --kv-cache-memory {memory / GiB:.3g} GiB: {engine.kv_cache_line()}; the decompressed "
            f"form would hold {memory // decompressed} blocks")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["deepseek-v3", "kimi-k2"])
    ap.add_argument("--engine-preset", default="deepseek-v3-tiny")
    ap.add_argument("--kv-cache-memory", type=int, default=64 << 20)
    args = ap.parse_args()
    print(f"{'preset':<14}{'latent B/tok':>14}{'GQA B/tok':>12}{'ratio':>8}{'decompressed B/tok':>20}{'ratio':>8}")
    for name in args.presets:
        r = preset_row(name)
        print(f"{name:<14}{r['latent']:>14,}{r['gqa']:>12,}{r['gqa'] / r['latent']:>7.1f}x"
              f"{r['decompressed']:>20,}{r['decompressed'] / r['latent']:>7.1f}x")
    print(engine_line(args.engine_preset, args.kv_cache_memory))


if __name__ == "__main__":
    main()
