"""torchrun worker for tests/checkpoint/test_dist.py (2 processes, gloo): checkpoints across layouts.

1. load the single-process checkpoint ``SRC`` into an FSDP2-sharded model + AdamW; every full tensor must equal
   the reference the single process wrote (``SRC_ref.safetensors``);
2. train one step, save that FSDP2 state to ``DST`` (sharded), and write its full tensors to ``DST_ref.safetensors``
   so the single process can check what it loads from ``DST``;
3. load ``DST`` back into a fresh FSDP2 model and into a tensor-parallel one: equal full tensors again.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)  # 11 rows over 2 ranks: uneven shards
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(2)])
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randint(0, 11, (2, 5), generator=g)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, unsharded; the optimizer's hyper-parameters as 0-d tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    for k, v in get_optimizer_state_dict(model, opt, options=opts).items():
        if isinstance(v, torch.Tensor):
            out[f"optim.{k}"] = v
        elif isinstance(v, float) and k.endswith((".lr", ".weight_decay", ".eps")):
            out[f"optim.{k}"] = torch.tensor(v, dtype=torch.float64)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main(src: str, dst: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megapipe.checkpoint import load_checkpoint, save_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1000 + rank)  # different from the checkpoint's weights on purpose
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model)

    load_checkpoint(src, model, opt)
    ref = load_file(f"{src}_ref.safetensors")
    got = full_state(model, opt)
    assert ref.keys() == got.keys(), sorted(ref.keys() ^ got.keys())
    for k in ref:
        assert torch.equal(ref[k], got[k].to(ref[k].dtype)), f"rank {rank}: {k} differs after 1 -> FSDP2 load"

    step(model, opt, seed=5)
    ckpt = save_checkpoint(dst, 2, model, opt, manifest={"stage": "test", "parent": src})
    state = full_state(model, opt)
    if rank == 0:
        save_file(state, f"{dst}_ref.safetensors")
        assert sorted(p.name for p in (ckpt / "extra").iterdir()) == [
            "rng_rank00000.safetensors",
            "rng_rank00001.safetensors",
        ]
        assert len(list((ckpt / "model").glob("*.distcp"))) == 2
    dist.barrier()

    # and back into the same sharded layout: a fresh FSDP2 model reads what was just written
    torch.manual_seed(2000 + rank)
    again = Net()
    for block in again.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(again, mesh=mesh)
    again_opt = optimizer(again)
    load_checkpoint(dst, again, again_opt)
    for k, v in full_state(again, again_opt).items():
        assert torch.equal(state[k], v), f"rank {rank}: {k} differs after FSDP2 -> FSDP2 load"

    # and into a tensor-parallel layout (column / row / uneven column shards)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(3000 + rank)
    plan = {"blocks.0.0": ColwiseParallel(), "blocks.1.0": RowwiseParallel(), "out": ColwiseParallel()}
    tp = parallelize_module(Net(), mesh, plan)
    tp_opt = optimizer(tp)
    load_checkpoint(dst, tp, tp_opt)
    for k, v in full_state(tp, tp_opt).items():
        assert torch.equal(state[k], v), f"rank {rank}: {k} differs after FSDP2 -> TP load"
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
