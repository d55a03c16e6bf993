"""*The* way to a ready-to-run model: ``load_model`` builds one from a megapipe checkpoint, a run directory (its
newest complete checkpoint) or a Hugging Face model directory.

From a checkpoint, the model is the one its manifest describes, its weights checked against their checksums and
loaded; LoRA adapters are loaded and folded into the base weights, ModelOpt quantizers put back. serve, generate,
eval, quantize, prune, distillation's teacher, RL's reference model and the tools all load through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from megapipe.checkpoint.dcp import checkpoint_tokenizer, load_checkpoint, verify_checkpoint
from megapipe.checkpoint.hf.bridge import load_hf_model, read_hf_config
from megapipe.checkpoint.hf.files import read_json
from megapipe.checkpoint.manifest import MANIFEST_NAME, read_manifest, resolve_checkpoint
from megapipe.checkpoint.quant_state import restore_quantized
from megapipe.config import ModelConfig, from_dict
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import CheckpointError
from megapipe.models import build_model
from megapipe.models.lora import LoRASpec, apply_lora, merge_lora


@dataclass
class LoadedModel:
    model: nn.Module  # in eval mode
    manifest: Optional[dict]  # the checkpoint's; None for a Hugging Face directory
    tokenizer_dir: Optional[Path]  # None: the checkpoint holds no tokenizer (the caller then needs --tokenizer)
    generation_config: dict  # eos_token_id and the other token ids generation uses
    _tokenizer: Any = field(default=None, repr=False)

    @property
    def tokenizer(self):
        """The tokenizer (loaded on first use: not every caller needs it), or None when there is none."""
        if self._tokenizer is None and self.tokenizer_dir is not None:
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
        return self._tokenizer

    @property
    def eos_ids(self) -> list[int]:
        return eos_ids_of(self.generation_config.get("eos_token_id"), self.tokenizer)


def load_model(
    path: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    builder: Optional[Callable[..., nn.Module]] = None,
) -> LoadedModel:
    """A megapipe checkpoint (or run dir) or a Hugging Face model directory -> a model ready to run on ``device``,
    in ``dtype`` (None: as stored). ``builder(cfg, device=...)`` (checkpoints only) defaults to ``build_model``."""
    p = Path(path).expanduser()
    if _is_hf_dir(p):
        return _from_hf(p, device, dtype)
    return _from_checkpoint(p, device, dtype, builder or build_model)


def read_model_config(path: Union[str, Path]) -> ModelConfig:
    """The config of the model ``load_model(path)`` builds, read without any weight."""
    p = Path(path).expanduser()
    if _is_hf_dir(p):
        return read_hf_config(p)[1]
    return manifest_model_config(resolve_checkpoint(p))


def read_generation_config(path: Union[str, Path]) -> dict:
    """The generation config ``load_model(path)`` gives (its token ids and sampling defaults), read without any
    weight; {} when there is none."""
    p = Path(path).expanduser()
    if _is_hf_dir(p):
        file = p / "generation_config.json"
        return read_json(file, "generation_config.json") if file.is_file() else {}
    return (read_manifest(resolve_checkpoint(p)).get("hf") or {}).get("generation_config") or {}


def read_tokenizer_dir(path: Union[str, Path]) -> Optional[Path]:
    """The directory ``load_model(path).tokenizer`` loads from (None: the checkpoint holds no tokenizer)."""
    p = Path(path).expanduser()
    if _is_hf_dir(p):
        return p
    ckpt = resolve_checkpoint(p)
    return checkpoint_tokenizer(ckpt, read_manifest(ckpt))


def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and not (p / MANIFEST_NAME).is_file()


def _from_hf(hf_dir: Path, device, dtype) -> LoadedModel:
    loaded = load_hf_model(hf_dir)
    model = loaded.model.to(device=device, dtype=dtype) if dtype else loaded.model.to(device)
    generation = hf_dir / "generation_config.json"
    gen = read_json(generation, "generation_config.json") if generation.is_file() else loaded.hf
    return LoadedModel(model.eval(), None, hf_dir, gen, loaded.tokenizer)


def _from_checkpoint(ckpt: Path, device, dtype, builder) -> LoadedModel:
    ckpt = resolve_checkpoint(ckpt)
    manifest = read_manifest(ckpt)
    cfg = manifest_model_config(ckpt, manifest)
    verify_checkpoint(ckpt, manifest, ["model/"])  # before building anything
    model = builder(cfg, device=device)
    if dtype is not None:
        model = model.to(dtype)
    lora = manifest.get("lora")
    if lora:  # LoRA adapters are extra tensors: load them, then fold them into the base weights
        apply_lora(model, LoRASpec.from_manifest(lora))
    quantized = bool(manifest.get("quantization"))
    if quantized:  # fake-quantized: put ModelOpt's quantizers back before loading their tensors
        model = restore_quantized(model, manifest["quantization"], ckpt, str(ckpt / MANIFEST_NAME)).to(device)
    load_checkpoint(ckpt, model, load_rng=False)
    if lora:
        merge_lora(model)
    if quantized and dtype is not None:
        model = model.to(dtype)  # the quantizer tensors (stored in float32) follow the weights
    model.eval()
    gen = (manifest.get("hf") or {}).get("generation_config") or {}
    return LoadedModel(model, manifest, checkpoint_tokenizer(ckpt, manifest), gen)


def manifest_model_config(ckpt: Path, manifest: Optional[dict] = None) -> ModelConfig:
    """The model config a checkpoint's manifest records (read without loading any weight: stages ask
    megapipe.models.capabilities with it before any work)."""
    manifest = read_manifest(ckpt) if manifest is None else manifest
    if not isinstance(manifest.get("model"), dict):
        raise CheckpointError(f"{ckpt / MANIFEST_NAME} has no model config ('model' is {manifest.get('model')!r})")
    return from_dict(ModelConfig, manifest["model"], "model.", f"{ckpt / MANIFEST_NAME}: ")


def eos_ids_of(value, tokenizer) -> list[int]:
    """The ids that end a generation: ``eos_token_id`` of a generation config (one id, a list or None), plus the
    tokenizer's end-of-document id."""
    ids = [value] if isinstance(value, int) else list(value or [])
    eod = getattr(tokenizer, "eod_id", None)
    if eod is not None and eod not in ids:
        ids.append(eod)
    return ids
