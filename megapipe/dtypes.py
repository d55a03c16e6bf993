"""The one map from precision names (config values, --dtype flags) to torch dtypes."""

from __future__ import annotations

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}  # config.json


def dtype_of(name: str, what: str = "--dtype") -> torch.dtype:
    """'bf16' -> torch.bfloat16; an unknown name is a one-sentence error naming ``what``."""
    if name not in PRECISION_DTYPES:
        from megapipe.errors import ConfigError

        raise ConfigError(f"{what} {name!r} is not a precision (allowed: {', '.join(PRECISION_DTYPES)})")
    return PRECISION_DTYPES[name]
