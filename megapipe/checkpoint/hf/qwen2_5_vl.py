"""Qwen2_5_VLForConditionalGeneration: a Qwen2 decoder with M-RoPE (``text_config``) behind Qwen2.5-VL's vision
tower and patch merger (``vision_config``, megapipe.models.vision). The safetensors name the decoder ``model.*`` and
the tower ``visual.*`` (transformers >= 5 keeps them in memory as ``model.language_model.*`` / ``model.visual.*``,
names a checkpoint may also use)."""

from __future__ import annotations

from typing import Any

from megapipe.checkpoint.hf.base import Conversion, meta_state_keys, refuse, register, renames
from megapipe.checkpoint.hf.llama import LAYER, TOP
from megapipe.checkpoint.hf.qwen2 import Qwen2Adapter
from megapipe.config import ModelConfig
from megapipe.errors import ConfigError, MegapipeError

# megapipe's module names in the tower -> transformers' (the rest are the same)
VISION_NAMES = {"mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
                "merger.norm": "merger.ln_q", "merger.fc1": "merger.mlp.0", "merger.fc2": "merger.mlp.2"}
# transformers' config keys of the tower -> ModelConfig fields
VISION_FIELDS = {"depth": "vision_depth", "hidden_size": "vision_hidden_size",
                 "intermediate_size": "vision_intermediate_size", "num_heads": "vision_num_heads",
                 "patch_size": "vision_patch_size", "temporal_patch_size": "vision_temporal_patch_size",
                 "in_channels": "vision_in_channels", "spatial_merge_size": "vision_spatial_merge_size",
                 "window_size": "vision_window_size", "fullatt_block_indexes": "vision_fullatt_block_indexes",
                 "tokens_per_second": "vision_tokens_per_second"}
TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# names in memory (transformers >= 5) -> as the safetensors spell them
MEMORY_PREFIXES = {"model.language_model.": "model.", "model.visual.": "visual."}


@register
class Qwen25VLAdapter(Qwen2Adapter):
    architecture = "Qwen2_5_VLForConditionalGeneration"
    model_type = "qwen2_5_vl"
    arch = "qwen2_5_vl"

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        text, vision = hf.get("text_config"), hf.get("vision_config")
        if not isinstance(text, dict) or not isinstance(vision, dict):
            raise MegapipeError(f"{where}: a {self.architecture} config needs text_config and vision_config objects")
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        fields = super().config_from_hf({**text, "tie_word_embeddings": tie}, where)
        fields["arch"] = self.arch
        if vision.get("hidden_act", "silu") != "silu":
            raise refuse(where, "vision_config.hidden_act", vision.get("hidden_act"), "the vision MLP uses silu")
        if vision.get("out_hidden_size", fields["hidden_size"]) != fields["hidden_size"]:
            raise refuse(where, "vision_config.out_hidden_size", vision["out_hidden_size"],
                         f"the patch merger feeds the decoder, {fields['hidden_size']} wide")
        for key, name in VISION_FIELDS.items():
            if key in vision:
                fields[name] = list(vision[key]) if isinstance(vision[key], (list, tuple)) else vision[key]
        theta = (vision.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            fields["vision_rope_theta"] = float(theta)
        params = text.get("rope_parameters") or text.get("rope_scaling") or {}
        fields["mrope_section"] = list(params.get("mrope_section") or [16, 24, 24])
        fields.update({k: hf[k] for k in TOKEN_IDS if hf.get(k) is not None})
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        unset = next((k for k in TOKEN_IDS if getattr(cfg, k) is None), None)
        if unset is not None:
            raise ConfigError(f"model.{unset} is not set: a Hugging Face {self.architecture} config needs it (the "
                              f"tokenizer's id of that placeholder token)")
        text = super().config_to_hf(cfg)
        text["model_type"] = "qwen2_5_vl_text"
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
        vision = {key: getattr(cfg, name) for key, name in VISION_FIELDS.items()}
        vision.update(model_type="qwen2_5_vl_vision", hidden_act="silu", out_hidden_size=cfg.hidden_size,
                      initializer_range=cfg.init_std,
                      rope_parameters={"rope_type": "axial", "rope_theta": float(cfg.vision_rope_theta)})
        return dict(model_type=self.model_type, text_config=text, vision_config=vision,
                    tie_word_embeddings=cfg.tie_embeddings, **{k: getattr(cfg, k) for k in TOKEN_IDS})

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        keys = meta_state_keys(cfg)
        out = renames([k for k in keys if not k.startswith("visual.")], TOP, LAYER, "model.layers.")
        for key in keys:
            if key.startswith("visual."):
                hf = key
                for ours, theirs in VISION_NAMES.items():
                    hf = hf.replace(f".{ours}.", f".{theirs}.")
                out.append(Conversion(hf=(hf,), mp=(key,)))
        return out

    def module_name(self, tensor: str) -> str:
        """The module in memory (peft's adapters name it): transformers >= 5 nests the files' names (MEMORY_PREFIXES)."""
        module = super().module_name(tensor)
        memory = next((m for m, files in MEMORY_PREFIXES.items() if module.startswith(files)), None)
        return memory + module[len(MEMORY_PREFIXES[memory]):] if memory else module

    def aliases(self, names: set[str]) -> dict[str, str]:
        out = {}
        for name in names:
            prefix = next((p for p in MEMORY_PREFIXES if name.startswith(p)), None)
            out[name] = MEMORY_PREFIXES[prefix] + name[len(prefix):] if prefix else name
        return out
