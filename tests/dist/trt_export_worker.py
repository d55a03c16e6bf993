"""torchrun worker for tests/checkpoint/test_trt_layouts.py (2 processes, gloo): save a model as FSDP2 shards."""

from __future__ import annotations

import sys

import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main(dst: str, arch: str) -> None:
    sys.path.insert(0, sys.argv[3])
    from quant_twins import model_config

    from megapipe.checkpoint import write_checkpoint
    from megapipe.models import build_model

    dist.init_process_group("gloo")
    cfg = model_config(arch)
    model = build_model(cfg, seed=0)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    write_checkpoint(dst, model, manifest={"model": cfg, "stage": "pretrain"})
    print(f"rank {dist.get_rank()} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
