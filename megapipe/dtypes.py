"""Device and dtype names (config values, --dtype and --device flags) -> torch objects, in one place."""

from __future__ import annotations

from typing import Optional, Union

import torch

from megapipe.errors import ConfigError, MegapipeError

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}  # config.json
# an inference --dtype (generate, serve, eval): "auto" keeps the checkpoint's
INFERENCE_DTYPES = {"auto": None, **PRECISION_DTYPES, "float32": torch.float32, "float": torch.float32,
                    "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


def dtype_of(name: str, what: str = "--dtype") -> torch.dtype:
    """'bf16' -> torch.bfloat16; an unknown name is a one-sentence error naming ``what``."""
    if name not in PRECISION_DTYPES:
        raise ConfigError(f"{what} {name!r} is not a precision (allowed: {', '.join(PRECISION_DTYPES)})")
    return PRECISION_DTYPES[name]


def resolve_dtype(name: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """An inference ``--dtype`` (a name of INFERENCE_DTYPES or a torch.dtype) -> a torch.dtype, None for auto."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in INFERENCE_DTYPES:
        raise ConfigError(f"--dtype {name!r} is not one of auto, float32, bfloat16, float16")
    return INFERENCE_DTYPES[name]


def resolve_device(name: Optional[str]) -> torch.device:
    """``--device`` -> a torch.device that exists here (default: cuda when present, else cpu)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(name, torch.device):
        return name
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MegapipeError(f"--device {name!r} is not a device (use cpu, cuda or cuda:N)") from None
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and not (hasattr(backend, "is_available") and backend.is_available()):
        raise MegapipeError(f"--device {name!r}: no {device.type} device is available on this machine")
    count = backend.device_count() if device.type != "cpu" and hasattr(backend, "device_count") else None
    if device.index is not None and count is not None and device.index >= count:
        raise MegapipeError(f"--device {name!r}: this machine has {count} {device.type} device(s)")
    return device
