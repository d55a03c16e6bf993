"""The checkpoint a TensorRT-LLM export reads (megapipe.checkpoint.trt): its config and quantization, its tensors a
group at a time, and the quantization names both writers (trt_unified, trt_legacy) share."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint import quantized_linear as ql
from megapipe.checkpoint.dcp import dcp_load, verify_checkpoint
from megapipe.checkpoint.manifest import MANIFEST_NAME, read_manifest, resolve_checkpoint
from megapipe.checkpoint.safe_dcp import read_metadata
from megapipe.config import ModelConfig, from_dict
from megapipe.errors import CheckpointError
from megapipe.models.lora import LoRASpec, adapter_names, is_adapter, merge_state_dict

QUANT_ALGO = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ"}
AWQ = ("int4_awq", "w4a8_awq")
LAYER_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


class Source:
    """A checkpoint to export: its config, quantization, and its tensors read a group at a time."""

    def __init__(self, ckpt: Path):
        self.path = resolve_checkpoint(ckpt)
        self.manifest = read_manifest(self.path)
        self.where = str(self.path / MANIFEST_NAME)
        if not isinstance(self.manifest.get("model"), dict):
            raise CheckpointError(f"{self.where} has no model config")
        self.cfg: ModelConfig = from_dict(ModelConfig, self.manifest["model"], "model.", f"{self.where}: ")
        verify_checkpoint(self.path, self.manifest, ["model/"])  # before its metadata is read
        self.stored = {k: m for k, m in read_metadata(self.path / "model").state_dict_metadata.items()
                       if isinstance(m, TensorStorageMetadata)}
        q = self.manifest.get("quantization") or None
        self.fmt: Optional[str] = q.get("format") if q else None
        self.kv_cache: Optional[str] = q.get("kv_cache") if q else None
        self.producer_version = _modelopt_version(q)
        self.enabled = _enabled_quantizers(q, self.cfg.num_layers) if q else {}
        hf = self.manifest.get("hf")
        self.hf_extra = hf if isinstance(hf, dict) else {}
        lora = self.manifest.get("lora")
        self.lora_scale: Optional[float] = LoRASpec.from_manifest(lora).scale if lora else None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The stored tensors ``names`` as plain tensors (whatever layout saved them); a LoRA checkpoint's adapters
        are read with their weights and merged into them, as ``export hf`` merges them."""
        if self.lora_scale is not None:
            names = list(names) + [a for n in names for a in adapter_names(n) if a in self.stored]
        state = {n: torch.empty(tuple(self.stored[n].size), dtype=self.stored[n].properties.dtype) for n in names}
        if state:
            dcp_load(state, self.path / "model", "model", strict=False)
        return state if self.lora_scale is None else merge_state_dict(state, self.lora_scale)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return self.read([n for n in self.stored if n.startswith(prefix) and not is_adapter(n)])

    def block_size(self) -> int:
        return 128 if self.fmt in AWQ else 0

    def linear(self, state: dict, prefix: str, dtype: torch.dtype) -> Optional[ql.QLinear]:
        if f"{prefix}.weight" not in state:
            return None
        return ql.from_state(state, prefix, self.fmt, self.enabled, dtype, self.block_size())

    def experts(self, state: dict, prefix: str, dtype: torch.dtype) -> list[dict[str, ql.QLinear]]:
        """Each expert's ``w1`` / ``w3`` / ``w2`` out of quantized fused experts ``prefix`` (``layers.0.moe.experts``),
        as ModelOpt's ``_export_fused_experts`` splits them: gate and up rows of one expert's ``gate_up_proj`` and of
        its weight amax (one per-tensor amax: both keep it), the input amax shared by all experts."""
        gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
        ffn = down.shape[-1]

        def amax(quantizer: str) -> Optional[torch.Tensor]:
            name = f"{prefix}.{quantizer}"
            return state.get(f"{name}._amax") if self.enabled.get(name) else None

        def rows(t: Optional[torch.Tensor], part: slice) -> Optional[torch.Tensor]:
            return t if t is None or t.numel() == 1 else t.reshape(2 * ffn, -1)[part].reshape(-1, 1)

        def linear(weight, weight_amax, input_amax) -> ql.QLinear:
            if weight_amax is None:
                return ql.QLinear(fmt=None, weight=weight.to(dtype))
            return ql.QLinear(fmt=self.fmt, weight=weight.to(dtype), input_amax=input_amax, weight_amax=weight_amax,
                              block_size=self.block_size())

        out = []
        for e in range(gate_up.shape[0]):
            first = amax(f"gate_up_proj_weight_quantizers.{e}")
            gate_rows, up_rows = slice(0, ffn), slice(ffn, 2 * ffn)
            out.append({
                "w1": linear(gate_up[e, gate_rows], rows(first, gate_rows), amax("gate_up_proj_input_quantizer")),
                "w3": linear(gate_up[e, up_rows], rows(first, up_rows), amax("gate_up_proj_input_quantizer")),
                "w2": linear(down[e], amax(f"down_proj_weight_quantizers.{e}"), amax("down_proj_input_quantizer")),
            })
        return out

    def kv_amax(self, state: dict, i: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        pre = f"layers.{i}.attention."
        return tuple(state.get(f"{pre}{q}_bmm_quantizer._amax") if self.enabled.get(f"{pre}{q}_bmm_quantizer") else None
                     for q in ("k", "v"))


def _modelopt_version(q: Optional[dict]) -> str:
    if not q:
        return ""
    return str((q.get("modelopt") or {}).get("modelopt_version") or "")


def _enabled_quantizers(q: dict, num_layers: int) -> dict[str, bool]:
    """quantizer name -> enabled, from the ModelOpt state in the manifest (its last mode is the final one)."""
    state = q.get("modelopt") or {}
    try:
        final = state["modes"][-1]["quantizers"]
        kinds = state["kinds"]
    except (KeyError, IndexError, TypeError):
        raise CheckpointError("the manifest's quantization.modelopt has no quantizer state") from None
    out = {}
    for name, kind in final.items():
        names = [name.replace("*", str(i), 1) for i in range(num_layers)] if name.startswith("layers.*.") else [name]
        for n in names:
            out[n] = not kinds[kind].get("_disabled", False)
    return out
