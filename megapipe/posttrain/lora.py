"""A run's LoRA: its spec from the config, the refusals before launch, and the base weights it starts from.

The adapters themselves (module surgery, merging, adapter names) are model code: megapipe.models.lora.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from megapipe.checkpoint import load_checkpoint, read_manifest
from megapipe.errors import ConfigError
from megapipe.models import build_model
from megapipe.models.lora import LoRASpec, check_rank, is_adapter, parse_targets, targeted_layers


def lora_spec(cfg) -> Optional[LoRASpec]:
    """The LoRA of a run's config (``cfg.lora``, model resolved), or None when ``lora.rank`` is 0."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    return LoRASpec(lo.rank, float(lo.alpha if lo.alpha is not None else lo.rank), lo.dropout,
                    parse_targets(lo.targets, cfg.model))


def check_lora_run(cfg, resume) -> None:
    """Refusals before launch: layouts LoRA cannot run in yet, and a resume with other LoRA flags (a new run from a
    LoRA checkpoint is refused for every stage: posttrain.start.check_start)."""
    spec = lora_spec(cfg)
    if spec is not None:
        check_rank(targeted_layers(build_model(cfg.model, device="meta"), spec.targets), spec.rank)
    if spec is not None and cfg.parallel.tp > 1:
        raise ConfigError("LoRA (--lora-rank) with tensor parallelism (--tensor-model-parallel-size "
                          f"{cfg.parallel.tp}) is not supported yet: use data parallelism (FSDP or DDP) instead")
    if resume is None:
        return
    had = read_manifest(resume).get("lora")
    want = spec.to_manifest() if spec else None
    if had != want:
        raise ConfigError(f"{resume} was trained with LoRA {had} but this run asks for {want}: resume with the "
                          "same --lora-* flags, or start a new --save directory")


def load_base_weights(ckpt, model: nn.Module) -> None:
    """Load checkpoint ``ckpt``'s weights into a model whose new adapters it does not hold (any layout); every file
    read is checked against its checksum first, as in every other load."""
    load_checkpoint(ckpt, model, load_optim=False, load_rng=False, skip=is_adapter)
