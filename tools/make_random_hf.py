"""A random-weight Hugging Face model directory of a realistic, CPU-sized shape, made here (no hub download): for
benchmarks such as tools/bench_generate.py, whose throughput with EOS ignored does not depend on trained weights.

    .venv/bin/python tools/make_random_hf.py --arch mixtral --output /tmp/mixtral-h1024
    .venv/bin/python tools/make_random_hf.py --arch qwen3_moe --output /tmp/qwen3moe-h1024
    .venv/bin/python tools/bench_generate.py --model /tmp/mixtral-h1024 --skip vllm

Presets (every size can be overridden by its flag):

- ``mixtral``: hidden 1024, 6 layers, 16 heads / 4 KV heads (head dim 64), 8 experts of FFN 2048, top-2;
  383M parameters, 0.71 GiB in bf16 (a Mixtral-8x7B at a quarter of its width, a fifth of its depth).
- ``qwen3_moe``: hidden 1024, 8 layers, 16 heads / 4 KV heads (head dim 64, q/k norms), 16 experts of FFN 512,
  top-4, normalised top-k weights; 288M parameters, 0.54 GiB (Qwen3-30B-A3B's shape scaled down).
- ``qwen2_moe``: hidden 1024, 6 layers, 16 / 4 heads, 16 experts of FFN 512, top-4, a gated shared expert of 2048.
- ``llama``: hidden 1024, 8 layers, 16 / 4 heads, FFN 2816 (dense, for comparison).
- ``nemotron_h``: hidden 1024, 8 layers of Nemotron-H-8B's kinds in its order (``M-M*-M-M``: 4 Mamba-2, 1 attention
  without positions, 3 squared-ReLU MLP of FFN 2816), 32 Mamba heads of 64 in 8 groups, state 128, chunk 128;
  16 / 4 attention heads.

All share vocab 32000 (the embedding and the LM head are untied) and RoPE theta 1e6. Weights are normal(0, 0.02)
as transformers initialises them, from ``--seed``; the same arguments give the same directory. The tokenizer is a
byte-level BPE trained on a few sentences (megapipe.data.tokenizer.train_tokenizer): it has a few hundred tokens,
fewer than the embedding's rows, which is all a benchmark fed random token ids needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "mixtral": dict(hidden=1024, layers=6, heads=16, kv_heads=4, experts=8, topk=2, ffn=2048),
    "qwen3_moe": dict(hidden=1024, layers=8, heads=16, kv_heads=4, experts=16, topk=4, ffn=512),
    "qwen2_moe": dict(hidden=1024, layers=6, heads=16, kv_heads=4, experts=16, topk=4, ffn=512, shared_ffn=2048),
    "llama": dict(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=2816),
    "nemotron_h": dict(hidden=1024, layers=8, heads=16, kv_heads=4, ffn=2816),
}
NEMOTRON_H_PATTERN = "M-M*-M-M"  # Nemotron-H-8B's layer kinds in its order, cut to 8 layers
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
         "To be, or not to be, that is the question.", "All that glitters is not gold.",
         "Hello world! Numbers 12345 and symbols #@%."] * 20


def hf_config(arch: str, s: dict, vocab: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=4096,
                  rope_theta=1e6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if arch == "llama":
        return transformers.LlamaConfig(intermediate_size=s["ffn"], **common)
    if arch == "mixtral":
        return transformers.MixtralConfig(intermediate_size=s["ffn"], num_local_experts=s["experts"],
                                          num_experts_per_tok=s["topk"], **common)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=s["ffn"], intermediate_size=4 * s["ffn"],
                                           num_experts=s["experts"], num_experts_per_tok=s["topk"],
                                           head_dim=s["hidden"] // s["heads"], norm_topk_prob=True, **common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(moe_intermediate_size=s["ffn"], intermediate_size=4 * s["ffn"],
                                           num_experts=s["experts"], num_experts_per_tok=s["topk"],
                                           shared_expert_intermediate_size=s["shared_ffn"], norm_topk_prob=False,
                                           **common)
    if arch == "nemotron_h":
        kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
        pattern = (NEMOTRON_H_PATTERN * s["layers"])[:s["layers"]]
        common.pop("rope_theta")
        common.pop("num_hidden_layers")
        return transformers.NemotronHConfig(intermediate_size=s["ffn"], layers_block_type=[kinds[c] for c in pattern],
            head_dim=s["hidden"] // s["heads"], mamba_num_heads=32, mamba_head_dim=64, ssm_state_size=128,
            n_groups=8, chunk_size=128, **common)
    raise ValueError(arch)


def cover_vocab(path: Path, vocab: int) -> None:
    """Give every id below ``vocab`` that the small trained tokenizer lacks a text of its own (" w<id>", a byte-level
    BPE entry no merge produces): a random model emits any id, and a served stream counts text, so ids that decode
    to nothing would hold back its first chunk (a benchmark's time to first token)."""
    data = json.loads(path.read_text())
    table = data["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in data.get("added_tokens", [])}
    table.update((f"\u0120w{i}", i) for i in range(vocab) if i not in taken)
    path.write_text(json.dumps(data, ensure_ascii=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, choices=sorted(PRESETS))
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--ffn", type=int, help="FFN width of each expert (of the MLP for llama)")
    ap.add_argument("--shared-ffn", type=int, help="qwen2_moe's shared expert width")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import transformers

    from megapipe.data.tokenizer import train_tokenizer

    shape = dict(PRESETS[args.arch])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    cfg = hf_config(args.arch, shape, args.vocab)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype)).eval()
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    train_tokenizer(TEXTS, vocab_size=512, output=args.output)
    cover_vocab(args.output / "tokenizer.json", args.vocab)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.output}: {cfg.architectures[0] if cfg.architectures else type(model).__name__} "
          f"{', '.join(f'{k} {v}' for k, v in shape.items())}, vocab {args.vocab}, {params / 1e6:.0f}M parameters "
          f"({params * model.dtype.itemsize / 2**30:.2f} GiB in {args.dtype})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
