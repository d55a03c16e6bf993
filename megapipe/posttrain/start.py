"""Where a post-training run starts: the same command resumes its own run, or starts from the parent's weights.

``megapipe posttrain sft --load BASE --save RUN`` (and ``distill --student BASE``, ``rl --load BASE``) is a new run
from BASE's weights (Megatron's ``--finetune``: step 0, a fresh optimizer) the first time, and the exact resume of
RUN's newest checkpoint every time after, so a killed job is restarted with the command that started it. Every
checkpoint of such a run records the checkpoint it started from (``posttrain_start``); a RUN that holds another
stage's run, or one started from another checkpoint, is refused rather than silently continued.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megapipe.checkpoint import find_latest, read_manifest, resolve_checkpoint
from megapipe.config import Config
from megapipe.errors import ConfigError

START_KEY = "posttrain_start"


def _resolved(path) -> str:
    return str(resolve_checkpoint(Path(path).expanduser()).absolute())


def recorded_start(manifest: dict) -> Optional[str]:
    """The checkpoint a run started from, as its manifest records it (RL checkpoints of earlier versions kept it
    as ``rl.start``)."""
    return manifest.get(START_KEY) or (manifest.get("rl") or {}).get("start")


def posttrain_checkpoints(cfg: Config, parent: Optional[str], stage: str) -> Config:
    """``cfg`` with checkpoint.load / finetune set: resume ``--save`` when it holds a complete checkpoint of this
    stage started from ``parent``, else load ``parent``'s weights only (None: a model initialised from scratch)."""
    c = cfg.checkpoint
    latest = find_latest(c.save) if c.save is not None and Path(c.save).is_dir() else None
    if latest is None:
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load=parent, finetune=parent is not None))
    m = read_manifest(latest)
    if m.get("stage") != stage:
        raise ConfigError(f"--save {c.save} holds a run of stage {m.get('stage')!r} ({latest}), not of stage "
                          f"{stage!r}: pick another --save directory")
    started, wanted = recorded_start(m), _resolved(parent) if parent is not None else None
    if (wanted is not None and started is not None and wanted not in (started, str(latest.absolute()))
            and Path(parent).absolute() != Path(c.save).absolute()):
        raise ConfigError(f"--save {c.save} holds a run started from {started}, not from {wanted}: resume it with "
                          "that checkpoint, or pick another --save directory")
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load=c.save, finetune=False))


def quantized_from(ckpt: Path, manifest: dict) -> Optional[tuple[str, str]]:
    """(format, the checkpoint it was quantized from) of a quantized (ModelOpt fake-quantized) checkpoint; None for
    plain weights."""
    q = manifest.get("quantization")
    if not q:
        return None
    fmt = str(q.get("format") if isinstance(q, dict) else q)
    parent = manifest.get("parent")
    return fmt, f"the checkpoint it was quantized from ({parent})" if parent else "its unquantized checkpoint"


def check_start(ckpt: Path, manifest: dict, resume: bool) -> None:
    """The one rule for where training starts (sft --load, distill --student, rl --load, pretrain --load): from plain
    weights. A quantized checkpoint (quantizers with their amax beside the weights) is refused, and so is a LoRA one
    (adapters beside the base weights) unless its own run is resumed (whose flags posttrain.lora checks)."""
    quantized = quantized_from(ckpt, manifest)
    if quantized is not None:
        fmt, origin = quantized
        raise ConfigError(f"{ckpt} is quantized ({fmt}): training starts from unquantized weights; load {origin} "
                          "instead")
    if manifest.get("lora") and not resume:
        raise ConfigError(f"{ckpt} holds LoRA adapters: merge them into a plain checkpoint first (megapipe export hf "
                          f"{ckpt} HF_DIR, then megapipe import hf HF_DIR CKPT) and load that, or resume its run "
                          "with the same --lora-* flags")


def start_of(resume: Optional[Path], parent: Optional[Path]) -> Optional[str]:
    """The checkpoint a run started from: the one its resumed checkpoint records, else its parent."""
    if resume is not None:
        return recorded_start(read_manifest(resume))
    return str(parent.absolute()) if parent is not None else None
