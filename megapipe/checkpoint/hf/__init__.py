"""The Hugging Face bridge: ``import_hf`` / ``export_hf`` and one adapter module per architecture.

Adding an architecture: a module here with an ``Adapter`` subclass decorated with ``@register``, imported below.
"""

from megapipe.checkpoint.hf import (  # noqa: F401  (registers the adapters)
    deepseek,
    falcon_h1,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    moe,
    nemotron_h,
    qwen2,
    qwen2_5_vl,
    qwen3,
)
from megapipe.checkpoint.hf.base import ADAPTERS, Adapter, Conversion, adapter_for_arch, adapter_for_hf, register
from megapipe.checkpoint.hf.bridge import export_hf, import_hf, read_hf_config

__all__ = [
    "ADAPTERS",
    "Adapter",
    "Conversion",
    "adapter_for_arch",
    "adapter_for_hf",
    "export_hf",
    "import_hf",
    "read_hf_config",
    "register",
]
