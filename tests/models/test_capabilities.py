"""The capability table (megapipe/models/capabilities.py): the README's table is generated from it, a model's row is
the meet of its block kinds and its family, and refusals are one sentence naming the architecture and the stage."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.capabilities import capabilities, describe, family_row, readme_table, require
from tests.dist.parallel_cases import MODELS

README = Path(__file__).parents[2] / "README.md"
MIXTRAL = ModelConfig(arch="mixtral", num_experts=4)


def test_readme_table_is_the_capability_table():
    text = README.read_text()
    found = re.search(r"<!-- capabilities:begin -->\n(.*?)\n<!-- capabilities:end -->", text, re.S)
    assert found, "README.md lost its capabilities markers"
    assert found.group(1) == readme_table(), "README.md's support table is stale: regenerate it with readme_table()"


def test_a_row_is_the_meet_of_kinds_and_family():
    assert "ep" not in capabilities(ModelConfig()).layouts  # no MoE layer: nothing to split over experts
    assert "ep" in capabilities(MIXTRAL).layouts
    mixed = ModelConfig(num_experts=4, moe_first_k_dense_replace=1)  # DeepSeek-shaped: a dense layer, then MoE
    assert describe(mixed) == "Llama (dense + MoE)" and describe(MIXTRAL) == "Mixtral"
    assert "prune" not in capabilities(mixed).stages and "ep" in capabilities(mixed).layouts
    assert "up" not in family_row("gpt2").lora and "cp" in family_row("mistral").layouts


@pytest.mark.parametrize("call, words", [
    (lambda: require(MIXTRAL, "prune", "/ckpt"), "/ckpt: prune does not support Mixtral models"),
    (lambda: require(ModelConfig(), "pretrain", layouts=["tp", "ep"]),
     "pretrain of Llama models does not support layouts ep (supported: dp_replicate, dp_shard, tp, sp, pp, cp)"),
    (lambda: require(MIXTRAL, "sft", lora=["q", "gate"]), "sft of Mixtral models does not support lora gate"),
    (lambda: require(ModelConfig(**MODELS["dsv4"]), "pretrain", layouts=["tp", "pp", "cp"]),
     "pretrain of DeepSeek-V4 models does not support layouts cp (supported: dp_replicate, dp_shard, tp, sp, pp, ep): "
     "ring attention through DeepSeek-V4's compressor is not implemented"),
    # V4 drafts with its MTP module, but keeps no prefix cache (a cached block would need the carry's snapshot)
    (lambda: require(ModelConfig(**MODELS["dsv4_mtp"]), "generate", engine=["speculative", "prefix_caching"]),
     "generate of DeepSeek-V4 with MTP models does not support engine prefix_caching (supported: paged_kv, "
     "chunked_prefill, speculative, ngram_speculative)"),
    # GPT-OSS goes to TensorRT-LLM as its published MXFP4 layout (unified): why not legacy
    (lambda: require(ModelConfig(arch="gpt_oss", num_experts=4, attention_sinks=True), "export_trt", trt="legacy"),
     "export trt of GPT-OSS models does not support trt legacy (supported: unified): the legacy writer was not "
     "checked on attention sinks"),
])
def test_refusals_are_one_sentence_naming_architecture_and_stage(call, words):
    with pytest.raises(MegapipeError) as e:
        call()
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_declared_features_pass():
    require(ModelConfig(), "export_trt", trt="legacy")
    require(ModelConfig(**MODELS["dsv4_mtp"]), "serve", engine=["speculative"])
    require(ModelConfig(arch="qwen2_moe", num_experts=4), "pretrain", layouts=["ep", "tp", "sp"], packing=True)
    with pytest.raises(ValueError):
        require(ModelConfig(), "no-such-stage")


@pytest.mark.parametrize("decoder", [{"arch": "llama"}, {"arch": "mixtral", "num_experts": 4}])
def test_a_vision_tower_limits_any_decoder_to_the_vision_row(decoder):
    """The vision tower is a kind of its own: a Llama or Mixtral decoder behind it gets what both allow (Qwen2.5-VL's
    row), and export hf is refused, transformers having no class for the tower in front of this decoder."""
    vl = ModelConfig(**decoder, mrope_section=[16, 24, 24], vision_depth=2, vision_fullatt_block_indexes=[1])
    name = {"llama": "Llama", "mixtral": "Mixtral"}[decoder["arch"]] + " with a vision tower"
    assert describe(vl) == name
    row, text = capabilities(vl), capabilities(ModelConfig(**decoder))
    meet = text & family_row("qwen2_5_vl")
    assert row == dataclasses.replace(meet, stages=meet.stages - {"export_hf"})
    assert {"cp", "ep"} & row.layouts == set() and "cp" in text.layouts
    assert not row.packing and not row.quant and not row.trt and "export_hf" not in row.stages
    for call, words in [
        (lambda: require(vl, "pretrain", layouts=["tp", "cp"]),
         f"pretrain of {name} models does not support layouts cp (supported: dp_replicate, dp_shard, tp, sp, pp): "
         "the ring attention does not cut M-RoPE's image positions into its chunks"),
        (lambda: require(vl, "sft", packing=True), f"sft of {name} models does not support packing"),
        (lambda: require(vl, "quantize"), f"quantize does not support {name} models"),
        (lambda: require(vl, "export_trt"), f"export trt does not support {name} models"),
        (lambda: require(vl, "export_hf"), f"export hf does not support {name} models (transformers' one class for "
         "this vision tower, Qwen2_5_VLForConditionalGeneration, holds Qwen2.5-VL's decoder"),
    ]:
        with pytest.raises(MegapipeError) as e:
            call()
        assert str(e.value).startswith(words) and "\n" not in str(e.value)
    require(ModelConfig(arch="qwen2_5_vl", mrope_section=[16, 24, 24], vision_depth=2,
                        vision_fullatt_block_indexes=[1]), "export_hf")
