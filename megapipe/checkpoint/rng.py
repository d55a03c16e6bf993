"""Per-rank RNG states (python, numpy, torch CPU, CUDA) as one safetensors file: tensors plus JSON, never pickle."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from megapipe.checkpoint.integrity import hash_bytes
from megapipe.checkpoint.manifest import write_bytes_durable
from megapipe.errors import CheckpointError


def rng_file(extra_dir: Path, rank: int) -> Path:
    return Path(extra_dir) / f"rng_rank{rank:05d}.safetensors"


def save_rng(path: Path) -> str:
    """Write this process's RNG states to ``path``; returns the file's checksum."""
    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_keys.astype(np.int64))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    meta = {
        "python": json.dumps([version, list(state), gauss]),
        "numpy": json.dumps([np_name, int(np_pos), int(np_has_gauss), float(np_gauss)]),
    }
    data = save(tensors, metadata=meta)
    write_bytes_durable(path, data)
    return hash_bytes(data)


def restore_rng(path: Path) -> None:
    from safetensors import safe_open

    try:
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        version, state, gauss = json.loads(meta["python"])
        np_name, np_pos, np_has_gauss, np_gauss = json.loads(meta["numpy"])
    except Exception as e:  # noqa: BLE001 - any damage to the file means the same thing to the user
        raise CheckpointError(f"{path}: corrupted RNG state ({type(e).__name__}: {e})") from None
    random.setstate((version, tuple(state), gauss))
    np.random.set_state((np_name, tensors["numpy_keys"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
