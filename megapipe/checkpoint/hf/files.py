"""Hugging Face checkpoint files: read safetensors (one file or an index of shards) a tensor at a time, write shards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from megapipe.dtypes import HF_DTYPE_NAMES, PRECISION_DTYPES  # noqa: F401 (HF_DTYPE_NAMES: re-exported)
from megapipe.errors import MegapipeError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPES = PRECISION_DTYPES
SHORT = {v: k for k, v in DTYPES.items()}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """'5GB' -> 5_000_000_000 (KB/MB/GB decimal, KiB/MiB/GiB binary, a bare number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise MegapipeError(f"{option} {text!r} is not a size like 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if size < 1:
        raise MegapipeError(f"{option} {text!r} is less than one byte")
    return size


def read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise MegapipeError(f"{path} is missing: a Hugging Face model directory needs its {what}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MegapipeError(f"{path} is not valid JSON ({e})") from None


class SafetensorsReader:
    """The tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._open: dict[Path, Any] = {}
        if (directory / INDEX).is_file():
            index = read_json(directory / INDEX, INDEX)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise MegapipeError(f"{directory / INDEX} has no weight_map")
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SINGLE).is_file():
            self.files = {name: directory / SINGLE for name in self._handle(directory / SINGLE).keys()}
        else:
            others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
            hint = f" ({', '.join(others)} are pickles, not read: convert to safetensors)" if others else ""
            raise MegapipeError(f"{directory} holds neither {SINGLE} nor {INDEX}{hint}")
        for file in sorted(set(self.files.values())):
            if not file.is_file():
                raise MegapipeError(f"shard {file} listed in {directory / INDEX} is missing")

    def _handle(self, file: Path):
        if file not in self._open:
            from safetensors import safe_open

            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise MegapipeError(f"{file} is not a readable safetensors file ({e})") from None
        return self._open[file]

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        try:
            return self._handle(file).get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise MegapipeError(f"cannot read tensor {name} from {file} ({e})") from None

    def dtype(self) -> Optional[torch.dtype]:
        """The floating dtype most tensors are stored in (what the model was published in)."""
        counts: dict[str, int] = {}
        for file in sorted(set(self.files.values())):
            handle = self._handle(file)
            for name in handle.keys():
                dt = handle.get_slice(name).get_dtype()
                counts[dt] = counts.get(dt, 0) + 1
        names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
        known = {names[k]: v for k, v in counts.items() if k in names}
        return max(known, key=known.get) if known else None


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Group items (in order) into shards of at most ``max_bytes``; an item larger than that gets a shard alone."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
