"""What each architecture supports, declared once: every stage asks here before it works on a model, and refuses
what is not declared in one sentence naming the architecture and the stage. The README's support table is made
from this table (``readme_table``; tests/models/test_capabilities.py keeps the two equal), and everything declared
supported runs in the matrix test (tests/test_matrix.py) or, for parallel layouts, in the layout tests.

A model's row is the meet of the rows of the block kinds it is built from (a dense layer among MoE layers limits
the model to what both kinds support; expert parallelism needs one MoE layer, the dense ones stay data-parallel
over its ranks) and of its family's row (what its Hugging Face / TensorRT-LLM twin allows).
A new block kind or family adds its row here; nothing else needs to know which architectures exist.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megapipe.errors import MegapipeError

LAYOUTS = ("dp_replicate", "dp_shard", "tp", "sp", "pp", "cp", "ep")
ENGINE = ("paged_kv", "prefix_caching", "chunked_prefill", "cpu_kernels", "speculative", "ngram_speculative",
          "multi_lora")
LORA = ("q", "k", "v", "o", "gate", "up", "down", "q_a", "kv_a", "kv_b")
MLA_LORA = ("q_a", "kv_a", "kv_b")  # multi-latent attention's down / up projections (megapipe.models.lora.TARGETS)
QUANT = ("fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4")
TRT = ("unified", "legacy")
STAGES = ("pretrain", "sft", "distill", "dpo", "rm", "prune", "rl", "eval", "generate", "serve", "quantize",
          "export_hf", "export_trt")
# what a reward model (model.num_labels, a scalar head instead of the vocabulary) goes through
REWARD_MODEL_STAGES = ("rm", "export_hf", "serve")


@dataclass(frozen=True)
class Capabilities:
    layouts: frozenset = frozenset(LAYOUTS)  # parallel dimensions
    packing: bool = True  # packed sequences (document masks, reset positions)
    engine: frozenset = frozenset(ENGINE)  # the decoding engine's features
    lora: frozenset = frozenset(LORA)  # LoRA targets (--lora-targets short names)
    quant: frozenset = frozenset(QUANT)  # posttrain quantize formats
    trt: frozenset = frozenset(TRT)  # export trt formats
    stages: frozenset = frozenset(STAGES)

    def __and__(self, other: "Capabilities") -> "Capabilities":
        meet = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            meet[f.name] = (a and b) if isinstance(a, bool) else a & b
        return Capabilities(**meet)


def _without(**removed) -> Capabilities:
    full = Capabilities()
    return Capabilities(**{k: getattr(full, k) - frozenset(v) if not isinstance(v, bool) else v
                           for k, v in removed.items()})


ALL = Capabilities()

# block kinds (megapipe.models.spec): what a layer of this kind can go through
KINDS: dict[str, Capabilities] = {
    "dense": ALL,
    # experts are 3-D weights: no width pruning rule for them; ModelOpt quantizes them as transformers' fused experts
    # (megapipe.models.fused_experts) in the formats its HF twin is checked in (w4a8_awq untested, nvfp4 needs CUDA);
    # LoRA's MLP targets are the shared expert's (the router and the routed experts are never adapted)
    "moe": _without(stages={"prune"}, quant={"w4a8_awq", "nvfp4"}),
    # multi-latent attention (megapipe.models.mla), a kind of its own beside the MLP kind: the engine decodes it from
    # its latent KV cache (tests/inference/test_mla_engine.py); ModelOpt quantizes its projections in fp8 and the
    # unified TensorRT-LLM export writes them as ModelOpt's exporter of DeepseekV3ForCausalLM does (the formats that
    # fuse or smooth projections sharing an input, and the legacy writer, know only q/k/v attention); pruning has no
    # width rule for MLA heads; every parallel layout (tests/parallel/test_dist_layouts.py: the ring attention of cp
    # carries its narrower values beside its keys); LoRA adapts the query (q: wq or wq_b), its down projection (q_a),
    # the latent's down (kv_a) and up (kv_b) projections and the output (o), under peft's names on
    # DeepseekV3ForCausalLM; the engine serves no LoRA adapters on it (its decode absorbs kv_b into the query, which
    # the per-row adapters do not reach)
    "mla": Capabilities(lora=frozenset(LORA) - {"k", "v"}, engine=frozenset(ENGINE) - {"multi_lora"},
                        quant=frozenset({"fp8"}), trt=frozenset({"unified"}),
                        stages=frozenset(STAGES) - {"prune"}),
    # Mamba-2 layers of a hybrid model (megapipe.models.mamba): packed documents reset the conv window and the SSM
    # state (megapipe.models.ssd); no context parallelism (the state would have to pass between ranks); the engine
    # keeps a recurrent state per sequence, so no prefix caching and no speculative decoding (no state snapshots to
    # cut back to after rejected drafts), and serves no LoRA adapters (not checked with the mixers); no pruning rule
    # for Mamba heads; no quantization checked for them yet (ModelOpt's export of the HF twin is the reference the
    # quantized writers are held to); TensorRT-LLM loads them unquantized from the unified (HF) layout
    "mamba": Capabilities(layouts=frozenset(LAYOUTS) - {"cp"}, engine=frozenset(ENGINE) - {
                          "prefix_caching", "speculative", "ngram_speculative", "multi_lora"},
                          quant=frozenset(), trt=frozenset({"unified"}),
                          stages=frozenset(STAGES) - {"prune", "quantize"}),
    # attention with learned sinks (GPT-OSS, megapipe.models.attention.sink_attention): every layout
    # (tests/parallel/test_dist_layouts.py: FSDP, DDP, HSDP, TP with and without SP, the sinks split with the heads,
    # PP, EP, CP, whose ring attention adds the sink to each row's log-sum-exp, and their combinations); the engine's
    # paged attention applies them (torch paths and CPU kernel), n-gram speculation too (its rollback beside the
    # windowed layer's eviction: tests/inference/test_gpt_oss_engine.py), MTP drafting was not run with them;
    # generate, serve, eval and RL run on the engine; distillation, DPO, reward models, pruning, ModelOpt and the
    # legacy TensorRT-LLM writer were not checked on them; HF export writes GptOssForCausalLM (unquantized, or with
    # --mxfp4 the experts as the published checkpoints pack them), and export trt writes that MXFP4 layout, which
    # TensorRT-LLM's PyTorch backend reads (its GptOssHfWeightMapper takes *_blocks / *_scales)
    "sinks": Capabilities(engine=frozenset(ENGINE) - {"speculative"},
                          quant=frozenset(), trt=frozenset({"unified"}),
                          stages=frozenset({"pretrain", "sft", "export_hf", "export_trt", "generate", "serve", "eval",
                                            "rl"})),
    # DeepSeek Sparse Attention (megapipe.models.dsa) on top of MLA: its frozen indexer replicated under tp (its own
    # loss, model.dsa_indexer_loss_coeff > 0, is refused with tp in megapipe.parallel.dims), every layout but cp (the
    # ring attention has no top-k mask); the engine keeps each token's indexer key in the latent pool and selects at
    # decode on its torch paths (the CPU attention kernel takes no mask; no MTP drafting: V3.2's MTP
    # layers are not imported); ModelOpt's exporter and quantizer do not know DeepseekV32ForCausalLM's indexer
    "dsa": Capabilities(layouts=frozenset(LAYOUTS) - {"cp"}, engine=frozenset(ENGINE) - {"cpu_kernels", "speculative"},
                        quant=frozenset(), trt=frozenset(),
                        stages=frozenset(STAGES) - {"prune", "quantize", "export_trt"}),
    # DeepSeek-V4's attention (megapipe.models.compressed_attention, its sinks included) with its hyper-connections:
    # every layout but cp (tests/parallel/test_dist_layouts.py: FSDP, DDP, EP; TP with and without SP over the heads
    # and output groups, its one KV head, compressors and indexer replicated (hyper_connections.v4_tp_plan); PP with
    # the hyper-connection streams between stages and the hash-routed layers on the first; their combinations); no
    # cp: ring attention through the compressor (entries pooled from blocks on other ranks) is not implemented; no
    # packed documents (a compressed block would straddle two); the engine keeps the compressed cache
    # (megapipe.inference.compressed_cache: window keys and entries paged, entries in a pool per compression rate;
    # the compressors' carry in a state slot per sequence) and drafts with its MTP module (its sliding-window block's
    # keys in the window's pool; a verification's carry advances over the kept tokens only, rejected entries and
    # keys lie past the sequence's length: tests/inference/test_deepseek_v4_speculative.py), n-gram drafts alike: no
    # prefix caching (a cached block would need a snapshot of the carry) or CPU kernels; no LoRA targets,
    # quantization, TensorRT-LLM writer, pruning rule, distillation or RL run with it yet
    "compressed": Capabilities(layouts=frozenset(LAYOUTS) - {"cp"}, packing=False,
                               engine=frozenset({"paged_kv", "chunked_prefill", "speculative", "ngram_speculative"}),
                               lora=frozenset(), quant=frozenset(),
                               trt=frozenset(),
                               stages=frozenset({"pretrain", "sft", "eval", "generate", "serve", "export_hf"})),
    # a vision tower and its projector in front of the decoder (megapipe.models.vision, model.vision_depth > 0, in
    # front of Qwen2.5-VL's or any decoder): images through serve (chat image_url parts, megapipe.data.images) and SFT (conversations with
    # images, pixels in the cached index, --freeze-vision / --freeze-projector, LoRA on the decoder with the tower
    # frozen); pretraining, eval and generate run text through the decoder (the tower idle); FSDP / HSDP / DDP over
    # the whole model (the vision blocks FSDP units), TP / SP of the decoder with the tower replicated, PP with the
    # tower on the first stage (tests/parallel/test_dist_layouts.py); no cp (M-RoPE positions not cut into the ring's
    # chunks), no ep (not run with a tower) and no packed sequences; the engine serves no LoRA adapters on it;
    # distillation / RL / pruning / quantization / the TensorRT-LLM writers were not run with the tower, so they are
    # refused; export hf only where the family's HF twin holds the tower (VISION_FAMILIES)
    "vision": Capabilities(layouts=frozenset(LAYOUTS) - {"cp", "ep"}, packing=False,
                           engine=frozenset(ENGINE) - {"speculative", "multi_lora"},
                           quant=frozenset(), trt=frozenset(),
                           stages=frozenset({"pretrain", "sft", "eval", "generate", "serve", "export_hf"})),
}
# why a kind lacks a feature, where the refusal should say (require adds it): (kind, field, value) -> the reason
FEATURE_WHY = {("sinks", "trt", "legacy"): "the legacy writer was not checked on attention sinks; TensorRT-LLM's "
               "PyTorch backend loads the unified checkpoint (trtllm-serve OUT)",
               ("compressed", "layouts", "cp"): "ring attention through DeepSeek-V4's compressor is not implemented",
               ("vision", "layouts", "cp"): "the ring attention does not cut M-RoPE's image positions into its chunks"}
# Falcon-H1's layers (megapipe.models.parallel_hybrid): a Mamba-2 mixer beside the attention, so what Mamba layers allow
KINDS["parallel_hybrid"] = KINDS["mamba"]

# families (ModelConfig.arch): what the model's Hugging Face / TensorRT-LLM twin allows
FAMILIES: dict[str, Capabilities] = {
    # a GELU MLP has no up projection; learned positions: no MTP modules (they take rotary ones), nothing to draft with
    "gpt2": _without(lora={"up"}, engine={"speculative"}),
    # no shared expert, every layer MoE: nothing but attention to adapt
    "mixtral": _without(lora={"gate", "up", "down"}),
    # no shared expert; peft (0.21 with transformers 5) retargets gate/up/down of a Qwen3-MoE to its fused experts,
    # so adapters on the dense layers' MLP would not reach a peft directory
    "qwen3_moe": _without(lora={"gate", "up", "down"}),
    # the same peft retargeting for DeepSeek-V3: its dense layers' and shared experts' MLP adapters would not reach a
    # peft directory
    "deepseek_v3": _without(lora={"gate", "up", "down"}),
    # ... and no reward model: transformers has no DeepseekV32ForSequenceClassification to export one as
    "deepseek_v32": _without(lora={"gate", "up", "down"}, stages={"rm"}),
    # squared-ReLU MLP: no up projection (w1, transformers' up_proj, is the "gate" target, as GPT-2's c_fc); no MTP
    # modules to draft with; not quantized, pruned or written in TensorRT-LLM's legacy format, even with a pattern of
    # attention and MLP layers only: ModelOpt, the legacy writer and the pruning rules were not checked on Nemotron-H;
    # no reward model: transformers has no NemotronHForSequenceClassification to export one as
    "nemotron_h": _without(lora={"up"}, engine={"speculative"}, quant=QUANT, trt={"legacy"},
                           stages={"prune", "quantize", "rm"}),
    # no reward model: transformers has no FalconH1ForSequenceClassification to export one as
    "falcon_h1": _without(stages={"rm"}),
    # no shared expert, every layer MoE: LoRA adapts the attention only
    "gpt_oss": _without(lora={"gate", "up", "down"}),
}
# sliding-window layers among full-attention ones (model.window_attn_skip_freq): the engine's paged cache takes each
# layer's window (n-gram speculation rolls back beside its eviction; MTP drafting was not run with them: an MTP
# block's cache lags the main model's by its depth, which the windowed table's eviction does not allow for), and so does the ring attention of cp; the TensorRT-LLM
# writers take one window for every layer; GPT-OSS's unified checkpoint is its published Hugging Face layout, whose
# alternation TensorRT-LLM's GPT-OSS model applies (megapipe.checkpoint.trt.check_gpt_oss)
MIXED_WINDOWS = _without(engine={"speculative"}, stages={"quantize", "export_trt"})
MIXED_WINDOWS_GPT_OSS = _without(engine={"speculative"}, stages={"quantize"}, trt={"legacy"})

# multi-token prediction modules (megapipe.models.mtp): every parallel layout (on the last pipeline stage, with a
# replica of the embedding table; their shifted tokens and labels cut from whole rows under cp; V pipeline schedules,
# which put the first and last stages on one rank, are refused in megapipe.parallel.dims); the TensorRT-LLM writers
# do not know their tensors yet; the Hugging Face bridge writes them where DeepSeek-V3 and DeepSeek-V4 keep them, and
# only there (the other families' HF twins have no MTP layers)
MTP = _without(stages={"export_trt"})
MTP_HF_FAMILIES = ("deepseek_v3", "deepseek_v4")
# speculative decoding drafts with the MTP modules (megapipe.inference.speculative): a model without them has none
NO_MTP = _without(engine={"speculative"})

# why a family (or a block kind) refuses a stage, where the table's one line does not say it (appended to the refusal)
STAGE_WHY: dict[tuple[str, str], str] = {
    ("vision", "export_hf"): "transformers' one class for this vision tower, Qwen2_5_VLForConditionalGeneration, "
                             "holds Qwen2.5-VL's decoder (model.arch = 'qwen2_5_vl') and no other",
}

LABELS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "gpt2": "GPT-2",
          "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3",
          "deepseek_v32": "DeepSeek-V3.2", "nemotron_h": "Nemotron-H", "falcon_h1": "Falcon-H1", "gpt_oss": "GPT-OSS",
          "qwen2_5_vl": "Qwen2.5-VL", "deepseek_v4": "DeepSeek-V4"}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss", "deepseek_v4")
MLA_FAMILIES = ("deepseek_v3", "deepseek_v32")
DSA_FAMILIES = ("deepseek_v32",)  # families whose MLA is DeepSeek Sparse Attention (the "dsa" kind)
SINK_FAMILIES = ("gpt_oss",)  # families whose attention has sinks (the "sinks" kind)
COMPRESSED_FAMILIES = ("deepseek_v4",)  # families of DeepSeek-V4's attention (the "compressed" kind)
VISION_FAMILIES = ("qwen2_5_vl",)  # families whose HF twin holds a vision tower (the "vision" kind)
# families whose layers are kinds the family name says: Nemotron-H's Mamba layers beside attention and MLP ones
# (megapipe.models.hybrid), Falcon-H1's parallel hybrid layers (megapipe.models.parallel_hybrid)
FAMILY_KINDS = {"nemotron_h": ["dense", "mamba"], "falcon_h1": ["parallel_hybrid"]}
KIND_LABELS = {"moe": "MoE", "mla": "MLA", "dsa": "DSA", "mamba": "Mamba", "parallel_hybrid": "Mamba | attention",
               "sinks": "attention sinks", "compressed": "compressed attention"}


def kinds_of(cfg) -> list[str]:
    """The block kinds ``cfg`` builds, in layer order of first use (MLP kinds; a hybrid model's "mamba"), then its
    attention kinds when not the default one ("mla", "dsa", "sinks", "compressed")."""
    moe = set(cfg.moe_layers)
    kinds = ["moe" if i in moe else "dense" for i in range(cfg.num_layers)]
    if cfg.layer_kinds is not None:  # a hybrid model: attention and MLP layers are what a dense block is made of
        symbols = {"M": "mamba", "E": "moe", "P": "parallel_hybrid"}
        kinds = [symbols.get(symbol, "dense") for symbol in cfg.layer_kinds]
    attention = ["mla"] if cfg.multi_latent_attention else []
    attention += ["dsa"] if getattr(cfg, "sparse_attention", False) else []
    compressed = getattr(cfg, "attention_layer_types", None) is not None  # its sinks are part of the kind
    attention += ["sinks"] if getattr(cfg, "attention_sinks", False) and not compressed else []
    attention += ["compressed"] if compressed else []
    vision = ["vision"] if getattr(cfg, "vision_depth", 0) else []
    return list(dict.fromkeys(kinds)) + attention + vision


def capabilities(cfg) -> Capabilities:
    row = _row(cfg.arch, kinds_of(cfg))
    if getattr(cfg, "mixed_windows", False):
        row = row & (MIXED_WINDOWS_GPT_OSS if cfg.arch == "gpt_oss" else MIXED_WINDOWS)
    if getattr(cfg, "vision_depth", 0) and cfg.arch not in VISION_FAMILIES:  # no HF class to write the tower with
        row = row & _without(stages={"export_hf"})
    if not getattr(cfg, "mtp_depth", 0):
        return row & NO_MTP
    return row & (MTP if cfg.arch in MTP_HF_FAMILIES else MTP & _without(stages={"export_hf"}))


def _row(arch: str, kinds: list[str]) -> Capabilities:
    row = FAMILIES.get(arch, ALL)
    for kind in kinds:
        row = row & KINDS[kind]
    if "moe" not in kinds:  # expert parallelism splits MoE layers only
        row = row & _without(layouts={"ep"})
    if "mla" not in kinds:
        row = row & _without(lora=MLA_LORA)
    return row


def describe(cfg) -> str:
    """'Mixtral', 'Llama', 'Llama (dense + MoE)': how refusals name the architecture (the kinds only where the
    family name does not already say them)."""
    kinds = kinds_of(cfg)
    label = LABELS.get(cfg.arch, cfg.arch)
    mtp = " with MTP" if getattr(cfg, "mtp_depth", 0) else ""
    mtp += " with a vision tower" if "vision" in kinds and cfg.arch not in VISION_FAMILIES else ""
    kinds = [k for k in kinds if k != "vision"]
    kinds = [k for k in kinds if not (k == "mla" and cfg.arch in MLA_FAMILIES)]  # the family name says MLA
    kinds = [k for k in kinds if not (k == "dsa" and cfg.arch in DSA_FAMILIES)]  # ... or DSA
    kinds = [k for k in kinds if not (k == "sinks" and cfg.arch in SINK_FAMILIES)]  # ... or the sinks
    kinds = [k for k in kinds if not (k == "compressed" and cfg.arch in COMPRESSED_FAMILIES)]  # ... or V4's
    family = sorted(FAMILY_KINDS.get(cfg.arch, ()))  # in any layer order
    if kinds == ["dense"] or sorted(kinds) == family or (kinds == ["moe"] and cfg.arch in MOE_FAMILIES):
        return label + mtp
    return f"{label} ({' + '.join(KIND_LABELS.get(k, k) for k in kinds)}){mtp}"


def require(cfg, stage: str, where: str = "", **features: Optional[object]) -> None:
    """Refuse (MegapipeError, one sentence) a stage, or a feature of it (``quant="fp8"``, ``trt="legacy"``,
    ``layouts=["tp", "ep"]``, ``lora=["q", "gate"]``, ``packing=True``), that ``cfg``'s architecture does not
    declare. ``where`` (a checkpoint path, a config key) starts the sentence."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    row = capabilities(cfg)
    prefix = f"{where}: " if where else ""
    name, what = describe(cfg), stage.replace("_", " ")
    if getattr(cfg, "num_labels", None) and stage not in REWARD_MODEL_STAGES:
        raise MegapipeError(f"{prefix}{what} does not take reward models (model.num_labels = {cfg.num_labels}): a "
                            "reward model is trained (posttrain rm), exported (export hf), served on /pooling or "
                            "used by posttrain rl --reward-model")
    if stage not in row.stages:
        why = next((STAGE_WHY[k, stage] for k in [cfg.arch, *kinds_of(cfg)] if (k, stage) in STAGE_WHY),
                   "megapipe/models/capabilities.py")
        raise MegapipeError(f"{prefix}{what} does not support {name} models ({why})")
    for key, value in features.items():
        if value is None or value is False:
            continue
        declared = getattr(row, key)
        if isinstance(declared, bool):
            if not declared:
                raise MegapipeError(f"{prefix}{what} of {name} models does not support {key}")
            continue
        wanted = [value] if isinstance(value, str) else list(value)
        missing = [v for v in wanted if v not in declared]
        if missing:
            have = ", ".join(v for v in _ORDER[key] if v in declared) or "none"
            why = "".join(f": {FEATURE_WHY[k, key, v]}" for k in kinds_of(cfg) for v in missing
                          if (k, key, v) in FEATURE_WHY)
            raise MegapipeError(f"{prefix}{what} of {name} models does not support {key} "
                                f"{', '.join(map(str, missing))} (supported: {have}){why}")


def requested_layouts(parallel) -> list[str]:
    """The parallel dimensions a ParallelConfig asks for beyond plain data parallelism (which every row has)."""
    asked = [name for name in ("tp", "pp", "cp", "ep") if getattr(parallel, name) > 1]
    if parallel.tp > 1 and parallel.sequence_parallel:
        asked.append("sp")
    return asked


_ORDER = {"layouts": LAYOUTS, "engine": ENGINE, "lora": LORA, "quant": QUANT, "trt": TRT, "stages": STAGES}


def family_row(arch: str) -> Capabilities:
    """The row of a Hugging Face family as the bridge imports it (the MoE families: MoE layers; the MLA ones: MLA;
    ``FAMILY_KINDS``: theirs)."""
    if arch in FAMILY_KINDS:
        return _row(arch, FAMILY_KINDS[arch])
    attention = (["mla"] if arch in MLA_FAMILIES else []) + (["dsa"] if arch in DSA_FAMILIES else [])
    attention += ["sinks"] if arch in SINK_FAMILIES else []
    attention += ["compressed"] if arch in COMPRESSED_FAMILIES else []
    attention += ["vision"] if arch in VISION_FAMILIES else []
    return _row(arch, ["moe" if arch in MOE_FAMILIES else "dense"] + attention)


def readme_table() -> str:
    """The README's support table (markdown), one row per family the HF bridge knows."""
    cols = [("stages", STAGES), ("layouts", LAYOUTS), ("quant", QUANT), ("trt", TRT), ("lora", LORA)]
    head = ["architecture", "stages", "parallel layouts", "quantization", "TensorRT-LLM", "LoRA targets", "engine"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arch, label in LABELS.items():
        row = family_row(arch)
        cells = [label]
        for key, order in cols:
            have = getattr(row, key)
            missing = [v for v in order if v not in have]
            if key == "stages":
                cells.append("all" if not missing else "all but " + ", ".join(m.replace("_", " ") for m in missing))
            else:
                cells.append(", ".join(v for v in order if v in have) or "—")
        engine = [v.replace("_", " ") for v in ENGINE if v in row.engine and v != "speculative"]
        if "speculative" in (row & MTP).engine and engine:
            engine.append("speculative (MTP models)")
        cells.append(", ".join(engine) or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
