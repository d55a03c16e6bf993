"""torchrun worker (2 processes, gloo): an MLA + MoE model under tensor parallelism (with and without sequence
parallelism) gives the single-process loss and every gradient, the replicated latents and shared rope key included.
Prints "rank R ok"."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from megapipe.config import ModelConfig
from megapipe.models import build_model
from megapipe.parallel.tp import apply_tp

CFG = ModelConfig(arch="deepseek_v3", multi_latent_attention=True, vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
                  v_head_dim=6, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_first_k_dense_replace=1,
                  rope_interleave=True, rotary_scaling_factor=2.0, mscale_all_dim=1.0, max_position_embeddings=64)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref = build_model(CFG, seed=0)
    want = F.cross_entropy(ref(tokens).flatten(0, 1), tokens.flatten())
    want.backward()
    for sp in (True, False):
        model = build_model(CFG, seed=0)
        apply_tp(model, mesh, sequence_parallel=sp)
        loss = F.cross_entropy(full(model(tokens)).flatten(0, 1), tokens.flatten())
        loss.backward()
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            torch.testing.assert_close(full(q.grad), p.grad, atol=1e-5, rtol=1e-4, msg=f"sp={sp}: {name}")
    print(f"rank {dist.get_rank()} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
