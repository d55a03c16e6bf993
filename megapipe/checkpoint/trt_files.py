"""The files a TensorRT-LLM export writes: JSON, safetensors, and safetensors shards written as tensors arrive."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from megapipe.checkpoint.hf.files import SINGLE, parse_size, shard_names, write_index


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=4) + "\n", encoding="utf-8")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict] = None) -> None:
    """safetensors refuses tensors that share memory (a tied head, one shared scale): each gets its own copy."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    own = {}
    for name, t in tensors.items():
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        own[name] = t
    save_file(own, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)  # safetensors creates 0600 files; the other outputs follow the umask


class ShardWriter:
    """Safetensors shards of at most ``max_bytes``, written as tensor groups arrive (only one shard in memory)."""

    def __init__(self, directory: Path, max_shard_size: str | int):
        self.dir = directory
        self.max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        pending = sum(t.numel() * t.element_size() for t in self.pending.values())
        if self.pending and pending + size > self.max_bytes:
            self._flush()
        self.pending.update(tensors)
        self.total += size

    def _flush(self) -> None:
        path = self.dir / f".part-{len(self.parts):05d}.safetensors"
        save_safetensors(self.pending, path, metadata={"format": "pt"})
        self.parts.append((path, list(self.pending)))
        self.pending = {}

    def close(self) -> int:
        if self.pending or not self.parts:
            self._flush()
        names = shard_names(len(self.parts)) if len(self.parts) > 1 else [SINGLE]
        weight_map = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            path.rename(self.dir / name)
            weight_map.update({k: name for k in keys})
        if len(self.parts) > 1:
            write_index(self.dir, weight_map, self.total)
        return len(self.parts)
